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

    request = LaunchRequest(overrides=_given(config, resume), nproc=nproc, resume=resume, layout=layout)
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
    cfg, world = load_run(LaunchRequest(overrides=given, nproc=nproc), 1, defaults)
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
    from fived.cli.plan import cluster_of
    from fived.planner.runtimes import PLANNED_RUNTIMES
    from fived.planner.search import plan as search

    if runtime not in PLANNED_RUNTIMES:
        raise ConfigError("runtime", runtime, "unknown", "one of " + ", ".join(PLANNED_RUNTIMES))
    model_config, cluster, global_batch = cluster_of(model, gpus, gpus_per_node, gpu, seq_len, global_batch_tokens)
    return search(
        model_config, cluster, seq_len, global_batch, "bfloat16", PLANNED_RUNTIMES[runtime], memory_headroom_gib
    ).plans


def _given(config: Config | None, resume: str | None) -> dict[str, Any]:
    """The fields `config` sets, as flags would give them ({"section.key": value}): those that differ
    from the defaults with its model's preset, or, resuming a named run, from that run's config."""
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
        if mine[f.section][f.key] != theirs[f.section][f.key] or (f.section, f.key) == ("model", "name")
    }
