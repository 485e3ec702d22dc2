"""The `fived` command line: train, verify, prepare-data here; plan, explore and report in `cli_plan`;
generate in `cli_generate`.

Every config field is a flag `--<section>.<field>` (generated from the dataclasses, so the defaults
live in one place); common ones have short forms (--model, --dp, --tp, --steps, ...).
Configuration errors are reported before any rank is started.
"""

from __future__ import annotations

import os

# One BLAS thread per rank: with several ranks on a few cores, more threads thrash (20-30x slower).
# Must happen before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import contextlib
import gc
import re
import sys
from typing import NoReturn

from fived.cli.calibrate import add_calibrate_command
from fived.cli.generate import add_generate_command
from fived.cli.plan import add_plan_commands
from fived.cli.tune import add_tune_command
from fived.config import build_config
from fived.errors import ConfigError, Stopped, user_error
from fived.launch.run_setup import add_config_flags, load_run, prepare_training, reshard_layout


def cmd_train(ns: argparse.Namespace) -> int:
    from fived.launch.run_setup import default_world_size
    from fived.launch.training_run import launch
    from fived.parallel.process_group import under_torchrun

    run = prepare_training(ns, default_world_size())  # (under torchrun the ranks then agree on rank 0's choice)
    code = launch(run, report=ns.report).code
    if under_torchrun():  # as every fived rank ends: gloo and DTensor can abort at interpreter exit,
        sys.stdout.flush()  # which torchrun would count as a failure and restart
        sys.stderr.flush()
        os._exit(code)
    return code


def cmd_verify(ns: argparse.Namespace) -> int:
    from fived.tools.verification import run_verify

    # (5 steps, the learning rate's warmup within them: training's 20-step warmup would draw the warning
    # of a run that never reaches its lr on every default verify; the comparison holds at any schedule)
    defaults = {"train.steps": 5, "train.warmup_steps": 1}
    if ns.nproc is None:
        defaults["parallel.dp"] = 1  # `fived verify --tp 2` means tp=2 alone, not tp=2 x dp=...
    cfg, world = load_run(ns, 1, defaults, run_dir=False)
    reshard_from = reshard_layout(ns.reshard_from, cfg) if ns.reshard_from is not None else None
    report = run_verify(cfg, world, reshard_from=reshard_from)
    return 0 if report.ok else 1


def cmd_dryrun(ns: argparse.Namespace) -> int:
    from fived.launch.run_setup import build_from_args, world_size
    from fived.layout.rules import check_config
    from fived.parallel.mesh import resolve_dp
    from fived.tools.dryrun import format_dryrun, run_dryrun

    cfg = build_from_args(ns)  # (no data or run directory: nothing is trained or written)
    world = world_size(cfg, ns.nproc, 1)
    check_config(cfg, world)
    cfg.parallel.dp = resolve_dp(cfg, world)
    print(format_dryrun(run_dryrun(cfg, world, rank=ns.rank, blocks=ns.blocks, init=not ns.no_init)), flush=True)
    return 0


def cmd_config(ns: argparse.Namespace) -> int:
    from fived.config_docs import commented_toml, markdown_table
    from fived.launch.run_setup import build_from_args

    if ns.markdown:
        print(markdown_table())
        return 0
    from fived.layout.bounds import number_errors

    cfg = build_from_args(ns)
    for err in number_errors(cfg)[:1]:  # (a value every command refuses: not printed as a config to use)
        raise err
    print(commented_toml(cfg), end="")
    return 0


