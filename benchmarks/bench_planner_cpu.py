"""The planner against fived's measured step times on CPU ranks: predicted vs measured per layout.

On N CPU ranks (gloo, one thread each; `fived.launch.ranks.run_ranks` forks them), in ONE process group,
fived's Trainer runs every layout of LAYOUTS (the tiny models: every dimension, every ZeRO stage,
HSDP, SP) and the layout `fived train --layout auto` picks for these ranks. After warmup, timed steps
interleave the layouts (order reversed every other round), each after a barrier; a step's time is
the slowest rank's, a layout's the median over its steps. The planner predicts each layout's step
(`fived.planner.timing.step_time` on `local_hardware`: this host's measured matmul rate and the
CPU constants of `fived.planner.hardware.CPU`). Printed: measured vs predicted per layout, the median
absolute error, and whether the auto choice is within 10% of the fastest measured layout.

    python benchmarks/bench_planner_cpu.py                # 4 ranks, 20 timed steps per layout
    python benchmarks/bench_planner_cpu.py --fit          # refit the CPU constants on these times
    python benchmarks/bench_planner_cpu.py --machine PROFILE.json   # priced by `fived calibrate`'s profile

--machine prices every layout with a machine profile's measured curves (fived.planner.profile)
instead of the fitted CPU constants: the profile is fitted on micro-benchmarks only, so these
layouts are held out of it. Printed besides: Spearman's rank correlation of predicted and measured
times, and the planner's top pick among the measured layouts against the fastest measured.

--fit refits the CPU entry's gemm_efficiency and its per-layer, per-step and per-collective overheads and link
speed by coordinate descent on the median absolute error, prints them (what hardware.CPU holds is
what it printed here) and the leave-one-layout-out error (each layout predicted by constants fitted
without it). Other agents sharing the cores make single steps noisy: check `uptime` first.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import replace

os.environ.setdefault("OMP_NUM_THREADS", "1")  # run_ranks sets it per rank too

import torch.distributed as dist

from fived.config import build_config
from fived.launch.ranks import run_ranks
from fived.planner.calibration import spearman

# (model, parallel fields, micro-batches): every dimension and ZeRO stage of the tiny models
LAYOUTS = [
    ("tiny", dict(dp=4, zero=0), 1),
    ("tiny", dict(dp=4, zero=1), 1),
    ("tiny", dict(dp=4, zero=2), 1),
    ("tiny", dict(dp=4, zero=3), 1),
    ("tiny", dict(dp=4, zero=3, dp_replicate=2), 1),
    ("tiny", dict(dp=2, tp=2, zero=0), 1),
    ("tiny", dict(dp=2, tp=2, sp=True, zero=1), 1),
    ("tiny", dict(dp=1, tp=4), 1),
    ("tiny", dict(dp=2, pp=2, zero=1), 2),
    ("tiny", dict(dp=1, pp=4), 4),
    ("tiny", dict(dp=2, cp=2, zero=1), 1),
    ("tiny", dict(dp=1, tp=2, pp=2), 2),
    ("tiny-moe", dict(dp=4, zero=0), 1),
    ("tiny-moe", dict(dp=4, ep=4, zero=1), 1),
    ("tiny-moe", dict(dp=2, cp=2, ep=2, zero=2), 1),
]
AUTO_TOLERANCE = 0.10


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=20, help="timed steps per layout")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--fit", action="store_true", help="refit the CPU constants on the measured times")
    p.add_argument("--save", metavar="FILE.json", help="write the measured step times (median per layout) to FILE")
    p.add_argument("--load", metavar="FILE.json", help="use times saved by --save instead of measuring")
    p.add_argument("--machine", metavar="PROFILE.json", help="price with this machine profile (fived calibrate)")
    return p.parse_args()


def config(model: str, fields: dict, micro: int, args: argparse.Namespace):
    over = {
        "model.name": model,
        "train.seq_len": args.seq_len,
        "train.global_batch": args.global_batch,
        "train.microbatches": micro,
        "train.dtype": "float32",
        "train.log_every": 10**9,
        "train.device": "cpu",
        "train.steps": 1 + args.warmup + args.steps,
    }
    over.update({f"parallel.{k}": v for k, v in fields.items()})
    return build_config(overrides=over)


def hardware_of(args: argparse.Namespace):
    """The machine profile's hardware with --machine, else the CPU constants (local_hardware)."""
    from fived.planner.hardware import local_hardware

    if not args.machine:
        return local_hardware(args.world)
    from fived.planner.profile import profile_hardware, read_profile

    return profile_hardware(read_profile(args.machine), args.world)


