"""`fived tune`: the planner's top layouts for a model on these ranks, each run for a few steps on the
machine itself, the planner refitted on what they measured, and the fastest measured layout with its
`fived train` command.

1. Search (`fived.planner.search.plan`, priced by a machine profile with --machine, else by
   `local_hardware`): the `top` fastest layouts that fit, in the planner's order, one per shape
   (`distinct`: mesh, schedule, micro-batch, checkpointing).
2. Trials: each layout in its own forked process group (`fived.launch.ranks.run_ranks`: a trial that
   fails - out of memory, an error on a rank, past its share of the time - is reported and skipped,
   and the next starts on fresh ranks). A trial builds fived's Trainer, takes warm-up steps, then timed
   steps until its share of the budget is spent; a step's time is the slowest rank's, a trial's the
   median over its timed steps, with the trainer's measured breakdown (`fived.training.step_timer`).
3. Refit: one factor per component of the planner's step (compute, each dimension's exposed
   communication, the bubble, the optimizer, the overhead: `fived.training.breakdown.COMPARED`), the
   measured component over the predicted one summed over the trials, all scaled by the median ratio of
   measured to refitted steps (what the slowest rank waits for, beyond the mean breakdown); every
   searched layout is re-priced with them and re-ranked. The factors are fitted on the trials, so the error after the refit is an
   in-sample figure (how well the planner's structure describes this machine), printed as such.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field

from fived.config import Config, set_field
from fived.layout.layout import Layout
from fived.training.breakdown import COMPARED, planned_components

WARMUP_STEPS = 2
MIN_TIMED_STEPS = 3
MAX_TIMED_STEPS = 200
PLANNING_SHARE = 0.1  # of the budget kept for the search and the refit
FIRST_TIMED_SHARE = 0.35  # of the first trial's share timed (the rest: its start-up, not yet measured)


@dataclass
class Trial:
    layout: Layout
    predicted: dict[str, float]  # the planner's components (COMPARED), seconds
    measured_s: float | None = None  # median step, the slowest rank's
    components: dict[str, float] = field(default_factory=dict)  # measured, mean over ranks and steps
    steps: int = 0
    failure: str = ""

    @property
    def predicted_s(self) -> float:
        return sum(self.predicted.values())


def trial_config(cfg: Config, layout: Layout) -> Config:
    """cfg running `layout`, for as many steps as a trial may take, logging and saving nothing."""
    import copy

    out = copy.deepcopy(cfg)
    for dotted, value in layout.overrides(cfg.train.global_batch).items():
        section, _, key = dotted.partition(".")
        set_field(out, section, key, value)
    out.train.steps = WARMUP_STEPS + MAX_TIMED_STEPS + 1
    out.train.log_every = 10**9
    out.train.breakdown = True
    return out


def _trial_rank(cfg: Config, seconds: float) -> dict:
    """One rank of a trial: warm-up steps, then timed steps (each after a barrier) until rank 0's clock
    says the trial's time is spent (at least MIN_TIMED_STEPS, at most MAX_TIMED_STEPS)."""
    import torch
    import torch.distributed as dist

    from fived.training.trainer import Trainer

    trainer = Trainer(cfg, log=False)
    for s in range(WARMUP_STEPS):
        dist.barrier()
        trainer.step(s)
    deadline = time.monotonic() + seconds
    times: list[float] = []
    breakdowns: list[dict] = []
    while True:
        dist.barrier()
        start = time.perf_counter()
        record = trainer.step(WARMUP_STEPS + len(times))
        times.append(time.perf_counter() - start)
        breakdowns.append(record["breakdown"])
        done = len(times) >= MAX_TIMED_STEPS or (len(times) >= MIN_TIMED_STEPS and time.monotonic() > deadline)
        flag = torch.tensor([1 if done else 0])
        dist.broadcast(flag, 0)  # (rank 0's clock decides, so every rank stops after the same step)
        if flag.item():
            break
    from fived.training.breakdown import compared, mean_breakdown

    return {"times": times, "components": compared(mean_breakdown(breakdowns, skip_first=False))}


def run_trial(trial: Trial, cfg: Config, world: int, seconds: float) -> None:
    """Measure `trial` on `world` fresh ranks; a failure is recorded on it, never raised."""
    from fived.launch.ranks import run_ranks

    try:
        results = run_ranks(
            world,
            _trial_rank,
            trial_config(cfg, trial.layout),
            seconds,
            timeout_s=max(60.0, 4 * seconds),
            deadline_s=60.0 + 4 * seconds,
            device="cpu",
        )
    except Exception as e:  # (a trial's failure is a finding about that layout, not the end of the tune)
        lines = str(e).strip().splitlines()
        reason = getattr(e, "reason", "") or (lines[-1] if lines else type(e).__name__)
        trial.failure = f"failed: {reason}"[:240]
        return
    steps = len(results[0]["times"])
    trial.steps = steps
    trial.measured_s = statistics.median(max(r["times"][i] for r in results) for i in range(steps))
    trial.components = {k: statistics.mean(r["components"][k] for r in results) for k in COMPARED}


