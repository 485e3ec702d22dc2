"""parallel.ep_overlap off vs on: fived's Trainer on tiny-moe widened (dim 256, experts' hidden 512 by
default) with ep = world, the two trainers built side by side in one process group; after warmup
their timed steps alternate (order reversed every other round), each after a barrier; a step's time
is the slowest rank's, a trainer's the median. Printed: ms/step and steps/s off and on.

    python benchmarks/bench_ep_overlap.py                 # 2 ranks, 20 timed steps per trainer
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fived.config import build_config  # noqa: E402
from fived.launch import run_ranks  # noqa: E402


def config(overlap: bool, args):
    return build_config(overrides={
        "model.name": "tiny-moe", "model.dim": args.dim, "model.moe_ffn_dim": args.expert_dim,
        "train.seq_len": args.seq_len, "train.global_batch": args.global_batch, "train.dtype": "float32",
        "train.log_every": 10**9, "train.device": "cpu", "train.steps": 1 + args.warmup + args.steps,
        "parallel.dp": args.world, "parallel.ep": args.world, "parallel.ep_overlap": overlap})


def rank_main(args) -> list[list[float]]:
    """[times off, times on] of this rank."""
    from fived.train import Trainer

    trainers = [Trainer(config(on, args), log=False) for on in (False, True)]
    for s in range(args.warmup):
        for t in trainers:
            dist.barrier()
            t.step(s)
    times = [[], []]
    gc.collect()
    gc.disable()
    try:
        for i in range(args.steps):
            for j in ((0, 1) if i % 2 == 0 else (1, 0)):
                dist.barrier()
                start = time.perf_counter()
                trainers[j].step(args.warmup + i)
                times[j].append(time.perf_counter() - start)
    finally:
        gc.enable()
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--expert-dim", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=8)
    args = p.parse_args()
    print(f"ep_overlap off vs on | torch {torch.__version__} | {args.world} CPU ranks, gloo, OMP_NUM_THREADS=1 | "
          f"cpus {len(os.sched_getaffinity(0))} | load {os.getloadavg()[0]:.2f} at start | tiny-moe dim {args.dim} "
          f"experts' hidden {args.expert_dim} seq {args.seq_len} batch {args.global_batch} | "
          f"{args.steps} timed steps each")
    ranks = run_ranks(args.world, rank_main, args, timeout_s=300, device="cpu")
    off, on = (statistics.median(max(r[j][i] for r in ranks) for i in range(args.steps)) for j in (0, 1))
    for name, t in (("off", off), ("on", on)):
        print(f"  ep_overlap {name:<3}: {t * 1e3:8.2f} ms/step  {1 / t:6.2f} steps/s")
    print(f"  on/off time ratio: {on / off:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