def auto_layout(args: argparse.Namespace):
    """What `fived train --layout auto --nproc N` picks for the default tiny model (priced as --machine
    says): (config, Layout)."""
    from fived.planner.search import plan
    from fived.planner.timing import Cluster

    cfg = config("tiny", {}, 1, args)
    best = (
        plan(
            cfg.model,
            Cluster(hardware_of(args), args.world, args.world),
            cfg.train.seq_len,
            cfg.train.global_batch,
            cfg.train.dtype,
        )
        .plans[0]
        .layout
    )
    fields = {k.split(".")[1]: v for k, v in best.overrides(args.global_batch).items() if k.startswith("parallel.")}
    return ("tiny", fields, best.microbatches(args.global_batch)), best


def _index(layouts, layout) -> int | None:
    """Where `layout` (model, parallel fields, micro-batches) is among `layouts`, fields compared with
    the runtime's defaults filled in."""
    from fived.parallel.mesh import Layout

    def key(entry):
        m, f, micro = entry
        return m, micro, Layout(**{k: v for k, v in f.items() if k != "dp"}).with_(dp=f.get("dp", 1))

    return next((i for i, entry in enumerate(layouts) if key(entry) == key(layout)), None)


def rank_main(layouts, args: argparse.Namespace) -> dict:
    from fived.training.trainer import Trainer

    trainers = [Trainer(config(m, f, micro, args), log=False) for m, f, micro in layouts]
    for s in range(args.warmup):
        for t in trainers:
            dist.barrier()
            t.step(s)
    times = [[] for _ in trainers]
    breakdowns = [[] for _ in trainers]
    gc.collect()
    gc.disable()
    try:
        for i in range(args.steps):
            order = list(range(len(trainers)))
            for j in order if i % 2 == 0 else order[::-1]:
                dist.barrier()
                start = time.perf_counter()
                record = trainers[j].step(args.warmup + i)
                times[j].append(time.perf_counter() - start)
                breakdowns[j].append(record["breakdown"])
    finally:
        gc.enable()
    from fived.training.breakdown import compared, mean_breakdown

    # this rank's measured components per layout (the planner's terms), mean over the timed steps
    return {"times": times, "components": [compared(mean_breakdown(b, skip_first=False)) for b in breakdowns]}


def predict(layouts, args, hw) -> list[float]:
    from fived.parallel.mesh import Layout
    from fived.planner.timing import Cluster, step_time

    out = []
    for m, f, micro in layouts:
        cfg = config(m, f, micro, args)
        layout = Layout.from_config(cfg, args.world)
        out.append(
            step_time(
                cfg.model,
                layout,
                Cluster(hw, args.world, args.world),
                cfg.train.seq_len,
                cfg.train.global_batch,
                cfg.train.dtype,
            ).total
        )
    return out


def median_error(measured, predicted) -> float:
    return statistics.median(abs(p / m - 1) for m, p in zip(measured, predicted)) * 100


GRIDS = {
    "gemm_efficiency": [0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0],
    "layer_overhead_s": [x * 1e-4 for x in (1, 2, 4, 6, 8, 10, 14, 20, 30, 45)],
    "step_overhead_s": [x * 1e-3 for x in (0, 1, 2, 3, 5, 8, 12, 20)],
    "link_latency_s": [x * 1e-6 for x in (50, 100, 200, 400, 700, 1000, 1500, 2000, 3000, 5000, 8000)],
    "nvlink_gbps": [0.5, 1.0, 2.0, 4.0, 8.0],
    "zero3_overhead_s": [x * 1e-3 for x in (0, 1, 2, 3, 4, 6, 8, 12, 16)],
    "peer_latency_s": [x * 1e-6 for x in (0, 100, 200, 400, 700, 1000, 1500, 2000, 3000)],
    "launch_s": [x * 1e-6 for x in (5, 20, 50, 100, 200, 400, 700, 1000)],
}


