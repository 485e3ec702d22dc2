"""The `fived` command line: train, verify, plan, prepare-data.

Every config field is a flag `--<section>.<field>` (generated from the dataclasses, so the defaults
live in one place); common ones have short forms (--model, --dp, --tp, --steps, ...).
Configuration errors are reported before any rank is started.
"""
from __future__ import annotations

import os

# One BLAS thread per rank: with several ranks on a few cores, more threads thrash (20-30x slower).
# Must happen before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import sys  # noqa: E402

from fived.config import ConfigError, build_config, config_fields  # noqa: E402

SHORT_FLAGS = {
    "--model": "model.name", "--dp": "parallel.dp", "--tp": "parallel.tp", "--pp": "parallel.pp",
    "--cp": "parallel.cp", "--ep": "parallel.ep", "--zero": "parallel.zero",
    "--dp-replicate": "parallel.dp_replicate",
    "--pp-schedule": "parallel.pp_schedule", "--pp-virtual": "parallel.pp_virtual",
    "--microbatches": "train.microbatches", "--steps": "train.steps", "--seed": "train.seed",
    "--dtype": "train.dtype", "--seq-len": "train.seq_len", "--global-batch": "train.global_batch",
    "--trace": "train.trace", "--pp-layers": "parallel.pp_layers",
}


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="a TOML file with [model], [parallel], [train], [data] tables")
    parser.add_argument("--nproc", type=int, help="local ranks to start (default: the layout's world size, or 2)")
    parser.add_argument("--dp-shard", type=int, help="HSDP: ranks a ZeRO shard spans; dp = dp_shard x dp_replicate")
    parser.add_argument("--sp", dest="parallel.sp", action="store_const", const=True, default=argparse.SUPPRESS,
                        help="sequence parallelism (with --tp)")
    for flag, dest in SHORT_FLAGS.items():
        parser.add_argument(flag, dest=dest, default=argparse.SUPPRESS, help=f"= --{dest}")
    group = parser.add_argument_group("every config field (defaults from fived.config)")
    for section, name, default, kind in config_fields():
        group.add_argument(f"--{section}.{name}", dest=f"{section}.{name}", default=argparse.SUPPRESS,
                           metavar=kind.upper(), help=f"default {default!r}")


def _overrides(ns: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(ns).items() if "." in k}


def _in_file(path: str | None, section: str, key: str) -> bool:
    if not path:
        return False
    from fived.config import tomllib

    with open(path, "rb") as f:
        return key in tomllib.load(f).get(section, {})


def _build(ns: argparse.Namespace, extra: dict | None = None):
    """The config from file + flags; --dp-shard resolved against the final dp_replicate."""
    over = {**(extra or {}), **_overrides(ns)}
    cfg = build_config(ns.config, over)
    if "train.microbatches" not in over and not _in_file(ns.config, "train", "microbatches"):
        # a pipeline needs at least pp micro-batches: default to pp, as torchtitan does
        cfg.train.microbatches = max(cfg.train.microbatches, cfg.parallel.pp)
    if ns.dp_shard is not None:
        if ns.dp_shard < 1:
            raise ConfigError("--dp-shard", ns.dp_shard, "must be >= 1")
        cfg.parallel.dp = ns.dp_shard * cfg.parallel.dp_replicate
    return cfg


def _world(cfg, nproc: int | None, default: int) -> int:
    if nproc:
        return nproc
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    p = cfg.parallel
    return p.dp * p.tp * p.pp * p.cp if p.dp > 0 else max(p.tp * p.pp * p.cp, default)


def _auto_layout(cfg, world: int) -> None:
    """`--layout auto`: the planner's best layout for `world` ranks of the local device, applied to cfg."""
    from fived.config import coerce
    from fived.planner.hardware import local_hardware
    from fived.planner.search import plan
    from fived.planner.timing import Cluster

    hw = local_hardware(world)
    search = plan(cfg.model, Cluster(hw, world, world), cfg.train.seq_len, cfg.train.global_batch, cfg.train.dtype)
    if not search.plans:
        raise ConfigError("--layout", "auto", f"no layout of {cfg.model.name} fits {world} rank(s) of {hw.name}",
                          "use more ranks, a shorter train.seq_len or a smaller train.global_batch")
    best = search.plans[0]
    for dotted, value in best.layout.overrides(cfg.train.global_batch).items():
        section, _, key = dotted.partition(".")
        setattr(getattr(cfg, section), key, coerce(section, key, value))
    print(f"fived train --layout auto: {best.layout.describe()} on {world} x {hw.name} "
          f"(predicted {best.time.total:.3g} s/step, {best.memory.total / 2**30:.2f} GiB/rank) = "
          f"{best.layout.flags(cfg.train.global_batch)}", flush=True)


