"""Muon against AdamW: the loss each reaches on the bundled corpus at a tuned learning rate, and
Muon's step-time and memory overhead per layout next to the planner's prediction.

loss      the default tiny run (200 steps of 16 x 64 tokens, warmup 20, cosine to 0.1, weight decay
          0.1, float32, one rank) on the bundled corpus with 5% held out (`prepare-data
          --val-fraction 0.05`): AdamW over a sweep of train.lr; Muon over a sweep of train.muon_lr
          (its matrices; --muon-scale picks the update scale and its grid) with train.lr (the
          embedding, head, norms and router, AdamW's in both) at AdamW's tuned one, then over a sweep
          of train.lr at the tuned train.muon_lr; each run's loss on every held-out batch at the
          last step. A tuned lr is its sweep's best (said when it sits at the grid's edge).
          --adamw-lr skips AdamW's sweep (one run at that lr).
overhead  on --world CPU ranks (gloo, one thread each) in one process group, each layout trained
          with AdamW and with Muon: after warmup, timed steps interleave every trainer
          (`side_by_side.interleaved_steps`); per layout the slowest rank's
          median step and rank 0's mean optimizer component (Muon's exchange included) beside the
          planner's (`fived.training.breakdown.predicted` on this host's `local_hardware`), rank 0's
          optimizer-state bytes (ledger) beside the planner's, and the transient peak of one
          optimizer step above its start (glibc's heap in use, sampled after every torch op: CPU
          has no allocator statistics) beside the planner's Muon buffers
          (`fived.planner.memory.muon_buffers`); Muon's memory overhead is the state's difference
          plus the two steps' transient peaks' difference.

    python benchmarks/bench_muon.py                         # both parts
    python benchmarks/bench_muon.py --part loss --steps 200
    python benchmarks/bench_muon.py --part loss --muon-scale spectral --adamw-lr 3e-3
    python benchmarks/bench_muon.py --part overhead --world 4 --timed 10

Other processes sharing the cores make CPU timings noisy: the load is printed at the start.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # run_ranks sets it per rank too

import torch.distributed as dist
from side_by_side import interleaved_steps, slowest_median
from torch.utils._python_dispatch import TorchDispatchMode

from fived.config import build_config
from fived.launch.ranks import run_ranks

ADAMW_LRS = (1e-3, 2e-3, 3e-3, 5e-3, 1e-2, 2e-2)
# train.muon_lr per update scale: rms gives an update AdamW's RMS (0.2), spectral and none about
# 1/sqrt(fan) of it on the tiny model's matrices, so their grids sit higher
MUON_LRS = {
    "rms": (2e-3, 5e-3, 1e-2, 2e-2, 3e-2, 5e-2),
    "spectral": (1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.3),
    "none": (1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.3),
}
MUON_ADAMW_LRS = (3e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2)  # train.lr of a Muon run (its AdamW half)
# (name, model, parallel fields, micro-batches) on 4 ranks: every way Muon's pieces are cut
LAYOUTS = [
    ("ZeRO-0 dp4", "tiny", dict(dp=4, zero=0), 1),
    ("ZeRO-1 dp4", "tiny", dict(dp=4, zero=1), 1),
    ("ZeRO-2 dp4", "tiny", dict(dp=4, zero=2), 1),
    ("ZeRO-3 dp4", "tiny", dict(dp=4, zero=3), 1),
    ("ZeRO-3 HSDP 2x2", "tiny", dict(dp=4, zero=3, dp_replicate=2), 1),
    ("tp2+sp dp2 ZeRO-1", "tiny", dict(dp=2, tp=2, sp=True, zero=1), 1),
    ("ep2 dp4 ZeRO-1 (MoE)", "tiny-moe", dict(dp=4, ep=2, zero=1), 1),
    ("pp2 dp2", "tiny", dict(dp=2, pp=2), 2),
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("loss", "overhead", "both"), default="both")
    p.add_argument("--steps", type=int, default=200, help="training steps of each loss run")
    p.add_argument("--muon-scale", choices=tuple(MUON_LRS), default="rms", help="train.muon_scale of the loss runs")
    p.add_argument("--adamw-lr", type=float, help="AdamW's lr (and Muon's train.lr) without a sweep")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timed", type=int, default=10, help="timed steps per trainer")
    return p.parse_args()


# --- loss -----------------------------------------------------------------------------------------


def final_val_loss(cfg) -> float:
    from fived.training.trainer import run_training

    return run_ranks(1, run_training, cfg, False, False, device="cpu")[0].metrics[-1]["val_loss"]


def sweep(name: str, lrs, run) -> tuple[float, float]:
    """`run(lr)` for every lr of the grid, printed; (the tuned lr, its loss)."""
    losses = {}
    for lr in lrs:
        start = time.perf_counter()
        losses[lr] = run(lr)
        print(f"  {name} {lr:<7g} val_loss {losses[lr]:.4f}   ({time.perf_counter() - start:.0f} s)", flush=True)
    lr = min(losses, key=losses.get)
    edge = " (at the grid's edge)" if len(lrs) > 1 and lr in (lrs[0], lrs[-1]) else ""
    print(f"{name}: tuned {lr:g}{edge}, val_loss {losses[lr]:.4f}", flush=True)
    return lr, losses[lr]


def loss_part(args: argparse.Namespace) -> None:
    from fived.data.loader import bundled_corpus_path
    from fived.data.prepare import prepare_data

    with tempfile.TemporaryDirectory(prefix="fived-muon-") as tmp:
        prepare_data([bundled_corpus_path()], os.path.join(tmp, "corpus"), val_fraction=0.05)

        def run(**train) -> float:
            over = {
                "train.steps": args.steps,
                "train.device": "cpu",
                "train.eval_every": args.steps,
                "train.eval_batches": 0,
                "train.log_every": 10**9,
                "data.path": os.path.join(tmp, "corpus.bin"),
            }
            return final_val_loss(build_config(overrides=over | {f"train.{k}": v for k, v in train.items()}))

        seen = {}

        def muon_run(lr: float, muon_lr: float) -> float:
            if (lr, muon_lr) not in seen:
                seen[(lr, muon_lr)] = run(optimizer="muon", lr=lr, muon_lr=muon_lr, muon_scale=args.muon_scale)
            return seen[(lr, muon_lr)]

        lr_a, adamw = sweep("adamw train.lr", (args.adamw_lr,) if args.adamw_lr else ADAMW_LRS, lambda lr: run(lr=lr))
        name = f"muon ({args.muon_scale}"
        lr_m, _ = sweep(
            f"{name}, train.lr {lr_a:g}) train.muon_lr", MUON_LRS[args.muon_scale], lambda x: muon_run(lr_a, x)
        )
        lr_h, muon = sweep(f"{name}, train.muon_lr {lr_m:g}) train.lr", MUON_ADAMW_LRS, lambda x: muon_run(x, lr_m))
    verdict = "lower" if muon < adamw else "NOT lower"
    print(
        f"loss after {args.steps} steps at a tuned lr each: muon {muon:.4f} (train.lr {lr_h:g}, train.muon_lr "
        f"{lr_m:g}, {args.muon_scale}) vs adamw {adamw:.4f} (train.lr {lr_a:g}): muon {verdict} by {adamw - muon:+.4f}"
    )


# --- overhead -------------------------------------------------------------------------------------


def config(model: str, fields: dict, micro: int, optimizer: str, args: argparse.Namespace):
    over = {
        "model.name": model,
        "train.microbatches": micro,
        "train.dtype": "float32",
        "train.optimizer": optimizer,
        "train.log_every": 10**9,
        "train.device": "cpu",
        "train.steps": 2 + args.warmup + args.timed,
    }
    over.update({f"parallel.{k}": v for k, v in fields.items()})
    return build_config(overrides=over)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def heap_in_use() -> int:
    """Bytes glibc's malloc has handed out and not got back (small blocks + mmapped ones): torch's CPU
    allocator takes every tensor from malloc and returns it at once (no caching)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