def cmd_prepare_data(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from fived.data.loader import EOT_TOKENS, load_tokenizer, token_file_paths
    from fived.data.prepare import FORMAT_EXTRA, MissingExtra, input_format, prepare_data

    if Path(ns.output).name in ("", ".", ".."):  # ("" wrote .bin and .json, hidden, into the current directory)
        raise ConfigError("--output", repr(ns.output), "names no file", "give the token file's path, e.g. data/tokens")
    bin_path = token_file_paths(ns.output)[0]
    val_path = bin_path.with_name(bin_path.name[: -len(".bin")] + ".val.bin")
    written = [bin_path, *([val_path] if ns.val_fraction > 0 else [])]
    if ns.format == "megatron":
        written += [path.with_suffix(".idx") for path in written]
    for path in written:
        if path.exists():
            raise ConfigError(
                "--output", ns.output, f"{path} exists; fived does not overwrite token files", "name a new output"
            )
    for path in ns.inputs:
        if not Path(path).exists():
            raise ConfigError("inputs", path, "file not found", "give .txt, .jsonl, .parquet files or saved datasets")
        try:
            input_format(Path(path))
        except ValueError as e:
            raise ConfigError("inputs", path, str(e).split(": ", 1)[-1]) from None
    if ns.tokenizer != "byte" and not Path(ns.tokenizer).is_file():
        raise ConfigError(
            "--tokenizer", ns.tokenizer, "file not found", "give the path of a Hugging Face tokenizer.json, or 'byte'"
        )
    if not 0.0 <= ns.val_fraction < 1.0:
        raise ConfigError("--val-fraction", ns.val_fraction, "must be in [0, 1)", "e.g. 0.05")
    if load_tokenizer(ns.tokenizer).eot_id is None:
        raise ConfigError(
            "--tokenizer",
            ns.tokenizer,
            "has no end-of-document token to separate documents",
            "use a tokenizer.json with one of " + ", ".join(EOT_TOKENS),
        )
    try:
        if ns.format == "megatron":
            from fived.data.prepare_megatron import prepare_megatron

            out = prepare_megatron(
                ns.inputs, ns.output, tokenizer=ns.tokenizer, text_field=ns.text_field, val_fraction=ns.val_fraction,
                split=ns.split,
            )  # fmt: skip
        else:
            out = prepare_data(ns.inputs, ns.output, ns.tokenizer, ns.text_field, ns.val_fraction, ns.split)
    except MissingExtra as e:  # pyarrow / datasets for .parquet / saved datasets
        raise ConfigError(
            "inputs", e.input_path, f"reading it needs {e.module}, which is not installed", FORMAT_EXTRA
        ) from None
    except (ValueError, UnicodeDecodeError) as e:
        print(f"fived: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    except OSError as e:  # (a full disk, a read-only or unreadable path)
        from fived.write_errors import describe

        raise ConfigError(
            "prepare-data",
            ns.output,
            f"failed: {describe(e)}",
            "free some space, or choose readable inputs and a writable --output",
        ) from None
    pair = " (with its .idx)" if ns.format == "megatron" else ""
    print(f"wrote {out}{pair}" + (f" and {val_path}{pair}" if ns.val_fraction > 0 else ""))
    return 0


def cmd_export(ns: argparse.Namespace) -> int:
    from fived.hf.export import export

    if not 0 < ns.max_shard_gb < 1e9:  # (also nan, inf: a traceback where the size became an integer)
        raise ConfigError("--max-shard-gb", ns.max_shard_gb, "must be > 0 and finite", "e.g. 5")
    out = export(ns.source, ns.output, int(ns.max_shard_gb * 10**9))
    print(f"wrote a Hugging Face model directory: {out}")
    return 0


class OneLineParser(argparse.ArgumentParser):
    """argparse's own refusals (a flag without its value, a value of the wrong type, an unknown
    command) as fived's: one line and exit 2, the command's --help named instead of its usage block
    (its subcommands' parsers are of this class too: `add_subparsers`)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    from fived.data import OUTPUT_FORMATS

    parser = OneLineParser(prog="fived", description="5D-parallel training of Llama-style models.", allow_abbrev=False)
    parser.add_argument("--version", action="store_true", help="print fived's and torch's versions")
    sub = parser.add_subparsers(dest="command")
    train = sub.add_parser(
        "train", allow_abbrev=False, help="train a model (no arguments: the embedded tiny default on 2 CPU ranks)"
    )
    add_config_flags(train)
    train.add_argument("--report", action="store_true", help="print the ledger: bytes per rank and per collective")
    train.add_argument("--layout", help="'auto': the planner picks the fastest layout that fits the --nproc ranks")
    train.add_argument(
        "--resume",
        metavar="DIR",
        help="continue the run in DIR from its newest complete checkpoint, "
        "with the layout flags given now (any layout); 'auto': train.output_dir's newest "
        "checkpoint if it has one, else start the run there (for restarted jobs)",
    )
    train.set_defaults(func=cmd_train)
    verify = sub.add_parser(
        "verify", allow_abbrev=False, help="compare a layout with the single-process reference in float64"
    )
    add_config_flags(verify)
    verify.add_argument(
        "--reshard-from",
        metavar="FLAGS",
        help="run the first half of the steps at the layout these "
        "flags give, checkpoint, resume at this layout for the second half",
    )
    verify.set_defaults(func=cmd_verify)
    dry_help = (
        "build one rank of any layout at any world size in this process (fake process group), "
        "initialise it, take one optimizer step, and set its measured bytes beside the planner's"
    )
    dry = sub.add_parser(
        "dryrun",
        allow_abbrev=False,
        help=dry_help,
        description=dry_help + " (the run-time "
        "flags --max-restarts, --trace, --init-from, data and checkpoint fields are accepted and unused)",
    )
    add_config_flags(dry, nproc_help="the world size whose rank --rank is built (any: 512, 16384, ...)")
    dry.add_argument("--rank", type=int, required=True, help="the global rank to build")
    dry.add_argument(
        "--blocks",
        type=int,
        default=0,
        help="run forward and backward through this many of the "
        "rank's transformer blocks (one micro-batch) and compare activation bytes",
    )
    dry.add_argument("--no-init", action="store_true", help="allocate the weights without drawing their initial values")
    dry.set_defaults(func=cmd_dryrun)
    add_plan_commands(sub)
    config = sub.add_parser(
        "config",
        allow_abbrev=False,
        help="print the config these flags give as a TOML file, "
        "every field with its description (fived train --config reads it)",
    )
    add_config_flags(config, nproc_help="(unused)")
    config.add_argument("--markdown", action="store_true", help="print docs/config.md's table of every field instead")
    config.set_defaults(func=cmd_config)
    prep = sub.add_parser(
        "prepare-data",
        allow_abbrev=False,
        help="tokenize .txt, .jsonl, .parquet files or saved datasets into a token file (numpy memmap)",
    )
    prep.add_argument(
        "inputs",
        nargs="+",
        help=".txt (one document per file), .jsonl, .parquet files or directories "
        "of Dataset.save_to_disk, in order; every document ends with the end-of-document token",
    )
    prep.add_argument(
        "--output",
        required=True,
        help="output path (.bin; a .json sidecar, or with --format megatron a .idx, beside it)",
    )
    prep.add_argument(
        "--format",
        choices=OUTPUT_FORMATS,
        default="fived",
        help="fived: a token file and its sidecar; megatron: Megatron-LM's indexed dataset (.bin + .idx)",
    )
    prep.add_argument("--tokenizer", default="byte", help="'byte' or a Hugging Face tokenizer.json")
    prep.add_argument(
        "--text-field",
        default="text",
        help="the JSON field / Parquet or dataset column holding the text (default 'text')",
    )
    prep.add_argument("--split", default="train", help="the split of a saved DatasetDict (default 'train')")
    prep.add_argument(
        "--val-fraction",
        type=float,
        default=0.0,
        help="hold out the last fraction of the tokens "
        "(cut at a document end) as <output>.val.bin, for train.eval_every (default 0)",
    )
    prep.set_defaults(func=cmd_prepare_data)
    exp = sub.add_parser(
        "export", allow_abbrev=False, help="write a run's checkpoint as a Hugging Face model directory"
    )
    exp.add_argument("source", help="a run directory (its newest checkpoint) or a checkpoint directory")
    exp.add_argument("--output", required=True, help="the directory to write (new or empty)")
    exp.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size limit (default 5)")
    exp.set_defaults(func=cmd_export)
    add_generate_command(sub)
    add_calibrate_command(sub)
    add_tune_command(sub)
    parser.set_defaults(commands=sub.choices)  # (name -> its parser, for flag suggestions)
    return parser


def _refuse_unknown(unknown: list[str], parser: argparse.ArgumentParser, command) -> None:
    """An unknown `--section.field` gets the config error (with the close match); a misspelt flag the
    nearest flag of its command; anything else argparse's."""
    import difflib

    from fived.config import coerce

    flag = unknown[0].split("=", 1)[0]
    if flag.startswith("--") and "." in flag:
        section, _, key = flag[2:].partition(".")
        value = unknown[0].split("=", 1)[1] if "=" in unknown[0] else (unknown[1] if len(unknown) > 1 else "")
        build_config(overrides={f"{section}.{key}": value})  # raises the named ConfigError
        coerce(section, key, value)
    if flag.startswith("-") and command is not None:
        flags = [f for action in command._actions for f in action.option_strings if f.startswith("--")]
        match = difflib.get_close_matches(flag, flags, n=1, cutoff=0.6)
        if match:
            raise ConfigError(flag, " ".join(unknown[1:2]) or "(flag)", "unknown flag", f"did you mean {match[0]}?")
    (command or parser).error("unrecognized arguments: " + " ".join(unknown))  # (its command's --help named)


NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|nan)$", re.IGNORECASE)


def join_negative_values(argv: list[str]) -> list[str]:
    """`--train.lr -1e-3` as `--train.lr=-1e-3`: argparse takes a value that starts with '-' and is
    not a plain negative number for a flag."""
    out: list[str] = []
    for token in argv:
        if out and NEGATIVE_NUMBER.match(token) and out[-1].startswith("--") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def main(argv: list[str] | None = None) -> int:
    return _run(argv)[0]


def console() -> None:
    """The `fived` executable: `main`, then the process's exit. A command that leaves nothing to tear
    down (`quick_exit` in its parser's defaults: `fived plan`) ends without freeing its objects one by
    one: a llama3-70b plan for 512 GPUs holds ~10^5 memo entries, 0.27 s of CPU to free at exit."""
    code, quick = _run(None, quick_ok=True)
    if not quick:
        sys.exit(code)
    try:  # (what Python's exit would flush: lost by os._exit; a stream closed at the start is None)
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    except OSError as e:  # a reader gone, a full disk: the output is lost, which the exit says
        e.filename = e.filename or "the standard output"
        failed, line = user_error(e) or (1, str(e))
        code = code or failed
        with contextlib.suppress(OSError, AttributeError):
            print(line, file=sys.stderr, flush=True)
    os._exit(code)


def _run(argv: list[str] | None, *, quick_ok: bool = False) -> tuple[int, bool]:
    """(the exit code, whether the command asked for `console`'s quick exit). Such a command run by
    `console` (`quick_ok`) runs without Python's cyclic garbage collector: its garbage dies with the
    process, and a full collection walks every object the planner's memos hold (a llama3-70b plan for
    512 GPUs: 0.1 s)."""
    parser = build_parser()
    ns, unknown = parser.parse_known_args(join_negative_values(sys.argv[1:] if argv is None else list(argv)))
    if ns.version:
        import torch

        from fived.version import __version__

        print(f"fived {__version__} (torch {torch.__version__})")
        return 0, False
    if ns.command is None:
        parser.print_help()
        return 2, False
    try:
        if unknown:
            _refuse_unknown(unknown, parser, ns.commands.get(ns.command))
        quick = getattr(ns, "quick_exit", False)
        if quick and quick_ok:
            gc.disable()
        return ns.func(ns), quick
    except (ConfigError, OSError, KeyboardInterrupt, Stopped) as e:  # one line, no traceback
        code, line = user_error(e) or (1, str(e))
        print(line, file=sys.stderr)
        return code, False


if __name__ == "__main__":
    console()
