"""fived as a Python library: `from fived import Config, train, verify, plan`.

Each function does what its command does, with the same checks (a bad config raises `ConfigError`,
one line, before any process starts) and keyword-only options:

    train(config, nproc=2)          fived train: returns the run's RunSummary
    verify(config, nproc=2)         fived verify: returns the VerifyReport (report.ok, its figures)
    plan("llama3-8b", gpus=64, seq_len=8192, global_batch_tokens=2**22)
                                    fived plan: the fitting layouts, fastest first

Importing fived imports no torch; these functions do when called.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from fived.config import Config, ConfigError, ModelConfig, build_config, config_fields
from fived.launch.run_summary import RunSummary

if TYPE_CHECKING:
    from fived.planner.search import Plan
    from fived.tools.verification import VerifyReport


class TrainingFailed(RuntimeError):
    """A launch that did not finish: `code` is `fived train`'s exit code for it (1 a rank failed, 65
    diverged, 75 preempted after saving, 130/143 stopped), `line` what it said."""

    def __init__(self, code: int, line: str):
        super().__init__(line or f"training ended with exit code {code}")
        self.code, self.line = code, line


def train(
    config: Config | None = None,
    *,
    nproc: int | None = None,
    resume: str | None = None,
    layout: Literal["auto"] | None = None,
    report: bool = False,
    progress: bool = True,
) -> RunSummary | None:
    """Train `config` (default: the embedded tiny run) as `fived train` does, and return its summary.

    nproc: local ranks to start (default: the layout's world size, or one per GPU, or 2 on CPU); in a
        process torchrun started, this process is one of torchrun's ranks instead (every rank returns
        the summary).
    resume: a run or checkpoint directory to continue ("auto": train.output_dir's newest checkpoint,
        if any); `config`, if given, is the checkpoint's config with the fields to change (a larger
        train.steps extends the run; the lr plan of its steps is kept, see fived.optim.lr_schedule).
    layout: "auto": the planner's best layout for `nproc` ranks.
    report: print the ledger (`fived train --report`); progress: show the progress bar.

    Writes train.output_dir (a directory a previous run used: a new one beside it, -1, -2, ...).
    Returns None when a resumed run had already reached train.steps; raises ConfigError before any
    rank starts, TrainingFailed when a launch ends early.
    """
    from fived.launch.run_setup import LaunchRequest, default_world_size, prepare_training
    from fived.launch.training_run import launch

    given = _given(config, resume)
    request = LaunchRequest(overrides=given, nproc=nproc, resume=resume, layout=layout, base=config)
    run = prepare_training(request, default_world_size())
    outcome = launch(run, report=report, progress=progress)
    if outcome.code != 0:
        raise TrainingFailed(outcome.code, outcome.line)
    return outcome.summary


def verify(
    config: Config | None = None, *, nproc: int | None = None, printer: Callable[[str], Any] | None = print
) -> VerifyReport:
    """Train `config`'s layout and the single-process reference on the same global batches in float64
    (its train.steps; `fived verify` defaults to 5) and compare losses, gradient norms and final
    parameters. nproc: ranks (default: the layout's world size, dp 1 when nothing sets it). printer:
    where the per-step table goes (None: nowhere). The report's `ok`: within 1e-9."""
    from fived.launch.run_setup import LaunchRequest, load_run
    from fived.tools.verification import run_verify

    given = _given(config, None)
    defaults = {"parallel.dp": 1} if nproc is None else {}  # (a tp=2 config means tp=2 alone, not tp=2 x dp)
    cfg, world = load_run(LaunchRequest(overrides=given, nproc=nproc, base=config), 1, defaults, run_dir=False)
    return run_verify(cfg, world, printer=printer or (lambda line: None))


def plan(
    model: str | ModelConfig,
    *,
    gpus: int,
    seq_len: int,
    global_batch_tokens: int,
    gpu: str = "h100",
    gpus_per_node: int = 8,
    runtime: str = "fived",
    memory_headroom_gib: float = 3.0,
) -> list[Plan]:
    """The layouts of `model` (a preset name, a TOML config's path, or a ModelConfig) that fit `gpus`
    GPUs of type `gpu` (a100, h100, h200, h800, b200, mi300x or a hardware .toml) with `memory_headroom_gib`
    left free, fastest first, as `fived plan` ranks them: each Plan's layout (`.layout.flags(global_batch)`
    runs it), its memory per GPU and predicted step time. runtime: plan for fived or, to compare, another."""
    from fived.planner.runtimes import PLANNED_RUNTIMES
    from fived.planner.search import plan as search

    if runtime not in PLANNED_RUNTIMES:
        raise ConfigError("runtime", runtime, "unknown", "one of " + ", ".join(PLANNED_RUNTIMES))
    model_config, cluster, global_batch = cluster_of(model, gpus, gpus_per_node, gpu, seq_len, global_batch_tokens)
    return search(
        model_config, cluster, seq_len, global_batch, "bfloat16", PLANNED_RUNTIMES[runtime], memory_headroom_gib
    ).plans


def cluster_of(
    model, gpus: int, gpus_per_node: int, gpu: str, seq: int, global_batch_tokens: int, *, machine: str | None = None
):
    """(ModelConfig, Cluster, global batch in sequences), each value checked (one line per bad one):
    `model` is a preset name, a TOML config's path or a ModelConfig; `machine` a machine profile
    (`fived calibrate`) that prices the ranks instead of `gpu` (CPU ranks: every rank in one machine)."""
    from fived.config import ModelConfig
    from fived.layout.rules import check_model
    from fived.planner.hardware import hardware
    from fived.planner.timing import Cluster

    for flag, value, example in (
        ("--gpus", gpus, 64),
        ("--gpus-per-node", gpus_per_node, 8),
        ("--seq", seq, 8192),
        ("--global-batch-tokens", global_batch_tokens, 4194304),
    ):
        if value < 1:
            raise ConfigError(flag, value, "must be >= 1", f"e.g. {flag} {example}")
    if global_batch_tokens % seq:
        raise ConfigError(
            "--global-batch-tokens",
            global_batch_tokens,
            f"must be a multiple of --seq {seq}",
            f"e.g. {max(1, global_batch_tokens // seq) * seq}",
        )
    if gpus > gpus_per_node and gpus % gpus_per_node:
        from fived.layout.bounds import largest_divisor

        raise ConfigError(
            "--gpus-per-node",
            gpus_per_node,
            f"must divide --gpus {gpus} (a cluster of whole nodes)",
            f"e.g. --gpus-per-node {largest_divisor(gpus, gpus_per_node)}",
        )
    model_config = model if isinstance(model, ModelConfig) else plan_model(model)
    check_model(model_config)
    if machine:
        from fived.planner.profile import profile_hardware, read_profile

        profile = read_profile(machine)
        per_node = min(gpus_per_node, gpus) if profile.on_gpu else gpus  # (CPU ranks: one host)
        return model_config, Cluster(profile_hardware(profile, gpus), gpus, per_node), global_batch_tokens // seq
    return model_config, Cluster(hardware(gpu), gpus, min(gpus_per_node, gpus)), global_batch_tokens // seq


def plan_model(name: str):
    """A preset name, a TOML config's [model] table, or (what `fived plan --serve` also takes) a fived
    run or checkpoint or a Hugging Face model directory."""
    from pathlib import Path

    from fived.config import model_preset

    if name.endswith(".toml"):
        return build_config(name).model
    if Path(name).is_dir():
        from fived.hf.init import source_model

        try:
            return source_model(name)[0]
        except ConfigError as e:  # (the source is --model here, not training's --init-from)
            raise ConfigError("--model" if e.field == "--init-from" else e.field, e.value, e.rule, e.hint) from None
    return model_preset(name)


def _given(config: Config | None, resume: str | None) -> dict[str, Any]:
    """The fields `config` sets ({"section.key": value}): those that differ from the defaults with its
    model's preset or, resuming a named run, from that run's config (which takes only these)."""
    if config is None:
        return {}
    if resume not in (None, "auto"):
        from fived.launch.run_setup import saved_run_config

        base = saved_run_config(resume)
    else:
        base = build_config(overrides={"model.name": config.model.name})  # (refuses a name that is no preset)
    mine, theirs = config.to_dict(), base.to_dict()
    return {
        f"{f.section}.{f.key}": mine[f.section][f.key]
        for f in config_fields()
        if mine[f.section][f.key] != theirs[f.section][f.key]
    }