def fit(layouts, measured, args, base_hw):
    """Coordinate descent (two sweeps) over GRIDS on the median absolute error; returns the hardware."""
    hw = base_hw
    for _ in range(2):
        for name, grid in GRIDS.items():
            scores = []
            for value in grid:
                changes = {name: value}
                if name == "nvlink_gbps":
                    changes["network_gbps"] = value
                if name == "link_latency_s":
                    changes["network_latency_s"] = value
                trial = replace(hw, **changes)
                scores.append((median_error(measured, predict(layouts, args, trial)), value, trial))
            hw = min(scores, key=lambda s: s[0])[2]
    return hw


def main() -> int:
    import torch

    args = parse_args()
    if args.machine:  # (a bad profile: one line, before any rank starts)
        from fived.config import ConfigError

        try:
            hardware_of(args)
        except ConfigError as e:
            print(f"bench_planner_cpu: error: {e}", file=sys.stderr)
            return 2
    load = os.getloadavg()[0]
    print(
        f"planner vs fived on CPU | torch {torch.__version__} | {args.world} ranks, gloo, OMP_NUM_THREADS=1 | "
        f"cpus {len(os.sched_getaffinity(0))} | load {load:.2f} at start | float32, tiny models, global batch "
        f"{args.global_batch} x seq {args.seq_len} | {args.steps} timed steps per layout, interleaved"
    )
    layouts = [tuple(x) for x in LAYOUTS]
    if args.load:
        with open(args.load) as f:
            saved = json.load(f)
        layouts, measured = [tuple(x) for x in saved["layouts"]], saved["measured"]
        components = saved.get("components")
        print(f"times from {args.load} (measured under load {saved['load']:.2f})")
    else:
        auto, _ = auto_layout(args)
        if _index(layouts, auto) is None:
            layouts.append(auto)
        results = run_ranks(args.world, rank_main, layouts, args, timeout_s=1800.0)
        measured = [
            statistics.median(max(r["times"][j][i] for r in results) for i in range(args.steps))
            for j in range(len(layouts))
        ]
        components = [
            {k: statistics.mean(r["components"][j][k] for r in results) for k in results[0]["components"][j]}
            for j in range(len(layouts))
        ]  # mean over ranks
        print(f"load {os.getloadavg()[0]:.2f} at end (this benchmark's own ranks included)")
    if args.save:
        with open(args.save, "w") as f:
            json.dump({"layouts": layouts, "measured": measured, "components": components, "load": load}, f)
    hw = hardware_of(args)
    print(
        f"priced with {'the machine profile ' + args.machine if args.machine else 'the CPU constants (hardware.CPU)'}"
    )
    if args.fit:
        loo = []
        for j in range(len(layouts)):
            keep = [i for i in range(len(layouts)) if i != j]
            trial = fit([layouts[i] for i in keep], [measured[i] for i in keep], args, hw)
            loo.append(abs(predict([layouts[j]], args, trial)[0] / measured[j] - 1) * 100)
        hw = fit(layouts, measured, args, hw)
        share = min(1.0, len(os.sched_getaffinity(0)) / args.world)
        print(
            f"fitted: gemm_efficiency = {hw.gemm_efficiency}; at a whole core per rank (times the rank's core "
            f"share {share:g}): layer_overhead_s = {hw.layer_overhead_s * share:.2e}, step_overhead_s = "
            f"{hw.step_overhead_s * share:.2e}, link_latency_s = {hw.link_latency_s * share:.2e}, peer_latency_s = "
            f"{hw.peer_latency_s * share:.2e}, launch_s = {hw.launch_s * share:.2e}, zero3_overhead_s = "
            f"{hw.zero3_overhead_s * share:.2e}; link GB/s = "
            f"{hw.nvlink_gbps}"
        )
        print(f"leave-one-layout-out median absolute error: {statistics.median(loo):.1f}%")
    predicted = predict(layouts, args, hw)
    auto, chosen = auto_layout(args)  # with the constants now in force
    auto_index = _index(layouts, auto)
    code = report(layouts, measured, predicted, auto_index, chosen)
    if components:
        component_report(layouts, components, args, hw)
    return code