def _load(ns: argparse.Namespace, default_world: int, defaults: dict | None = None):
    """Config and world size, both checked (layout and data) before any rank starts."""
    from fived.data import check_data
    from fived.mesh import check_config

    cfg = _build(ns, defaults)
    world = _world(cfg, ns.nproc, default_world)
    layout = getattr(ns, "layout", None)
    if layout is not None:
        if layout != "auto":
            raise ConfigError("--layout", layout, "unknown", "the only value is 'auto' (the planner chooses)")
        given = [k for k in _overrides(ns) if k.startswith("parallel.") or k == "train.microbatches"]
        if given or ns.dp_shard is not None:
            raise ConfigError("--layout", "auto", "chooses the parallel layout itself, but "
                              + ", ".join(given or ["--dp-shard"]) + " was given", "drop one of them")
        if ns.nproc is None:
            raise ConfigError("--layout", "auto", "needs the number of ranks", "add --nproc N")
        _auto_layout(cfg, world)
    check_config(cfg, world)
    check_data(cfg)
    return cfg, world


def cmd_train(ns: argparse.Namespace) -> int:
    import torch

    from fived.launch import init_distributed, run_ranks, shutdown_distributed, under_torchrun
    from fived.mesh import resolve_dp
    from fived.metrics import fresh_output_dir
    from fived.parallel.pipeline import write_chrome_trace
    from fived.report import format_report
    from fived.train import run_training

    default_world = torch.cuda.device_count() if torch.cuda.is_available() else 2  # (device auto)
    cfg, world = _load(ns, default_world)
    if under_torchrun():
        init_distributed(device=cfg.train.device)
        if int(os.environ["RANK"]) == 0:  # only rank 0 writes the log
            cfg.train.output_dir = str(fresh_output_dir(cfg.train.output_dir))
        result = run_training(cfg)
        if cfg.train.trace:  # every rank's timeline, gathered to rank 0
            import torch.distributed as dist

            timelines = [None] * dist.get_world_size()
            dist.all_gather_object(timelines, result.timeline)
            if dist.get_rank() == 0:
                write_chrome_trace(cfg.train.trace, [a for t in timelines for a in t])
        if ns.report and int(os.environ["RANK"]) == 0:
            print(format_report(cfg, world, [result]))
        shutdown_distributed()
        return 0
    cfg.train.output_dir = str(fresh_output_dir(cfg.train.output_dir))
    print(f"fived train: model {cfg.model.name}, {world} local rank(s), layout "
          f"dp={resolve_dp(cfg, world)} tp={cfg.parallel.tp} "
          f"pp={cfg.parallel.pp} cp={cfg.parallel.cp} ep={cfg.parallel.ep} zero={cfg.parallel.zero}, "
          f"{cfg.train.steps} steps -> {cfg.train.output_dir}/metrics.jsonl", flush=True)
    results = run_ranks(world, run_training, cfg, device=cfg.train.device)
    if cfg.train.trace:
        write_chrome_trace(cfg.train.trace, [a for r in results for a in r.timeline])
        print(f"pipeline trace of {world} rank(s) -> {cfg.train.trace}")
    first, last = results[0].metrics[0], results[0].metrics[-1]
    print(f"loss {first['loss']:.4f} (step {first['step']}) -> {last['loss']:.4f} (step {last['step']}); "
          f"{last['tokens_per_s']:.0f} tokens/s, MFU {last['mfu']:.1%}")
    if ns.report:
        print(format_report(cfg, world, results))
    return 0


def cmd_verify(ns: argparse.Namespace) -> int:
    from fived.verify import run_verify

    defaults = {"train.steps": 5}
    if ns.nproc is None:
        defaults["parallel.dp"] = 1  # `fived verify --tp 2` means tp=2 alone, not tp=2 x dp=...
    cfg, world = _load(ns, 1, defaults)
    report = run_verify(cfg, world)
    return 0 if report.ok else 1


