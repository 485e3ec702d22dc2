"""From command-line arguments to a checked config and world size, before any rank starts: the
config flags (generated from the dataclasses), new runs, `--layout auto`, resumed runs
(`--resume`) and the first half of `fived verify --reshard-from`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from fived.config import Config, ConfigError, build_config, config_fields, model_preset, set_field
from fived.config_docs import SECTION_DOCS, help_text, metavar
from fived.optim.lr_schedule import decay_steps_of

SHORT_FLAGS = {
    "--model": "model.name",
    "--dp": "parallel.dp",
    "--tp": "parallel.tp",
    "--pp": "parallel.pp",
    "--cp": "parallel.cp",
    "--ep": "parallel.ep",
    "--zero": "parallel.zero",
    "--dp-replicate": "parallel.dp_replicate",
    "--pp-schedule": "parallel.pp_schedule",
    "--pp-virtual": "parallel.pp_virtual",
    "--microbatches": "train.microbatches",
    "--steps": "train.steps",
    "--seed": "train.seed",
    "--dtype": "train.dtype",
    "--seq-len": "train.seq_len",
    "--global-batch": "train.global_batch",
    "--trace": "train.trace",
    "--pp-layers": "parallel.pp_layers",
    "--max-restarts": "train.max_restarts",
    "--init-from": "train.init_from",
}


def add_config_flags(
    parser: argparse.ArgumentParser,
    *,
    nproc_help: str = "local ranks to start (default: the layout's world size, or 2)",
) -> None:
    parser.add_argument("--config", help="a TOML file with [model], [parallel], [train], [data] tables")
    parser.add_argument("--nproc", type=int, help=nproc_help)
    parser.add_argument("--dp-shard", type=int, help="HSDP: ranks a ZeRO shard spans; dp = dp_shard x dp_replicate")
    parser.add_argument(
        "--sp",
        dest="parallel.sp",
        action="store_const",
        const=True,
        default=argparse.SUPPRESS,
        help="sequence parallelism (with --tp)",
    )
    docs = {f"{f.section}.{f.key}": f.doc for f in config_fields()}
    for flag, dest in SHORT_FLAGS.items():
        parser.add_argument(flag, dest=dest, default=argparse.SUPPRESS, metavar="VALUE", help=f"--{dest}: {docs[dest]}")
    parser.usage = "%(prog)s [options] [--<section>.<field> VALUE ...]"  # (every field: the groups below)
    groups = {section: parser.add_argument_group(f"[{section}] {doc}") for section, doc in SECTION_DOCS.items()}
    for f in config_fields():
        groups[f.section].add_argument(
            f"--{f.section}.{f.key}",
            dest=f"{f.section}.{f.key}",
            default=argparse.SUPPRESS,
            metavar=metavar(f),
            help=help_text(f),
        )


def overrides_of(ns: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(ns).items() if "." in k}


@dataclass
class LaunchRequest:
    """What a launch asks for, from `fived train`'s flags (an argparse namespace, see `as_request`) or
    from the Python API (fived.api, a whole Config): the fields given, a TOML file, the ranks, a run to
    resume."""

    overrides: dict[str, Any] = field(default_factory=dict)  # {"section.key": value}: the fields given
    config: str | None = None  # a TOML file (read under the overrides)
    nproc: int | None = None  # local ranks to start (None: the layout's world size, or the default)
    dp_shard: int | None = None  # HSDP: dp = dp_shard x parallel.dp_replicate
    resume: str | None = None  # a run or checkpoint directory, or "auto"
    layout: str | None = None  # "auto": the planner's best layout
    # the API's Config, which a new run takes as it is (`overrides` then says which fields it sets:
    # a token file's sidecar or `--layout auto` fills the others; a resumed run applies them to its own)
    base: Config | None = None


def as_request(given: LaunchRequest | argparse.Namespace) -> LaunchRequest:
    if isinstance(given, LaunchRequest):
        return given
    return LaunchRequest(
        overrides_of(given),
        given.config,
        given.nproc,
        given.dp_shard,
        getattr(given, "resume", None),
        getattr(given, "layout", None),
    )


def _in_file(path: str | None, section: str, key: str) -> bool:
    if not path:
        return False
    from fived.config import tomllib

    with open(path, "rb") as f:
        return key in tomllib.load(f).get(section, {})


def build_from_args(given: LaunchRequest | argparse.Namespace, extra: dict | None = None):
    """The config from file + flags; --dp-shard resolved against the final dp_replicate. `extra`: a
    command's defaults (`fived verify`'s 5 steps), below the flags and the TOML file's values."""
    ns = as_request(given)
    in_file = file_overrides(ns.config) if extra else {}  # (a bad file refused in one line first)
    defaults = {key: value for key, value in (extra or {}).items() if key not in in_file}
    over = {**defaults, **ns.overrides}
    if ns.base is not None:
        cfg = checked_copy(ns.base)
        for key, value in (extra or {}).items():  # (a command's defaults, for the fields it leaves alone)
            if key not in ns.overrides:
                section, _, name = key.partition(".")
                set_field(cfg, section, name, value)
    else:
        cfg = build_config(ns.config, over)
    if "train.microbatches" not in over and not _in_file(ns.config, "train", "microbatches"):
        # a pipeline needs at least pp micro-batches: default to pp, as torchtitan does
        cfg.train.microbatches = max(cfg.train.microbatches, cfg.parallel.pp)
    if ns.dp_shard is not None:
        if ns.dp_shard < 1:
            raise ConfigError("--dp-shard", ns.dp_shard, "must be >= 1")
        cfg.parallel.dp = ns.dp_shard * cfg.parallel.dp_replicate
    return cfg


