"""Trainers timed side by side in one process group: the loop the Trainer benchmarks share.

After `warmup` steps of each, the trainers' timed steps interleave, in order on even rounds and in
reverse on odd ones (so neither always runs right after the other), each after a barrier, with the
garbage collector off. Every rank returns its own step times; a step's time is the slowest rank's
(`slowest_median`).
"""

from __future__ import annotations

import gc
import statistics
import time

import torch.distributed as dist


def interleaved_steps(trainers: list, *, warmup: int, steps: int) -> tuple[list[list[float]], list[list[dict]]]:
    """(per trainer: this rank's seconds per timed step, and the step records `Trainer.step` returned)."""
    for s in range(warmup):
        for t in trainers:
            dist.barrier()
            t.step(s)
    times: list[list[float]] = [[] for _ in trainers]
    records: list[list[dict]] = [[] for _ in trainers]
    order = list(range(len(trainers)))
    gc.collect()
    gc.disable()
    try:
        for i in range(steps):
            for j in order if i % 2 == 0 else order[::-1]:
                dist.barrier()
                start = time.perf_counter()
                record = trainers[j].step(warmup + i)
                times[j].append(time.perf_counter() - start)
                records[j].append(record)
    finally:
        gc.enable()
    return times, records


def slowest_median(rank_times: list[list[float]]) -> float:
    """Median over the timed steps of the slowest rank's time (`rank_times`: per rank, per step)."""
    return statistics.median(max(step) for step in zip(*rank_times))
