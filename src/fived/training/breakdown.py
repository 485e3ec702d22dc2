"""The measured step breakdown of a run, set against the planner's prediction for its layout.

Each rank measures every step (`fived.training.step_timer`); a run's figure per rank is the mean over its
steps after the first (the first builds the schedule, allocates and warms up). The planner's
`StepTime` for the same layout is mapped onto the measured components:

    measured                                   predicted (fived.planner.timing)
    compute = forward + backward + recompute   compute + per-layer host work (StepTime.layer_host)
    tp, cp, ep (exposed collectives)           tp, cp, ep
    dp = dp, dp_cp, dp_shard(_cp), dp_replicate, edp collectives   dp
    bubble = the schedule's waits (P2P included) + pp collectives   bubble + pp
    optimizer (with Muon's exchange)           optimizer
    overhead = data + logging + checkpoint + other                 overhead - layer_host
"""

from __future__ import annotations

import sys
from collections import defaultdict

from fived.config import Config

COMPARED = ("compute", "tp", "cp", "ep", "dp", "bubble", "optimizer", "overhead")
DP_GROUPS = ("dp", "dp_cp", "dp_shard", "dp_shard_cp", "dp_replicate", "edp")


def mean_breakdown(breakdowns: list[dict], *, skip_first: bool = True) -> dict:
    """The mean of a rank's per-step breakdowns, its first step left out (`skip_first`) when there
    are others."""
    steps = breakdowns[1:] if skip_first and len(breakdowns) > 1 else breakdowns
    if not steps:
        return {}
    n = len(steps)
    out: dict = {"steps": n, "total_s": sum(b["total_s"] for b in steps) / n}
    for key in ("components", "overlapped", "stage_compute_s"):
        summed: dict[str, float] = defaultdict(float)
        for b in steps:
            for k, v in b.get(key, {}).items():
                summed[k] += v
        out[key] = {k: v / n for k, v in summed.items()}
    # per stage, each micro-batch's compute, mean over the steps (where every step has the same shape)
    per_step = [b.get("microbatch_s", []) for b in steps]
    shape = [len(stage) for stage in per_step[0]]
    out["microbatch_s"] = []
    if all([len(stage) for stage in p] == shape for p in per_step):
        out["microbatch_s"] = [
            [sum(p[s][i] for p in per_step) / n for i in range(width)] for s, width in enumerate(shape)
        ]
    return out


def compared(measured: dict) -> dict[str, float]:
    """A rank's measured components on the planner's terms (see the module docstring)."""
    c = measured.get("components", {})
    dims = {k[len("comm_") :]: v for k, v in c.items() if k.startswith("comm_")}
    out = {
        "compute": sum(c.get(k, 0.0) for k in ("forward", "backward", "recompute")),
        "tp": dims.pop("tp", 0.0),
        "cp": dims.pop("cp", 0.0),
        "ep": dims.pop("ep", 0.0),
        "dp": sum(dims.pop(g, 0.0) for g in DP_GROUPS),
        "bubble": c.get("bubble", 0.0) + dims.pop("pp", 0.0),
        "optimizer": c.get("optimizer", 0.0) + dims.pop("optimizer", 0.0),
    }  # (Muon's exchange)
    out["overhead"] = sum(c.get(k, 0.0) for k in ("data", "logging", "checkpoint", "other")) + sum(dims.values())
    return out


def predicted(cfg: Config, world: int, hardware=None) -> tuple[dict[str, float], dict] | None:
    """(the planner's components for this run's layout, the hardware as a dict), or None where the
    planner has no description of the device."""
    from dataclasses import asdict

    from fived.config import ConfigError
    from fived.layout.layout import Layout
    from fived.parallel.process_group import device_type
    from fived.planner.hardware import local_hardware
    from fived.planner.runtimes import train_runtime
    from fived.planner.timing import Cluster, step_time

    try:
        hw = hardware or local_hardware(world, cuda=device_type(cfg.train.device) == "cuda")
    except ConfigError:
        return None
    layout = Layout.from_config(cfg, world)
    try:
        t = step_time(
            cfg.model,
            layout,
            Cluster(hw, world, world),
            cfg.train.seq_len,
            cfg.train.global_batch,
            cfg.train.dtype,
            train_runtime(cfg.train, gpu=hw.calibration != "cpu"),
        )
    except Exception as e:  # (the run's own figures are written whatever the planner makes of it)
        print(f"fived: no planner prediction for this run's step ({type(e).__name__}: {e})", file=sys.stderr)
        return None
    return planned_components(t), asdict(hw)


def planned_components(t) -> dict[str, float]:
    """The planner's `StepTime` on the measured components' terms (COMPARED)."""
    # the planner's pp (P2P transfer) is time the pipeline waits: measured within the bubble
    # the planner's per-layer host work runs inside the layers' forward and backward: measured as compute
    return {
        "compute": t.compute + t.layer_host,
        "tp": t.tp,
        "cp": t.cp,
        "ep": t.ep,
        "dp": t.dp,
        "bubble": t.bubble + t.pp,
        "optimizer": t.optimizer,
        "overhead": t.overhead - t.layer_host,
    }


def run_breakdown(cfg: Config, world: int, per_rank: list[list[dict]]) -> dict:
    """What run.json keeps: each rank's mean breakdown and the planner's prediction."""
    ranks = [mean_breakdown(b) for b in per_rank]
    out: dict = {"ranks": ranks}
    pred = predicted(cfg, world)
    if pred is not None:
        out["predicted"], out["hardware"] = pred
    return out
