"""The compute order of each rank under the multi-stage pipeline schedules, as torch.distributed.
pipelining runs them (interleaved 1F1B, interleaved zero-bubble, ZB-V, DualPipe-V), generated here
in plain Python so that the planner prices them without torch. Only the order of the F, B, I and W
actions is produced: torch's lock-step idle slots and its lowering to sends, receives, unshards and
gradient reductions add actions, never reorder compute. tests/test_compat.py checks every order
against the installed torch's own generator (fived.compat.torch_pipeline_order)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

Order = list[tuple[str, int, int]]  # (kind, stage, micro-batch) in execution order


def multi_stage_order(schedule: str, pp: int, local_stages: int, m: int, rank: int) -> Order:
    """rank's compute order under `schedule` with `local_stages` stages per rank and m micro-batches."""
    if schedule in ("interleaved-1f1b", "zero-bubble"):
        return _interleaved(rank, pp, local_stages, m, zero_bubble=schedule == "zero-bubble")
    if schedule == "zbv":
        return _zbv(rank, pp, m)
    if schedule == "dualpipev":
        return _dualpipev(rank, pp, m)
    raise ValueError(f"{schedule!r} is not a multi-stage schedule")


class _Counter:
    """Appends actions, numbering each (kind, stage)'s micro-batches 0, 1, 2, ... in order."""

    def __init__(self) -> None:
        self.out: Order = []
        self.next: dict[tuple[str, int], int] = defaultdict(int)

    def add(self, kind: str, stage: int, counted_as: str | None = None) -> int:
        key = (counted_as or kind, stage)
        mb = self.next[key]
        self.next[key] = mb + 1
        self.out.append((kind, stage, mb))
        return mb


def _interleaved(rank: int, pp: int, v: int, m: int, *, zero_bubble: bool) -> Order:
    """Depth-first interleaving: warm-up forwards (more on earlier ranks), then one forward and one
    backward per step, then the remaining backwards; stages change every round of micro-batches.
    Zero-bubble splits each backward into I and W and, after `rank` steps of 1F1B, runs one W (the
    oldest pending) after each I, the rest at the end."""
    per_round = m // max(1, m // pp)
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (pp - 1 - rank), m * v)
    total = m * v

    def forward_stage(step: int) -> int:
        return (step // per_round) % v * pp + rank

    def backward_stage(step: int) -> int:
        return (v - 1 - (step - warmup) // per_round % v) * pp + rank

    acts, backwards, weights = _Counter(), [], 0
    for step in range(total + warmup):
        if step < total:
            acts.add("F", forward_stage(step))
        if step >= warmup:
            acts.add("I" if zero_bubble else "B", backward_stage(step))
            backwards.append(step)
            if zero_bubble and step - warmup >= rank:
                acts.add("W", backward_stage(backwards[weights]))
                weights += 1
    for step in backwards[weights:] if zero_bubble else ():
        acts.add("W", backward_stage(step))
    return acts.out


def _zbv(rank: int, pp: int, m: int) -> Order:
    """ZB-V: rank r holds stage r (chunk 0) and stage 2pp-1-r (chunk 1); forwards fill the V, then
    each step runs a forward and an I, W pair per chunk; at least 2pp-1 micro-batches are laid out,
    those beyond m dropped."""
    n = max(2 * pp - 1, m)
    s0, s1 = rank, 2 * pp - 1 - rank
    acts = _Counter()
    count: Callable[[str, int], int] = lambda kind, stage: acts.next[(kind, stage)]  # noqa: E731
    for _ in range(2 * (pp - rank) - 1):
        acts.add("F", s0)
    for _ in range(rank):
        acts.add("F", s1)
        acts.add("F", s0)
    for _ in range(pp - rank):
        acts.add("F", s1)
        acts.add("I", s1)
        acts.add("W", s1)
    while count("F", s1) < count("F", s0) or count("F", s0) < n:
        if count("F", s0) < n:
            acts.add("F", s0)
        acts.add("I", s0)
        acts.add("W", s0)
        acts.add("F", s1)
        acts.add("I", s1)
        acts.add("W", s1)
    for _ in range(rank):
        acts.add("I", s0)
        acts.add("I", s1)
    for _ in range(pp - rank):
        acts.add("I", s0)
        acts.add("W", s0)
    for stage in (s1, s0):
        while count("W", stage) < count("I", stage):
            acts.add("W", stage)
    return [a for a in acts.out if a[2] < m]


def _dualpipev(rank: int, pp: int, m: int) -> Order:
    """DualPipe-V: the V of ZB-V, with full backwards overlapped with forwards of the other chunk in
    the steady state (F then B, as fived expands torch's OVERLAP_F_B); a full backward and an I
    share a stage's numbering, and the Ws run the Is' micro-batches in order."""
    s0, s1 = rank, 2 * pp - 1 - rank
    acts, pending = _Counter(), []

    def backward(stage: int, split: bool) -> None:
        mb = acts.add("I" if split else "B", stage, counted_as="I")
        if split:
            pending.append((stage, mb))

    def weight() -> None:
        if pending:
            stage, mb = pending.pop(0)
            acts.out.append(("W", stage, mb))

    for _ in range(2 * (pp - rank - 1)):
        acts.add("F", s0)
    for _ in range(rank + 1):
        acts.add("F", s0)
        acts.add("F", s1)
    for _ in range(pp - rank - 1):
        backward(s1, split=True)
        weight()
        acts.add("F", s1)
    for _ in range(m - 2 * pp + rank + 1):
        acts.add("F", s0)
        backward(s1, split=False)
        acts.add("F", s1)
        backward(s0, split=False)
    for _ in range(pp - rank - 1):
        backward(s1, split=False)
        acts.add("F", s1)
        backward(s0, split=False)
    split = False
    for i in range(rank + 1):
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        backward(s1, split)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        backward(s0, split)
    for _ in range(pp - rank - 1):
        weight()
        backward(s0, split)
    for _ in range(rank + 1):
        weight()
    return acts.out