class PeakHeap(TorchDispatchMode):
    """The heap's high-water mark, sampled after every torch op run inside."""

    def __init__(self):
        super().__init__()
        self.peak = heap_in_use()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, heap_in_use())
        return out


def step_peak(trainer, step: int) -> int:
    """Bytes the heap grew by at its peak during the optimizer's step (AdamW's, or Muon's with its
    exchange and the AdamW beside it; not ZeRO-1/2's parameter all-gather after it), over where it
    started."""
    optimizer, peaks = trainer.optimizer, []
    inner = optimizer.step

    def measured(*args, **kwargs):
        start = heap_in_use()
        with PeakHeap() as heap:
            inner(*args, **kwargs)
        peaks.append(heap.peak - start)

    optimizer.step = measured  # (this instance only)
    try:
        trainer.step(step)
    finally:
        del optimizer.step
    return peaks[0]


def rank_main(configs, args: argparse.Namespace) -> dict:
    from fived.training.breakdown import compared, mean_breakdown
    from fived.training.trainer import Trainer

    trainers = [Trainer(cfg, log=False) for cfg in configs]
    times, records = interleaved_steps(trainers, warmup=args.warmup, steps=args.timed)
    peaks = []
    for t in trainers:
        dist.barrier()
        peaks.append(step_peak(t, args.warmup + args.timed))
    optimizer = [
        compared(mean_breakdown([r["breakdown"] for r in rs], skip_first=False))["optimizer"] for rs in records
    ]
    return {
        "times": times,
        "optimizer": optimizer,
        "state": [t.state_bytes["optimizer"] for t in trainers],
        "peaks": peaks,
    }


