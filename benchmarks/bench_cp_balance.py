"""Context parallelism with document masking: the work-balanced chunk assignment against the halves
layout, on a batch of skewed document lengths (one long document, many short ones), in one run.

Every sequence of the data is one document of `--long` tokens followed by documents of `--short`
tokens (the byte tokenizer: NUL ends a document). fived's Trainer runs twice side by side in one
process group (`parallel.cp_balance` halves, then work; `data.document_mask` on, cp ranks on CPU,
gloo, float32), timed steps alternating (order reversed every other round, each after a barrier).
Per rank and step the benchmark sums the CPU seconds (the rank's compute thread's `time.thread_time`:
machine load and waits do not count) spent in the document-masked attention blocks
(`masked_block_forward`/`masked_block_backward`: the kernels and their tiling, the rank's attention
work). Printed per assignment: the attention work the assignment predicts per rank
((query, key) pairs, `fived.data.documents.rank_work`), the measured attention seconds per rank (medians),
their spread (slowest / fastest rank), the step time (wall: the slowest rank's, median) and the step's
compute (each rank's CPU seconds in the step, the slowest rank's, median: what the step would take
on dedicated cores, waiting for the slowest rank aside), and both ratios work / halves. On a machine
shared with other work the wall times carry its load; the CPU seconds do not.

    python benchmarks/bench_cp_balance.py                         # cp 2, seq 8192, 10 timed steps
    python benchmarks/bench_cp_balance.py --cp 4 --seq 16384
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist
from side_by_side import interleaved_steps, slowest_median

from fived.config import build_config
from fived.launch.ranks import run_ranks

BALANCES = ("halves", "work")


def write_skewed(path: Path, seq_len: int, long: int, short: int, sequences: int) -> None:
    """`sequences` windows of seq_len tokens, each: one document of `long` tokens, then `short` ones."""
    text = (Path(__file__).parent.parent / "src/fived/assets/corpus.txt").read_bytes().replace(b"\0", b" ")
    window = bytearray(text[: long - 1]) + b"\0"
    while len(window) < seq_len:
        window += text[len(window) : len(window) + short - 1] + b"\0"
    path.write_bytes(bytes(window[:seq_len]) * sequences + b"\0")


def config(balance: str, data: str, args):
    return build_config(
        overrides={
            "model.name": "tiny",
            "train.seq_len": args.seq,
            "train.global_batch": args.global_batch,
            "train.dtype": "float32",
            "train.log_every": 10**9,
            "train.device": "cpu",
            "train.steps": 1 + args.warmup + args.steps,
            "parallel.dp": 1,
            "parallel.cp": args.cp,
            "parallel.cp_balance": balance,
            "data.path": data,
            "data.document_mask": True,
        }
    )


class AttentionClock:
    """CPU seconds this rank spends in the document-masked blocks, per trainer (the one stepping)."""

    def __init__(self, trainers: int):
        self.seconds = [[] for _ in range(trainers)]
        self.step_seconds = [[] for _ in range(trainers)]  # the whole step's CPU seconds
        self.current = 0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[self.current][-1] += time.thread_time() - start

        return timed

    def stepping(self, index: int, step):
        def run(s):
            self.current = index
            self.seconds[index].append(0.0)
            start = time.thread_time()
            try:
                return step(s)
            finally:
                self.step_seconds[index].append(time.thread_time() - start)

        return run


def rank_main(data: str, args) -> dict:
    from fived.parallel import context
    from fived.training.trainer import Trainer

    clock = AttentionClock(len(BALANCES))
    context.masked_block_forward = clock.wrap(context.masked_block_forward)
    context.masked_block_backward = clock.wrap(context.masked_block_backward)
    trainers = [Trainer(config(b, data, args), log=False) for b in BALANCES]
    for i, t in enumerate(trainers):
        t.step = clock.stepping(i, t.step)
    times, _ = interleaved_steps(trainers, warmup=args.warmup, steps=args.steps)
    work = [t.batches.last_rank_work for t in trainers]
    dist.barrier()
    return {
        "times": times,
        "attention": [s[-args.steps :] for s in clock.seconds],
        "cpu": [s[-args.steps :] for s in clock.step_seconds],
        "work": work,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--long", type=int, default=0, help="the long document's tokens (default: half the sequence)")
    p.add_argument("--short", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    long = args.long or args.seq // 2
    print(
        f"cp balance: halves vs work | torch {torch.__version__} | {args.cp} CPU ranks, gloo, OMP_NUM_THREADS=1 | "
        f"cpus {len(os.sched_getaffinity(0))} | load {os.getloadavg()[0]:.2f} at start | tiny, float32, seq "
        f"{args.seq}, batch {args.global_batch}, cp ring, document masking | each sequence: one document of {long} "
        f"tokens, then documents of {args.short} | {args.steps} timed steps each (medians)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "skewed.txt"
        write_skewed(data, args.seq, long, args.short, 4 * args.global_batch + 4)
        ranks = run_ranks(args.cp, rank_main, str(data), args, timeout_s=1800, device="cpu")
    steps, compute = [], []
    for j, balance in enumerate(BALANCES):
        work = ranks[0]["work"][j]
        seconds = [statistics.median(r["attention"][j]) for r in ranks]
        steps.append(slowest_median([r["times"][j] for r in ranks]))
        compute.append(slowest_median([r["cpu"][j] for r in ranks]))
        print(
            f"  {balance:<7} predicted work per rank {', '.join(f'{w / 1e6:.1f}M' for w in work)} "
            f"(max/min {max(work) / min(work):.2f}) | attention CPU s per rank "
            f"{', '.join(f'{s:.3f}' for s in seconds)} (slowest/fastest {max(seconds) / min(seconds):.2f}) | "
            f"step {steps[-1]:.3f} s wall, {compute[-1]:.3f} s CPU (slowest rank)"
        )
    print(
        f"work / halves: step time {steps[1] / steps[0]:.3f} (wall), {compute[1] / compute[0]:.3f} (slowest rank's CPU)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