def component_report(layouts, components, args, hw) -> None:
    """Each layout's measured step breakdown (fived.training.step_timer, mean over ranks and timed steps)
    beside the planner's components (fived.training.breakdown maps them), in ms; and the component the
    planner gets most wrong: the largest median |measured - predicted| over the layouts, as a
    share of the measured step."""
    from fived.parallel.mesh import Layout
    from fived.training.breakdown import COMPARED, predicted

    print(f"\nstep breakdown per layout, measured/predicted ms ({', '.join(COMPARED)}):")
    errors: dict[str, list[float]] = {k: [] for k in COMPARED}
    for i, ((m, f, micro), got) in enumerate(zip(layouts, components)):
        cfg = config(m, f, micro, args)
        want, _ = predicted(cfg, args.world, hw)
        step = sum(got.values())
        cells = " ".join(f"{got[k] * 1e3:.1f}/{want[k] * 1e3:.1f}" for k in COMPARED)
        print(f"{i + 1:>3}  {Layout.from_config(cfg, args.world).describe():<30} {cells}")
        for k in COMPARED:
            errors[k].append(abs(got[k] - want[k]) / step)
    worst = {k: statistics.median(v) for k, v in errors.items()}
    name = max(worst, key=worst.get)
    print(
        "median |measured - predicted| per component, share of the step: "
        + ", ".join(f"{k} {v:.1%}" for k, v in worst.items())
        + f"; worst: {name}"
    )


def report(layouts, measured, predicted, auto_index, chosen) -> int:
    """The table, the auto choice against the fastest measured layout, the median error; exit code."""
    print(f"\n{'#':>3}  {'layout':<44} {'measured ms':>12} {'predicted ms':>13} {'error':>7}")
    for i, ((m, f, micro), got, want) in enumerate(zip(layouts, measured, predicted)):
        label = f"{m} " + " ".join(
            f"{k}{'' if v is True else v}" for k, v in f.items() if v not in (1, False) or k == "zero"
        )
        label += f" mb{micro}" + ("  <- --layout auto" if i == auto_index else "")
        print(f"{i + 1:>3}  {label:<44} {got * 1e3:>12.1f} {want * 1e3:>13.1f} {(want / got - 1) * 100:>+6.1f}%")
    fastest = min(range(len(layouts)), key=lambda i: measured[i])
    if auto_index is None:
        print(f"\n--layout auto picks {chosen.describe()}, not among the measured layouts: run without --load")
        return 1
    ratio = measured[auto_index] / measured[fastest]
    print(
        f"\n--layout auto picks {chosen.describe()}: measured {measured[auto_index] * 1e3:.1f} ms, the fastest "
        f"measured layout (#{fastest + 1}) {measured[fastest] * 1e3:.1f} ms: {ratio:.3f}x "
        f"({'within' if ratio <= 1 + AUTO_TOLERANCE else 'NOT within'} {AUTO_TOLERANCE:.0%})"
    )
    pick = min(range(len(layouts)), key=lambda i: predicted[i])
    print(
        f"the planner's top pick among the measured layouts: #{pick + 1}, {measured[fastest] / measured[pick]:.3f} "
        f"of the fastest measured's throughput; Spearman (predicted vs measured) {spearman(predicted, measured):.3f}"
    )
    print(f"median absolute error: {median_error(measured, predicted):.1f}%")
    return 0 if ratio <= 1 + AUTO_TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
