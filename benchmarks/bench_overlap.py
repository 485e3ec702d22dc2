"""Each overlap switch off vs on, per mesh dimension, in one run: fived's Trainer twice side by side in
one process group (switch off, switch on), timed steps alternating (order reversed every other round,
each after a barrier); a step's time is the slowest rank's, a trainer's the median over its steps.
From the step breakdown (`fived.training.step_timer`, rank 0): the dimension's exposed communication (waited
for) and, with the switch on, the communication that ran under compute.

    python benchmarks/bench_overlap.py                  # every case, 12 timed steps each
    python benchmarks/bench_overlap.py --case tp --steps 20

Cases (CPU ranks, gloo, float32): tp2+sp (parallel.tp_overlap); ZeRO-2 dp2 with 2 micro-batches
(overlap_grad_reduce + overlap_param_gather, 1 MiB buckets); pp2 x dp2 ZeRO-1 1f1b (overlap_grad_reduce:
each stage reduces after its last backward); ep2 tiny-moe (ep_overlap). On 2 cores both ranks'
compute already fills the machine and gloo's transfers are CPU work too, so little can hide here.
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from side_by_side import interleaved_steps, slowest_median

from fived.config import build_config
from fived.launch.ranks import run_ranks

WIDE = {"model.dim": 512, "model.ffn_dim": 1024, "model.n_heads": 8, "model.n_kv_heads": 4}
# name: (ranks, mesh dimension (breakdown role), base overrides, the switches)
CASES = {
    "tp": (2, "tp", {**WIDE, "parallel.dp": 1, "parallel.tp": 2, "parallel.sp": True}, {"parallel.tp_overlap": True}),
    "zero2": (
        2,
        "dp",
        {**WIDE, "parallel.dp": 2, "parallel.zero": 2, "train.microbatches": 2, "parallel.bucket_mb": 1.0},
        {"parallel.overlap_grad_reduce": True, "parallel.overlap_param_gather": True},
    ),
    "pp-dp": (
        4,
        "dp",
        {
            **WIDE,
            "parallel.dp": 2,
            "parallel.pp": 2,
            "parallel.zero": 1,
            "train.microbatches": 4,
            "parallel.bucket_mb": 1.0,
        },
        {"parallel.overlap_grad_reduce": True},
    ),
    "ep": (
        2,
        "ep",
        {"model.name": "tiny-moe", "model.dim": 256, "model.moe_ffn_dim": 512, "parallel.dp": 2, "parallel.ep": 2},
        {"parallel.ep_overlap": True},
    ),
}


def config(case: str, on: bool, args):
    _, _, base, switches = CASES[case]
    over = {
        "model.name": "tiny",
        "train.seq_len": args.seq_len,
        "train.global_batch": args.global_batch,
        "train.dtype": "float32",
        "train.log_every": 10**9,
        "train.device": "cpu",
        "train.steps": 1 + args.warmup + args.steps,
        **base,
    }
    return build_config(overrides={**over, **(switches if on else {})})


def rank_main(case: str, args) -> dict:
    """Per trainer (off, on): step times, and rank 0's breakdowns."""
    from fived.training.trainer import Trainer

    trainers = [Trainer(config(case, on, args), log=False) for on in (False, True)]
    times, records = interleaved_steps(trainers, warmup=args.warmup, steps=args.steps)
    return {"times": times, "parts": [[r.get("breakdown") for r in rs] for rs in records]}


def _median(breakdowns: list[dict], key: str, role: str) -> float:
    return statistics.median(b[key].get(role if key == "overlapped" else f"comm_{role}", 0.0) for b in breakdowns)


def run_case(case: str, args) -> tuple:
    world, role, _, _ = CASES[case]
    ranks = run_ranks(world, rank_main, case, args, timeout_s=600, device="cpu")
    step = [slowest_median([r["times"][j] for r in ranks]) for j in (0, 1)]
    parts = ranks[0]["parts"]
    exposed = [_median(parts[j], "components", role) for j in (0, 1)]
    hidden = _median(parts[1], "overlapped", role)
    return world, role, step, exposed, hidden


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", choices=list(CASES), action="append", help="(repeatable; default: every case)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=8)
    args = p.parse_args()
    print(
        f"overlap switches off vs on | torch {torch.__version__} | CPU ranks, gloo, OMP_NUM_THREADS=1 | "
        f"cpus {len(os.sched_getaffinity(0))} | load {os.getloadavg()[0]:.2f} at start | seq {args.seq_len} "
        f"batch {args.global_batch} | {args.steps} timed steps each (medians)"
    )
    print(
        f"  {'case':<7} {'ranks':>5} {'dim':>4} {'exposed off ms':>15} {'exposed on ms':>14} {'hidden on ms':>13} "
        f"{'step off ms':>12} {'step on ms':>11} {'on/off':>7}"
    )
    for case in args.case or list(CASES):
        world, role, step, exposed, hidden = run_case(case, args)
        print(
            f"  {case:<7} {world:>5} {role:>4} {exposed[0] * 1e3:>15.1f} {exposed[1] * 1e3:>14.1f} "
            f"{hidden * 1e3:>13.1f} {step[0] * 1e3:>12.1f} {step[1] * 1e3:>11.1f} {step[1] / step[0]:>7.3f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
