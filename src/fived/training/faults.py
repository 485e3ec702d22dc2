"""Faults on the ranks' side: preemption (SIGTERM) and collectives that never complete.

Preemption: SIGTERM (what Slurm and Kubernetes send) only sets a flag in each rank; at every step
boundary the ranks agree on it with one MAX all-reduce, so they all stop after the same step. With
checkpointing on they save there, and the run ends "preempted" (exit code 75, EX_TEMPFAIL:
resumable: run it again with --resume). Ctrl-C is the launcher's alone (ranks ignore SIGINT).

Hangs: every process group has `train.collective_timeout_s`; a collective that does not complete in
that time raises in the ranks waiting in it. The trainer turns that into `CollectiveTimeout`, naming
the collective, the mesh dimension of its group and the group's ranks (fived.parallel.comm records which
collective each rank is in), and the launcher applies its restart policy.
"""

from __future__ import annotations

import contextlib
import signal

import torch
import torch.distributed as dist

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: stopped on request after saving; run again with --resume
INTERRUPTED_EXIT = 130  # 128 + SIGINT, as a shell reports Ctrl-C
TERMINATED_EXIT = 143  # 128 + SIGTERM, stopped without a checkpoint


class PreemptionRequest:
    """SIGTERM sets `requested`; `agreed()` (every rank, at a step boundary) says whether any rank got it."""

    def __init__(self):
        self.requested = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.requested = True

    def agreed(self, device: torch.device) -> bool:
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within the timeout on this rank."""

    def __init__(self, rank: int, op: str, dim: str, ranks: tuple[int, ...], timeout_s: float):
        self.rank, self.op, self.dim, self.ranks, self.timeout_s = rank, op, dim, tuple(ranks), timeout_s
        super().__init__(
            f"{op} over the {dim} group (ranks {', '.join(map(str, ranks))}) did not complete "
            f"within {timeout_s:g} s (train.collective_timeout_s) on rank {rank}"
        )

    def summary(self) -> dict:
        return {
            "kind": "collective_timeout",
            "rank": self.rank,
            "op": self.op,
            "dim": self.dim,
            "ranks": list(self.ranks),
            "timeout_s": self.timeout_s,
        }


@contextlib.contextmanager
def timeouts_named(rank: int, timeout_s: float, blame):
    """Inside the block, a backend timeout becomes a CollectiveTimeout naming `blame()`'s
    (collective, mesh dimension, ranks)."""
    try:
        yield
    except RuntimeError as error:
        if not is_timeout(error):
            raise
        op, dim, ranks = blame()
        raise CollectiveTimeout(rank, op, dim, ranks, timeout_s) from error


def is_timeout(error: BaseException) -> bool:
    """Whether a backend error is a collective timing out (gloo: "Timed out waiting ..."; NCCL's
    watchdog: "Watchdog caught collective operation timeout")."""
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("timed out" in text or "timeout" in text)


DIM_ORDER = ("tp", "cp", "ep", "edp", "dp", "dp_shard", "dp_replicate", "dp_cp", "dp_shard_cp", "pp")


def timeout_line(summaries: list[dict]) -> str:
    """One line for the launcher from the ranks' timeout reports. A rank that stalls makes its peers
    time out in every group they wait for it in; the line names the ranks that never arrived (those
    not waiting anywhere themselves) and each collective still waiting, innermost dimension first."""
    waiting_somewhere = {s["rank"] for s in summaries}
    waiting: dict[tuple, list[int]] = {}
    for s in summaries:
        waiting.setdefault((s["op"], s["dim"], tuple(s["ranks"])), []).append(s["rank"])
    keys = sorted(waiting, key=lambda k: (DIM_ORDER.index(k[1]) if k[1] in DIM_ORDER else len(DIM_ORDER), k))
    absent = sorted({r for key in keys for r in key[2] if r not in waiting_somewhere})
    parts = [
        f"{op} over the {dim} group (ranks {', '.join(map(str, ranks))}): waiting rank "
        f"{', '.join(map(str, sorted(waiting[(op, dim, ranks)])))}"
        for op, dim, ranks in keys
    ]
    timeout = f"within {summaries[0]['timeout_s']:g} s (train.collective_timeout_s)"
    if absent:
        return f"rank {', '.join(map(str, absent))} never arrived {timeout}; " + "; ".join(parts)
    return f"did not complete {timeout}: " + "; ".join(parts)
