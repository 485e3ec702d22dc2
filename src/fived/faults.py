"""Faults on the ranks' side: preemption (SIGTERM) and collectives that never complete.

Preemption: SIGTERM (what Slurm and Kubernetes send) only sets a flag in each rank; at every step
boundary the ranks agree on it with one MAX all-reduce, so they all stop after the same step. With
checkpointing on they save there, and the run ends "preempted" (exit code 75, EX_TEMPFAIL:
resumable: run it again with --resume). Ctrl-C is the launcher's alone (ranks ignore SIGINT).

Hangs: every process group has `train.collective_timeout_s`; a collective that does not complete in
that time raises in the ranks waiting in it. The trainer turns that into `CollectiveTimeout`, naming
the collective, the mesh dimension of its group and the group's ranks (the ledger records which
collective each rank is in), and the launcher applies its restart policy.
"""
from __future__ import annotations

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
        super().__init__(f"{op} over the {dim} group (ranks {', '.join(map(str, ranks))}) did not complete "
                         f"within {timeout_s:g} s (train.collective_timeout_s) on rank {rank}")

    def summary(self) -> dict:
        return {"kind": "collective_timeout", "rank": self.rank, "op": self.op, "dim": self.dim,
                "ranks": list(self.ranks), "timeout_s": self.timeout_s}


def is_timeout(error: BaseException) -> bool:
    """Whether a backend error is a collective timing out (gloo: "Timed out waiting ..."; NCCL's
    watchdog: "Watchdog caught collective operation timeout")."""
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("timed out" in text or "timeout" in text)


def timeout_line(summaries: list[dict]) -> str:
    """One line for the launcher from the ranks' timeout reports (oldest first). A rank that waits
    in one collective makes its peers in other groups time out too; the collective blamed is the
    one a rank never arrived at that was not itself waiting somewhere (the stalled rank)."""
    waiting_somewhere = {s["rank"] for s in summaries}
    by_collective: dict[tuple, list[int]] = {}
    for s in summaries:
        by_collective.setdefault((s["op"], s["dim"], tuple(s["ranks"]), s["timeout_s"]), []).append(s["rank"])

    def missing(key) -> list[int]:
        return [r for r in key[2] if r not in by_collective[key]]

    culprit = [k for k in by_collective if any(r not in waiting_somewhere for r in missing(k))]
    op, dim, ranks, timeout_s = (culprit or list(by_collective))[0]
    waiting = sorted(by_collective[(op, dim, ranks, timeout_s)])
    line = (f"{op} over the {dim} group (ranks {', '.join(map(str, ranks))}) did not complete within "
            f"{timeout_s:g} s; waiting: rank {', '.join(map(str, waiting))}")
    absent = missing((op, dim, ranks, timeout_s))
    return line + (f"; never arrived: rank {', '.join(map(str, absent))}" if absent else "")
