"""Forked worker processes for the planner's bulk work (`fived explore` prices ~10^5 layouts).

The planner is pure Python, so one process uses one core; forked workers price on every core the
process may use. Forked, not spawned: a worker starts with this process's modules and caches in ~10 ms
(the planner imports no torch and starts no thread, so forking it is safe). Where fork is unavailable
(Windows) or one core is all there is, everything runs in this process, in the same order.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

MAX_WORKERS = 8  # (the figures come back through pickles to one process: more cores gain little)


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS has one, e.g. under taskset or a
    container's cpuset), at most MAX_WORKERS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, MAX_WORKERS))


class Workers:
    """`with Workers(n) as w`: `w.map(fn, job, items)` yields fn(job, item) for each item, in order, computed
    by n forked processes (here, one after another, when n is 1 or fork is unavailable); `w.submit(fn,
    *args)` starts fn(*args) in one of them and returns a function that waits for its result. `fn` must be
    a module-level function; `job`, the items, the arguments and the results are pickled."""

    def __init__(self, n: int | None = None):
        self.n = usable_cores() if n is None else n
        self.pool: Any = None

    def __enter__(self) -> Workers:
        if self.n > 1 and "fork" in multiprocessing.get_all_start_methods():
            self.pool = multiprocessing.get_context("fork").Pool(self.n)
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.terminate()  # (after an error or ^C too: no worker outlives the command)
            self.pool.join()

    def map(self, fn: Callable, job: Any, items: Iterable) -> Iterator:
        if self.pool is None:
            return (fn(job, item) for item in items)
        return self.pool.imap(_Call(fn, job), items, chunksize=1)  # (one item each: they differ in cost)

    def submit(self, fn: Callable, *args: Any) -> Callable[[], Any]:
        if self.pool is None:
            return lambda: fn(*args)
        pending = self.pool.apply_async(fn, args)
        return pending.get


class _Call:
    """fn(job, item): a picklable partial (its job goes to a worker with each item)."""

    def __init__(self, fn: Callable, job: Any):
        self.fn, self.job = fn, job

    def __call__(self, item: Any) -> Any:
        return self.fn(self.job, item)