def checked_copy(cfg: Config) -> Config:
    """A copy of the API's `cfg`, each field checked as a flag's value would be (one ConfigError line
    for a bad one) and its model's name a preset's: the same refusals as `fived train`'s."""
    model_preset(cfg.model.name)
    values = cfg.to_dict()
    copy = Config()
    for f in config_fields():
        set_field(copy, f.section, f.key, values[f.section][f.key])
    return copy


def default_world_size() -> int:
    """`fived train`'s ranks when neither --nproc nor the layout says: one per GPU, or 2 on CPU."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def world_size(cfg, nproc: int | None, default: int) -> int:
    if nproc is not None:
        if nproc < 1:
            raise ConfigError("--nproc", nproc, "must be >= 1 (the number of local ranks to start)", "e.g. --nproc 2")
        return nproc
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    p = cfg.parallel
    return p.dp * p.tp * p.pp * p.cp if p.dp > 0 else max(p.tp * p.pp * p.cp, default)


def auto_layout(cfg, world: int) -> None:
    """`--layout auto`: the planner's best layout for `world` ranks of the local device, applied to cfg."""
    from fived.config import set_field
    from fived.parallel.process_group import device_type
    from fived.planner.basis import basis
    from fived.planner.hardware import local_hardware
    from fived.planner.runtimes import train_runtime
    from fived.planner.search import plan
    from fived.planner.timing import Cluster

    hw = local_hardware(world, cuda=device_type(cfg.train.device) == "cuda")
    cluster = Cluster(hw, world, world)
    runtime = train_runtime(cfg.train, gpu=hw.calibration != "cpu")
    search = plan(cfg.model, cluster, cfg.train.seq_len, cfg.train.global_batch, cfg.train.dtype, runtime, keep=1)
    if not search.plans:
        raise ConfigError(
            "--layout",
            "auto",
            f"no layout of {cfg.model.name} fits {world} rank(s) of {hw.name}",
            "use more ranks, a shorter train.seq_len or a smaller train.global_batch",
        )
    best = search.plans[0]
    for dotted, value in best.layout.overrides(cfg.train.global_batch).items():
        section, _, key = dotted.partition(".")
        set_field(cfg, section, key, value)
    print(
        f"fived train --layout auto: {best.layout.describe()} on {world} x {hw.name} "
        f"(predicted {best.time.total:.3g} s/step, {best.memory.total / 2**30:.2f} GiB/rank) = "
        f"{best.layout.flags(cfg.train.global_batch)}",
        flush=True,
    )
    print("  basis: " + "; ".join(basis(cfg.model, cluster, runtime, best.layout, cfg.train.seq_len)), flush=True)


