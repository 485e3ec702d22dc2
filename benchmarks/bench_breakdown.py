"""What measuring the step breakdown costs: fived's Trainer with train.breakdown on (every span timed,
every collective recorded through fived.parallel.comm) against the same Trainer with it off (the collectives
go straight to torch.distributed), on the same ranks, in one run.

Both trainers of a layout are built side by side in one process group; after warmup their timed
steps alternate (order reversed every other round), each after a barrier; a step's time is the
slowest rank's, a layout's the median. Printed per layout: off, on, and the ratio on/off.

    python benchmarks/bench_breakdown.py                # 4 ranks, 30 timed steps per trainer
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

LAYOUTS = [
    ("tiny", dict(dp=4, zero=0), 1),
    ("tiny", dict(dp=2, tp=2, sp=True, zero=1), 1),
    ("tiny", dict(dp=2, pp=2, zero=1), 4),
    ("tiny", dict(dp=2, cp=2, zero=3), 1),
    ("tiny-moe", dict(dp=4, ep=4, zero=1), 1),
]


def config(model: str, fields: dict, micro: int, breakdown: bool, args):
    over = {
        "model.name": model,
        "train.seq_len": args.seq_len,
        "train.global_batch": args.global_batch,
        "train.microbatches": micro,
        "train.dtype": "float32",
        "train.log_every": 10**9,
        "train.device": "cpu",
        "train.steps": 1 + args.warmup + args.steps,
        "train.breakdown": breakdown,
    }
    over.update({f"parallel.{k}": v for k, v in fields.items()})
    return build_config(overrides=over)


def rank_main(args) -> list[list[list[float]]]:
    """Per layout: [times off, times on] of this rank."""
    from fived.training.trainer import Trainer

    out = []
    for model, fields, micro in LAYOUTS:
        trainers = [Trainer(config(model, fields, micro, on, args), log=False) for on in (False, True)]
        out.append(interleaved_steps(trainers, warmup=args.warmup, steps=args.steps)[0])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=16)
    args = p.parse_args()
    print(
        f"step breakdown on vs off | torch {torch.__version__} | {args.world} CPU ranks, gloo, OMP_NUM_THREADS=1 | "
        f"cpus {len(os.sched_getaffinity(0))} | load {os.getloadavg()[0]:.2f} at start | "
        f"{args.steps} timed steps each"
    )
    ranks = run_ranks(args.world, rank_main, args, timeout_s=120, device="cpu")
    ratios = []
    for index, (model, fields, micro) in enumerate(LAYOUTS):
        # a step's time: its slowest rank's; a trainer's: the median step
        off, on = (slowest_median([r[index][j] for r in ranks]) for j in (0, 1))
        ratios.append(on / off)
        shape = " ".join(f"{k}={v}" for k, v in fields.items())
        print(
            f"  {model:<8} {shape:<26} micro {micro}: off {off * 1e3:7.2f} ms  on {on * 1e3:7.2f} ms  "
            f"on/off {on / off:.3f}"
        )
    print(f"median on/off ratio over {len(ratios)} layouts: {statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