def predictions(cfg, world: int, hw) -> tuple[float, float, int, int]:
    """The planner's (step seconds, optimizer seconds, optimizer-state bytes, Muon's transient
    bytes) for rank 0 of this run."""
    from fived.layout.layout import Layout
    from fived.layout.stages import rank_chunks
    from fived.planner.memory import muon_buffers
    from fived.training.breakdown import predicted
    from fived.training.report import expected_state_bytes

    components, _ = predicted(cfg, world, hw)
    layout = Layout.from_config(cfg, world)
    buffers = muon_buffers(cfg.model, layout, cfg.train.dtype, rank_chunks(cfg.model, layout, 0))
    return sum(components.values()), components["optimizer"], expected_state_bytes(cfg, world)["optimizer"], buffers


def overhead_part(args: argparse.Namespace) -> None:
    from fived.planner.hardware import local_hardware

    configs = [config(m, f, micro, opt, args) for _, m, f, micro in LAYOUTS for opt in ("adamw", "muon")]
    results = run_ranks(args.world, rank_main, configs, args, device="cpu", timeout_s=1800, deadline_s=3600)
    hw, r0 = local_hardware(args.world), results[0]
    time_rows, memory_rows, transient, extra = [], [], [], []
    for i, (name, *_rest) in enumerate(LAYOUTS):
        a, m = 2 * i, 2 * i + 1
        step = [slowest_median([r["times"][k] for r in results]) * 1e3 for k in (a, m)]
        plan = [predictions(configs[k], args.world, hw) for k in (a, m)]
        optimizer = [r0["optimizer"][k] * 1e3 for k in (a, m)]
        time_rows.append(
            f"{name:22s} {step[0]:7.1f} {step[1]:7.1f} {step[1] - step[0]:+7.1f}   "
            f"{plan[0][0] * 1e3:7.1f} {plan[1][0] * 1e3:7.1f} {(plan[1][0] - plan[0][0]) * 1e3:+7.1f}   "
            f"{optimizer[0]:7.1f} {optimizer[1]:7.1f} {optimizer[1] - optimizer[0]:+7.1f}   "
            f"{(plan[1][1] - plan[0][1]) * 1e3:+7.1f}"
        )
        state, peak = [r0["state"][k] for k in (a, m)], [r0["peaks"][k] for k in (a, m)]
        measured = state[1] - state[0] + peak[1] - peak[0]
        predicted = plan[1][2] - plan[0][2] + plan[1][3]
        transient.append(peak[1] / plan[1][3] - 1)
        extra.append((plan[1][1] - plan[0][1]) * 1e3 / (optimizer[1] - optimizer[0]))
        memory_rows.append(
            f"{name:22s} {state[0] / 1024:7.0f} {state[1] / 1024:7.0f}   {plan[0][2] / 1024:7.0f} "
            f"{plan[1][2] / 1024:7.0f}   {peak[0] / 1024:7.0f} {peak[1] / 1024:7.0f} "
            f"{plan[1][3] / 1024:7.0f}   {measured / 1024:+8.0f} {predicted / 1024:+8.0f}"
        )
    print(
        f"step time per layout, ms ({args.world} CPU ranks; measured: slowest rank's median step, rank 0's mean "
        "optimizer component; planner: fived.planner.timing on this host)"
    )
    print(f"{'':22s} {'measured step':>23s}   {'planner step':>23s}   {'measured optimizer':>23s}   {'planner':>7s}")
    print(
        f"{'layout':22s} {'adamw':>7s} {'muon':>7s} {'+muon':>7s}   {'adamw':>7s} {'muon':>7s} {'+muon':>7s}   "
        f"{'adamw':>7s} {'muon':>7s} {'+muon':>7s}   {'+muon':>7s}"
    )
    print("\n".join(time_rows))
    print(
        "memory of rank 0, KiB (optimizer state: the ledger's; transient: the heap's peak over the optimizer step; "
        "overhead: state + transient, muon - adamw)"
    )
    print(
        f"{'':22s} {'state measured':>15s}   {'state planner':>15s}   {'transient measured':>15s} {'planner':>7s}   "
        f"{'muon overhead':>17s}"
    )
    print(
        f"{'layout':22s} {'adamw':>7s} {'muon':>7s}   {'adamw':>7s} {'muon':>7s}   {'adamw':>7s} {'muon':>7s} "
        f"{'muon':>7s}   {'measured':>8s} {'planner':>8s}"
    )
    print("\n".join(memory_rows), flush=True)
    print(
        f"Muon's step transient (rank 0's heap peak) against the planner's (the busiest rank's bound): "
        f"{100 * min(transient):+.0f}% .. {100 * max(transient):+.0f}%; the planner's extra optimizer time for Muon "
        f"against the measured: {min(extra):.2f}x .. {max(extra):.2f}x",
        flush=True,
    )


def main() -> int:
    import torch

    args = parse_args()
    print(
        f"Muon vs AdamW | torch {torch.__version__} | cpus {len(os.sched_getaffinity(0))} | "
        f"load {os.getloadavg()[0]:.2f} at start | OMP_NUM_THREADS=1 per rank",
        flush=True,
    )
    if args.part in ("loss", "both"):
        loss_part(args)
    if args.part in ("overhead", "both"):
        overhead_part(args)
    print(f"load {os.getloadavg()[0]:.2f} at the end", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