def load_run(
    given: LaunchRequest | argparse.Namespace, default_world: int, defaults: dict | None = None, *, run_dir: bool = True
):
    """Config and world size, both checked (layout and data) before any rank starts; `run_dir`: the
    launch writes into train.output_dir (`fived verify` does not: it checks and creates nothing there)."""
    from fived.data.loader import adopt_token_metadata, check_data
    from fived.launch.memory_fit import check_fits
    from fived.layout.rules import check_config
    from fived.parallel.mesh import resolve_dp

    ns = as_request(given)
    cfg = build_from_args(ns, defaults)
    if cfg.train.init_from:  # the model (and tokenizer) come from the weights
        from fived.hf.init import configure_init_from

        configure_init_from(cfg, {**file_overrides(ns.config), **ns.overrides})
    else:  # a token file's sidecar names its tokenizer and vocabulary: used unless given
        adopt_token_metadata(cfg, set(ns.overrides) | set(file_overrides(ns.config)))
    world = world_size(cfg, ns.nproc, default_world)
    layout = ns.layout
    if layout is not None:
        if layout != "auto":
            raise ConfigError("--layout", layout, "unknown", "the only value is 'auto' (the planner chooses)")
        layout_flags = [k for k in ns.overrides if k.startswith("parallel.") or k == "train.microbatches"]
        if layout_flags or ns.dp_shard is not None:
            raise ConfigError(
                "--layout",
                "auto",
                "chooses the parallel layout itself, but " + ", ".join(layout_flags or ["--dp-shard"]) + " was given",
                "drop one of them",
            )
        if ns.nproc is None:
            raise ConfigError("--layout", "auto", "needs the number of ranks", "add --nproc N")
        auto_layout(cfg, world)
    check_config(cfg, world)
    cfg.parallel.dp = resolve_dp(cfg, world)  # the resolved config says what ran (not "-1: the rest")
    cfg.train.decay_steps = decay_steps_of(cfg.train)  # (and the lr plan: kept when the run is extended)
    check_fits(cfg, world)
    check_data(cfg)
    check_environment(cfg, run_dir=run_dir)
    return cfg, world


def check_environment(cfg, *, run_dir: bool = True) -> None:
    """What the config asks of this machine and its files, checked before any rank starts: the
    device, a writable run directory (`run_dir`: the launch writes one); and a warning for a warmup
    the run never finishes."""
    import sys

    import torch

    from fived.training.tracker import check_tracker

    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "train.device",
            "cuda",
            "no CUDA device is visible to this process (torch.cuda.is_available() is False)",
            "use --train.device cpu (or auto)",
        )
    if cfg.train.trace:  # (written at the end: refused now, not after the run)
        from fived.files import check_output

        check_output(cfg.train.trace, "train.trace", ours=None)
    if run_dir:
        _check_run_dir(cfg.train.output_dir)
    check_tracker(cfg.train.tracker)
    t = cfg.train
    if t.warmup_steps > t.steps:
        print(
            f"fived: warning: train.warmup_steps={t.warmup_steps} > train.steps={t.steps}: the learning rate "
            f"never reaches train.lr={t.lr:g}; e.g. --train.warmup_steps {max(1, t.steps // 10)}",
            file=sys.stderr,
            flush=True,
        )
    if line := eager_fp8_warning(t):
        print(line, file=sys.stderr, flush=True)


def eager_fp8_warning(train) -> str | None:
    """FP8 linears on a GPU without compiled blocks: torchao's float8 casts and scales then run as
    separate kernels, slower than the FP8 GEMMs save (on CPU FP8 is emulated: no speed is promised)."""
    from fived.parallel.process_group import device_type
    from fived.planner.runtimes import compiles_fused

    if train.fp8 == "none" or compiles_fused(train) or device_type(train.device) != "cuda":
        return None
    return (
        f"fived: warning: train.fp8={train.fp8} without train.compile (inductor): torchao's float8 casts run unfused, "
        "and such a run trained at 0.49x bf16's tokens/s on an H200 (docs/gpu.md); e.g. --train.compile true"
    )


def _check_run_dir(output_dir: str) -> None:
    """fived's own directory, or an absent or empty one (nothing else is written into), writable."""
    from fived.files import check_run_dir

    out = Path(output_dir)
    try:
        check_run_dir(output_dir)  # (an OSError here too: a name too long, a loop of links)
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".fived-write-test-{os.getpid()}"
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))  # (never a link's target)
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            "train.output_dir",
            output_dir,
            f"cannot be written ({e.strerror})",
            "choose a directory you can write, e.g. --train.output_dir runs/default",
        ) from None


def file_overrides(path: str | None) -> dict:
    """A TOML config file's values as {"section.key": value}."""
    if not path:
        return {}
    build_config(path)  # (refuses a missing or malformed file in one line)
    from fived.config import tomllib

    with open(path, "rb") as f:
        return {f"{section}.{key}": v for section, values in tomllib.load(f).items() for key, v in values.items()}