def refit(trials: list[Trial]) -> dict[str, float]:
    """One factor per component: measured over predicted, summed over the measured trials (1 where the
    planner predicts none of it); then all of them times the median over the trials of the measured
    step over the step so refitted. (The ranks' mean breakdown leaves out what the slowest rank waits
    for, which the measured step, the slowest rank's, includes.)"""
    done = [t for t in trials if t.measured_s is not None]
    factors = {}
    for k in COMPARED:
        want = sum(t.predicted[k] for t in done)
        got = sum(t.components.get(k, 0.0) for t in done)
        factors[k] = got / want if want > 1e-12 and got > 0 else 1.0
    if done:
        scale = statistics.median((t.measured_s or 0.0) / refitted_s(t.predicted, factors) for t in done)
        factors = {k: v * scale for k, v in factors.items()}
    return factors


def refitted_s(predicted: dict[str, float], factors: dict[str, float]) -> float:
    return sum(factors[k] * v for k, v in predicted.items())


def errors(trials: list[Trial], factors: dict[str, float] | None = None) -> list[float]:
    """Each measured trial's |predicted / measured - 1|, in percent (priced with `factors`, else as planned)."""
    ones = dict.fromkeys(COMPARED, 1.0)
    return [abs(refitted_s(t.predicted, factors or ones) / t.measured_s - 1) * 100 for t in trials if t.measured_s]


def median_error(trials: list[Trial], factors: dict[str, float] | None = None) -> float:
    found = errors(trials, factors)
    return statistics.median(found) if found else float("nan")


SHAPE_FIELDS = ("tp", "sp", "pp", "pp_schedule", "pp_virtual", "cp", "cp_mode", "ep", "micro_batch", "checkpointing")


def distinct(plans: list) -> list:
    """The best plan of each shape (mesh, schedule, micro-batch, checkpointing), in the planner's order:
    the planner's ZeRO and overlap variants of one shape differ by less than a few steps' noise, so
    measuring them side by side would tell little."""
    seen, out = set(), []
    for p in plans:
        key = tuple(getattr(p.layout, name) for name in SHAPE_FIELDS)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def tune(cfg: Config, world: int, *, minutes: float, top: int, hardware=None, out=sys.stdout) -> dict:
    """Search, measure, refit (see the module docstring); prints as it goes and returns the summary."""
    from fived.parallel.process_group import device_type
    from fived.planner.hardware import local_hardware
    from fived.planner.runtimes import train_runtime
    from fived.planner.search import plan
    from fived.planner.timing import Cluster

    started = time.monotonic()
    budget = minutes * 60
    hw = hardware or local_hardware(world, cuda=device_type(cfg.train.device) == "cuda")
    # every fitting layout priced (no `keep`): the refit re-ranks them all, not what a pruned search kept
    cluster = Cluster(hw, world, world)
    search = plan(
        cfg.model,
        cluster,
        cfg.train.seq_len,
        cfg.train.global_batch,
        cfg.train.dtype,
        train_runtime(cfg.train, gpu=hw.calibration != "cpu"),
    )
    ranked = [p for p in search.plans if p.fits]
    trials = [Trial(p.layout, planned_components(p.time)) for p in distinct(ranked)[:top]]
    print(
        f"fived tune: {cfg.model.name} on {world} x {hw.name}, budget {minutes:g} min: measuring the planner's top "
        f"{len(trials)} of {len(ranked)} layouts that fit",
        file=out,
        flush=True,
    )
    start_up = None  # seconds a trial spends outside its timed steps (forking, building, warming up)
    for i, trial in enumerate(trials):
        left = budget * (1 - PLANNING_SHARE) - (time.monotonic() - started)
        share = left / (len(trials) - i)
        timed = share * FIRST_TIMED_SHARE if start_up is None else max(share - start_up, 0.5)
        if start_up is not None and left < start_up + timed:
            trial.failure = "skipped: the budget is spent"
            continue
        begun = time.monotonic()
        run_trial(trial, cfg, world, timed)
        if trial.measured_s is not None:
            spent = time.monotonic() - begun - trial.steps * trial.measured_s
            start_up = spent if start_up is None else max(start_up, spent)
        got = f"{trial.measured_s * 1e3:.1f} ms ({trial.steps} steps)" if trial.measured_s else trial.failure
        print(f"  [{i + 1}/{len(trials)}] {trial.layout.describe()}: {got}", file=out, flush=True)
    factors = refit(trials)
    rescored = sorted(ranked, key=lambda p: refitted_s(planned_components(p.time), factors))
    measured = [t for t in trials if t.measured_s is not None]
    summary: dict = {
        "trials": trials,
        "factors": factors,
        "error_before": median_error(trials),
        "error_after": median_error(trials, factors),
        "worst_after": max(errors(trials, factors), default=float("nan")),
        "refit_pick": rescored[0].layout if rescored else None,
        "seconds": time.monotonic() - started,
    }
    summary["winner"] = min(measured, key=lambda t: t.measured_s or 0.0) if measured else None
    return summary