def cmd_prepare_data(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from fived.data import prepare_data

    bin_path = Path(ns.output if ns.output.endswith(".bin") else ns.output + ".bin")
    if bin_path.exists():
        raise ConfigError("--output", ns.output, f"{bin_path} exists; fived does not overwrite token files",
                          "name a new output")
    for path in ns.inputs:
        if not Path(path).is_file():
            raise ConfigError("inputs", path, "file not found", "give existing text files")
    out = prepare_data(ns.inputs, ns.output, ns.tokenizer)
    print(f"wrote {out}")
    return 0


def _plan_model(name: str):
    """A preset name or a TOML config's [model] table."""
    from fived.config import model_preset

    if name.endswith(".toml"):
        return build_config(name).model
    return model_preset(name)


def cmd_plan(ns: argparse.Namespace) -> int:
    import json

    from fived.planner import calibration, explain
    from fived.planner.hardware import hardware
    from fived.planner.search import plan
    from fived.planner.timing import Cluster

    if ns.validate:
        calibration.validate(ns.validate)
        return 0
    missing = [flag for flag, v in (("--model", ns.model), ("--gpus", ns.gpus), ("--seq", ns.seq),
                                    ("--global-batch-tokens", ns.global_batch_tokens)) if v is None]
    if missing:
        raise ConfigError(missing[0], None, "required", "fived plan --model llama3-8b --gpus 64 --gpus-per-node 8 "
                          "--gpu h100 --seq 8192 --global-batch-tokens 4194304 (or --validate FILE.csv)")
    model = _plan_model(ns.model)
    for flag, value in (("--gpus", ns.gpus), ("--gpus-per-node", ns.gpus_per_node), ("--seq", ns.seq),
                        ("--global-batch-tokens", ns.global_batch_tokens), ("--top", ns.top)):
        if value < 1:
            raise ConfigError(flag, value, "must be >= 1")
    if ns.global_batch_tokens % ns.seq:
        raise ConfigError("--global-batch-tokens", ns.global_batch_tokens, f"must be a multiple of --seq {ns.seq}",
                          f"e.g. {max(1, ns.global_batch_tokens // ns.seq) * ns.seq}")
    cluster = Cluster(hardware(ns.gpu), ns.gpus, min(ns.gpus_per_node, ns.gpus))
    global_batch = ns.global_batch_tokens // ns.seq
    search = plan(model, cluster, ns.seq, global_batch, "bfloat16")  # bf16 mixed precision, priced at the bf16 peak
    if ns.json:
        print(json.dumps(explain.to_json(search, model, cluster, ns.seq, global_batch, ns.top), indent=1))
    else:
        model_arg = f"--config {ns.model}" if ns.model.endswith(".toml") else f"--model {ns.model}"
        print(explain.report(search, model, cluster, ns.seq, global_batch, ns.top, model_arg))
    return 0 if search.plans else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fived", description="5D-parallel training of Llama-style models.",
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command")
    train = sub.add_parser("train", allow_abbrev=False, help="train a model (no arguments: the embedded tiny default on 2 CPU ranks)")
    _add_config_flags(train)
    train.add_argument("--report", action="store_true", help="print the ledger: bytes per rank and per collective")
    train.add_argument("--layout", help="'auto': the planner picks the fastest layout that fits the --nproc ranks")
    train.set_defaults(func=cmd_train)
    verify = sub.add_parser("verify", allow_abbrev=False, help="compare a layout with the single-process reference in float64")
    _add_config_flags(verify)
    verify.set_defaults(func=cmd_verify)
    planp = sub.add_parser("plan", allow_abbrev=False, help="rank 5D layouts for a model on a cluster by predicted memory and step time")
    planp.add_argument("--model", help="a preset (llama3-405b, mixtral-8x7b, ...) or a TOML config with a [model] table")
    planp.add_argument("--gpus", type=int, help="GPUs in the job")
    planp.add_argument("--gpus-per-node", type=int, default=8, help="GPUs sharing NVLink (default 8)")
    planp.add_argument("--gpu", default="h100", help="a100, h100, h200, h800, b200, mi300x or a hardware .toml")
    planp.add_argument("--seq", type=int, help="sequence length")
    planp.add_argument("--global-batch-tokens", type=int, help="tokens per optimizer step")
    planp.add_argument("--top", type=int, default=5, help="plans to list (default 5)")
    planp.add_argument("--json", action="store_true", help="machine-readable output")
    planp.add_argument("--validate", metavar="FILE.csv", help="predict published runs and print the error per row")
    planp.set_defaults(func=cmd_plan)
    prep = sub.add_parser("prepare-data", help="tokenize text files into a token file (numpy memmap)")
    prep.add_argument("inputs", nargs="+", help="text files, concatenated in order")
    prep.add_argument("--output", required=True, help="output path (.bin; a .json sidecar is written beside it)")
    prep.add_argument("--tokenizer", default="byte", help="'byte' or a Hugging Face tokenizer.json")
    prep.set_defaults(func=cmd_prepare_data)
    return parser


def _refuse_unknown(unknown: list[str], parser: argparse.ArgumentParser) -> None:
    """An unknown `--section.field` gets the config error (with the close match); anything else argparse's."""
    from fived.config import coerce

    flag = unknown[0].split("=", 1)[0]
    if flag.startswith("--") and "." in flag:
        section, _, key = flag[2:].partition(".")
        value = unknown[0].split("=", 1)[1] if "=" in unknown[0] else (unknown[1] if len(unknown) > 1 else "")
        build_config(overrides={f"{section}.{key}": value})  # raises the named ConfigError
        coerce(section, key, value)
    parser.error("unrecognized arguments: " + " ".join(unknown))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns, unknown = parser.parse_known_args(argv)
    if ns.command is None:
        parser.print_help()
        return 2
    try:
        if unknown:
            _refuse_unknown(unknown, parser)
        return ns.func(ns)
    except ConfigError as e:
        print(f"fived: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