# What a resumed run takes from its checkpoint: changing it would make it another run.
# (data.val_path and data.valid_blend are not here: validation data is read, never trained on, so a
# resumed run may add it)
FIXED_ON_RESUME = (
    "model.",
    "data.path",
    "data.blend",
    "data.tokenizer",
    "train.seq_len",
    "train.global_batch",
    "train.seed",
    "train.optimizer",
)  # (a checkpoint holds its optimizer's state)
# The flags that describe a layout: given on resume, they define a new one from the defaults.
LAYOUT_FIELDS = ("dp", "tp", "pp", "cp", "ep", "zero", "dp_replicate", "sp", "pp_schedule", "pp_virtual", "pp_layers")


class NothingToTrain(ConfigError):
    """A resumed run whose checkpoint is already at train.steps (`value`: the resumed config's;
    `step`: the checkpoint's)."""

    def __init__(self, steps: int, step: int, hint: str) -> None:
        super().__init__("train.steps", steps, f"the checkpoint is at step {step}: nothing left to train", hint)
        self.step = step


def load_resumed_run(request: LaunchRequest | argparse.Namespace, crc: bool = True):
    """`fived train --resume DIR`: the saved config, with a new layout if any layout flag is given and
    other settings (train.steps to extend the run, lr, checkpointing...) as given; then checked."""
    from fived.checkpoint.checkpointer import check_model_shapes
    from fived.config import ParallelConfig
    from fived.data.loader import check_data
    from fived.launch.config_file import check_config_unedited
    from fived.launch.memory_fit import check_fits
    from fived.layout.rules import check_config
    from fived.parallel.mesh import resolve_dp

    ns = as_request(request)
    assert ns.resume is not None  # (what makes it a resumed run)
    checkpoint, manifest, saved = _saved_run(ns.resume, crc)
    given = {**file_overrides(ns.config), **ns.overrides}
    run_dir = Path(checkpoint).parent.parent
    if (
        "train.output_dir" in ns.overrides
        and Path(str(ns.overrides["train.output_dir"])).resolve() != run_dir.resolve()
    ):
        raise ConfigError(
            "train.output_dir",
            ns.overrides["train.output_dir"],
            f"a resumed run stays in its own directory ({run_dir})",
            "drop the flag (--resume names the run), or start a new run there",
        )
    check_config_unedited(run_dir)
    cfg, layout_given = _resumed_config(saved, given, ns.dp_shard)
    cfg.train.output_dir = str(run_dir)  # the same run directory
    default_world = int(os.environ.get("WORLD_SIZE", manifest["world_size"]))  # (torchrun's, if under it)
    world = world_size(cfg, ns.nproc, default_world) if layout_given else (ns.nproc or default_world)
    if ns.layout is not None:
        if ns.layout != "auto" or layout_given or ns.nproc is None:
            raise ConfigError(
                "--layout",
                ns.layout,
                "with --resume: 'auto' with --nproc N and no layout flags",
                f"--resume {ns.resume} --layout auto --nproc {world}",
            )
        cfg.parallel = ParallelConfig()
        auto_layout(cfg, world)
    if cfg.train.steps <= manifest["step"]:
        raise NothingToTrain(
            cfg.train.steps, manifest["step"], f"extend the run, e.g. --steps {manifest['step'] + saved.train.steps}"
        )
    check_config(cfg, world)
    cfg.parallel.dp = resolve_dp(cfg, world)
    check_fits(cfg, world)
    check_same_data(cfg, check_data(cfg), manifest["components"]["progress"]["sampler"])
    check_environment(cfg)
    check_model_shapes(cfg, checkpoint)
    return cfg, world, str(checkpoint), manifest


def check_same_data(cfg, tokens, saved: dict) -> None:
    """A resumed run's data holds the sequences (and a blend the weights) its checkpoint's run had:
    otherwise the sample order would silently change. One-line ConfigErrors."""
    from fived.data.blend import same_weights
    from fived.data.loader import BlendedTokens

    seq_len = cfg.train.seq_len
    if isinstance(tokens, BlendedTokens):
        field, value = "data.blend", cfg.data.blend
        windows: int | list[int] = [(len(t) - 1) // seq_len for t in tokens.tokens]
        weights: list[float] | None = [s.weight for s in tokens.sources]
    else:
        field, value = "data.path", cfg.data.path or "bundled corpus"
        windows, weights = (len(tokens) - 1) // seq_len, None
    if not same_weights(weights, saved.get("weights")):
        was = "a blend of weights " + str(saved["weights"]) if saved.get("weights") else "one source"
        raise ConfigError(
            field, value, f"the checkpoint's run trained on {was}: the data changed", "resume with its data"
        )
    if windows != saved["num_windows"]:
        raise ConfigError(
            field,
            value,
            f"holds {windows} sequences now, the checkpoint's run had {saved['num_windows']}: the data changed",
            "resume with the data it was trained on",
        )


def saved_run_config(resume: str):
    """The config of the newest intact checkpoint of `resume` (a run or checkpoint directory)."""
    return _saved_run(resume)[2]


def _saved_run(resume: str, crc: bool = True):
    """(checkpoint directory, manifest, saved config) of `--resume DIR`, or a one-line refusal."""
    from fived.checkpoint.checkpointer import find_checkpoint, no_intact_checkpoint, saved_config

    if not Path(resume).is_dir():
        rule = "not a directory" if Path(resume).exists() else "no such directory"
        raise ConfigError("--resume", resume, rule, "give the output directory of an earlier run")
    checkpoint = find_checkpoint(resume, "--resume", crc)
    if checkpoint is None:
        raise no_intact_checkpoint(resume, "--resume", resume, crc) or ConfigError(
            "--resume",
            resume,
            "holds no complete checkpoint (checkpoints/step-<N>/COMPLETE)",
            "give the output directory of a run that saved one (checkpoint.every or checkpoint.final)",
        )
    return (checkpoint, *saved_config(checkpoint, "--resume"))


def _resumed_config(saved, given: dict, dp_shard: int | None):
    """The saved config with the given settings: fixed ones must not change; layout flags, if any,
    start a new layout from the defaults (micro-batches kept unless given, at least pp)."""
    import copy

    from fived.config import ParallelConfig, set_field

    if "data.blend" in given and _same_blend(str(given["data.blend"]), saved.data.blend):
        given = {k: v for k, v in given.items() if k != "data.blend"}  # (the checkpoint's string stays)
    for key, value in given.items():
        if key.startswith(FIXED_ON_RESUME):
            section, _, name = key.partition(".")
            probe = copy.deepcopy(saved)
            set_field(probe, section, name, value)
            if probe != saved:
                raise ConfigError(
                    key,
                    value,
                    f"a resumed run keeps the checkpoint's {key} ({getattr(getattr(saved, section), name, '...')})",
                    "drop the flag, or start a new run",
                )
    if not saved.train.decay_steps:  # (a checkpoint from before train.decay_steps: its run planned train.steps)
        saved.train.decay_steps = saved.train.steps
    cfg = copy.deepcopy(saved)
    layout_given = dp_shard is not None or any(k in {f"parallel.{f}" for f in LAYOUT_FIELDS} for k in given)
    if layout_given:
        others = {k: v for k, v in vars(saved.parallel).items() if k not in LAYOUT_FIELDS}
        cfg.parallel = ParallelConfig(**others)  # (reduce dtype, keep-gathered: as saved unless given)
        cfg.train.microbatches = max(saved.train.microbatches, int(given.get("parallel.pp", 1)))
    for key, value in given.items():
        section, _, name = key.partition(".")
        set_field(cfg, section, name, value)
    if dp_shard is not None:
        cfg.parallel.dp = dp_shard * cfg.parallel.dp_replicate
    # the lr plan: the checkpoint's (0 keeps it), unless --train.decay_steps N plans another on purpose
    cfg.train.decay_steps = cfg.train.decay_steps or saved.train.decay_steps
    return cfg, layout_given


def _same_blend(given: str, saved: str) -> bool:
    """Whether two blend strings name the same sources with the same normalised weights ("6 a 3 b"
    is "0.6 a 0.3 b"); a bad string is not the same (the check that follows names it)."""
    from fived.data.blend import parse_blend, same_weights

    try:
        a, b = parse_blend(given), parse_blend(saved)
    except ValueError:
        return False
    return [x.path for x in a] == [y.path for y in b] and same_weights([x.weight for x in a], [y.weight for y in b])


@dataclass
class TrainingRun:
    """What `fived train` will run: the checked config, the world size, and where it starts."""

    cfg: Config
    world: int
    resume: str | None = None  # the checkpoint it continues from
    resumed_step: int = 0
    fresh_dir: bool = True  # a new run gets a new directory (output_dir-1, ... if it was used)
    finished: bool = False  # --resume auto of a run that already reached train.steps


def prepare_training(request: LaunchRequest | argparse.Namespace, default_world: int) -> TrainingRun:
    """--resume DIR (continue that run), --resume auto (continue train.output_dir if it holds a
    checkpoint, else start a run there: what a restarted job runs), or a new run. Under torchrun only
    global rank 0 reads checkpoints whole (CRC-32): the other ranks' choice is provisional, replaced by
    rank 0's once the ranks have joined (fived.launch.training_run.agreed_run)."""
    from fived.checkpoint.checkpointer import find_checkpoint, no_intact_checkpoint
    from fived.parallel.process_group import under_torchrun

    ns = as_request(request)
    crc = not under_torchrun() or os.environ.get("RANK", "0") == "0"
    if ns.resume == "auto":
        cfg, world = load_run(ns, default_world)
        if find_checkpoint(cfg.train.output_dir, crc=crc) is None:
            refusal = no_intact_checkpoint(cfg.train.output_dir, "--resume", "auto", crc)
            if refusal:
                raise refusal
            return TrainingRun(cfg, world, fresh_dir=False)
        ns = dataclasses.replace(ns, resume=cfg.train.output_dir)
        try:
            cfg, world, checkpoint, manifest = load_resumed_run(ns, crc)
        except NothingToTrain as done:  # (a restarted job that had already finished: the resumed run's
            cfg.train.steps = done.value  # train.steps, not this command's default, is what it reached)
            return TrainingRun(cfg, world, resumed_step=done.step, finished=True)
        return TrainingRun(cfg, world, checkpoint, manifest["step"], fresh_dir=False)
    if ns.resume:
        cfg, world, checkpoint, manifest = load_resumed_run(ns, crc)
        return TrainingRun(cfg, world, checkpoint, manifest["step"], fresh_dir=False)
    cfg, world = load_run(ns, default_world)
    return TrainingRun(cfg, world)


LAYOUT_KEYS = ("parallel.", "train.microbatches")


def _same_value(cfg, dotted: str, value) -> bool:
    """Whether the flag `--dotted value` gives what `cfg` already holds (a repeated, not a differing, flag)."""
    from fived.config import coerce

    section, _, key = dotted.partition(".")
    try:
        return coerce(section, key, value) == cfg.to_dict()[section][key]
    except ConfigError:
        return False


class RaisingParser(argparse.ArgumentParser):
    """A parser of flags inside a flag's value: its refusals raise ValueError (the caller's one line
    names the flag), never argparse's usage block and exit."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def reshard_layout(flags: str, cfg):
    """`--reshard-from "<layout flags>"`: the first half's config and world size (only the layout differs)."""
    import copy
    import shlex

    from fived.config import ParallelConfig, set_field
    from fived.layout.rules import check_config

    if not flags.strip():  # (an empty value would verify the run without any reshard, silently)
        raise ConfigError("--reshard-from", repr(flags), "no layout flags", 'e.g. --reshard-from "--dp 4 --zero 1"')
    parser = RaisingParser(prog="fived verify --reshard-from", add_help=False, allow_abbrev=False)
    add_config_flags(parser)
    example = 'e.g. --reshard-from "--dp 4 --zero 1"'
    try:
        ns, unknown = parser.parse_known_args(shlex.split(flags))
    except ValueError:
        raise ConfigError("--reshard-from", flags, "not a list of layout flags", example) from None
    given = overrides_of(ns)
    differs = [k for k, v in given.items() if not k.startswith(LAYOUT_KEYS) and not _same_value(cfg, k, v)]
    other = unknown + differs + (["--config"] if ns.config else [])
    if other:
        raise ConfigError(
            "--reshard-from", flags, f"only layout flags may differ between the halves ({other[0]})", example
        )
    first = copy.deepcopy(cfg)
    first.parallel = ParallelConfig(dp=1 if ns.nproc is None else -1)
    first.train.microbatches = max(1, int(given.get("parallel.pp", 1)))
    for key, value in given.items():
        section, _, name = key.partition(".")
        set_field(first, section, name, value)
    if ns.dp_shard is not None:
        first.parallel.dp = ns.dp_shard * first.parallel.dp_replicate
    if cfg.train.steps < 2:
        raise ConfigError(
            "train.steps", cfg.train.steps, "--reshard-from splits the run in two halves: needs >= 2", "--steps 4"
        )
    world = world_size(first, ns.nproc, 1)
    check_config(first, world)
    return first, world
