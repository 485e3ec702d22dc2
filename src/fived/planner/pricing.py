"""The search's second pass (`fived.planner.search.plan`): price the fitting layouts the first pass
found, each at most once, lowest floor first, and with `keep` skip every one that provably cannot
change what `fived plan` prints.

The first pass already decided, by memory alone, which layouts fit (and so every count and memory
figure printed). What is left is step times, and a layout's step is at least `timing.step_floor`
(its compute and the bubble on it; the other terms are >= 0), and at least the tighter
`step_floor(collectives=True)` (its model-parallel collectives left exposed besides: asked only of a
layout the first could not skip). Priced in ascending order of the first, the plans `fived plan`
prints are found early: the `keep` fastest, and so the winner; for each decision, the fastest plan
deciding it unlike the winner (its runner-up); one plan with each value (a value without one reads
"nothing fits"). A layout whose floor already exceeds the `keep` fastest and, for each decision it
decides unlike the winner, a plan deciding it so, and whose values all have a plan, can change none
of them: it is not priced. Ties keep the first pass's order (`Candidate.index`), as the whole
search's stable sort does, so pricing in another order changes nothing.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fived.config import ModelConfig
from fived.layout.layout import Layout
from fived.planner.memory import MemoryEstimate
from fived.planner.runtimes import Runtime
from fived.planner.timing import Cluster, compute_key, step_floor


@dataclass
class Candidate:
    """A fitting layout of the first pass: its place in the enumeration and the choices of it that fit
    ((layout, memory): `search.reduction_choices`, in their order)."""

    index: int
    layout: Layout
    fits: list[tuple[Layout, MemoryEstimate]]
    floor: float = 0.0  # a lower bound of its step (with `keep`): its fitting choices' least `step_floor`
    needs: frozenset = field(default_factory=frozenset)  # the fitting choices' memory totals

    @property
    def one_memory(self) -> int | None:
        """The memory the search notes for it whichever choice is kept (None: its choices differ)."""
        return next(iter(self.needs)) if len(self.needs) == 1 else None


class _Bound:
    """What the plans priced so far already decide: the `keep` fastest totals, the winner (the fastest,
    first in enumeration order among equals), each decision's values seen, and each decision's fastest
    total with a value other than the winner's (its runner-up's, if the winner stays)."""

    MARGIN = 1e-9  # (relative: the step's terms are summed in float; a bound must not win by rounding)

    def __init__(self, keep: int, decisions: tuple[str, ...]) -> None:
        self.keep, self.decisions = keep, decisions
        self.fastest: list[float] = []  # ascending
        self.winner: tuple[float, int, Layout] | None = None
        self.best: dict[tuple, float] = {}  # (decision, value) -> the fastest total with it
        self.other: dict[str, float] = {}  # decision -> the fastest total deciding it unlike the winner

    def add(self, c: Candidate, total: float) -> None:
        bisect.insort(self.fastest, total)
        del self.fastest[self.keep :]
        new_winner = self.winner is None or (total, c.index) < self.winner[:2]
        if new_winner or self.winner is None:
            self.winner = (total, c.index, c.layout)
        for d in self.decisions:
            k = (d, getattr(c.layout, d))
            if total < self.best.get(k, float("inf")):
                self.best[k] = total
        w = self.winner[2]
        if new_winner:  # (each decision's values unlike the new winner's: looked at afresh)
            self.other = {
                d: min((t for (dd, v), t in self.best.items() if dd == d and v != getattr(w, d)), default=float("inf"))
                for d in self.decisions
            }
            return
        for d in self.decisions:  # (the same winner: only `c`'s values can lower a figure)
            if getattr(c.layout, d) != getattr(w, d) and total < self.other[d]:
                self.other[d] = total

    def full(self) -> bool:
        """Whether the `keep` fastest are known (until then no floor skips anything)."""
        return self.winner is not None and len(self.fastest) >= self.keep

    def beaten(self, c: Candidate, floor: float) -> bool:
        """Whether `c`, whose step is at least `floor`, can be none of what `fived plan` prints: neither
        among the `keep` fastest nor the winner (its floor above the `keep` fastest, which only get
        faster), nor the best plan deciding anything unlike the winner (for each decision it decides
        unlike the winner, a plan deciding it so is faster than its floor: should the winner change
        later, to a plan faster still, a decision it decides unlike the old winner has the old
        winner, faster than `c`, as a plan deciding it so; one it decides as the old winner, the same
        plans as now), nor the only plan with one of its decisions' values (each seen). None of this
        depends on the order `c` comes in."""
        floor /= 1 + self.MARGIN
        if self.winner is None or len(self.fastest) < self.keep or floor <= self.fastest[-1]:
            return False
        w = self.winner[2]
        for d in self.decisions:
            value = getattr(c.layout, d)
            if (d, value) not in self.best or (value != getattr(w, d) and not floor > self.other[d]):
                return False
        return True


def compute_floors(
    candidates: list[Candidate],
    model: ModelConfig,
    cluster: Cluster,
    seq_len: int,
    global_batch: int,
    dtype: str,
    runtime: Runtime,
) -> None:
    """Each candidate's floor: the least `timing.step_floor` of its fitting choices, each distinct one
    priced once (`timing.compute_key`: layouts differing in what it does not read share it)."""
    table: dict[tuple, float] = {}
    for c in candidates:
        seconds = []
        for x, _ in c.fits:
            k = compute_key(x)
            if k not in table:
                table[k] = step_floor(model, x, cluster, seq_len, global_batch, dtype, runtime)
            seconds.append(table[k])
        c.floor = min(seconds)


def collectives_floor(
    c: Candidate,
    model: ModelConfig,
    cluster: Cluster,
    seq_len: int,
    global_batch: int,
    dtype: str,
    runtime: Runtime,
) -> float:
    """A tighter floor of `c` than `compute_floors`': its fitting choices' least `step_floor` with the
    model-parallel collectives (asked only of a candidate the compute's floor could not skip: most
    of what it reads, the model-parallel collectives' memo, pricing would read next)."""
    return min(
        step_floor(model, x, cluster, seq_len, global_batch, dtype, runtime, collectives=True) for x, _ in c.fits
    )


def price(
    candidates: list[Candidate],
    model: ModelConfig,
    cluster: Cluster,
    seq_len: int,
    global_batch: int,
    dtype: str,
    runtime: Runtime,
    plan_of: Callable[[Candidate], Any],
    *,
    keep: int | None,
    decisions: tuple[str, ...],
    smallest: dict,
    note,
) -> list:
    """The plans of `candidates` (`search.Plan`, fastest first, ties in enumeration order): every one
    (`keep` None), or those that can matter (`_Bound`); `plan_of(candidate)`: its fastest fitting plan
    (the search's, passed in: pricing does not import the search). A skipped candidate whose choices need
    different memory is priced after all when the memory it would note might lower a figure of
    `smallest` (which choice is kept, and so its memory, depends on their times); `note(layout,
    bytes)` notes the memory of those priced here."""
    order = candidates
    if keep:
        compute_floors(candidates, model, cluster, seq_len, global_batch, dtype, runtime)
        order = sorted(candidates, key=lambda c: c.floor)
    bound = _Bound(keep, decisions) if keep else None
    priced: list[tuple[float, int, object]] = []
    skipped: list[Candidate] = []
    for c in order:  # (a floor skips a layout whatever the order: see `_Bound.beaten`; the order finds
        # the fast plans, and so the bounds, early)
        if bound is not None and (
            bound.beaten(c, c.floor)
            or (
                bound.full()
                and bound.beaten(c, collectives_floor(c, model, cluster, seq_len, global_batch, dtype, runtime))
            )
        ):
            skipped.append(c)
            continue
        p = plan_of(c)
        priced.append((p.time.total, c.index, p))
        if bound is not None:
            bound.add(c, p.time.total)
        if c.one_memory is None:
            note(c.layout, p.memory.total)
    for c in skipped:  # (smallest is final but for these: a figure they leave alone stays so)
        keys = [(d, getattr(c.layout, d)) for d in decisions]
        if c.one_memory is None and not all(k in smallest and min(c.needs) >= smallest[k] for k in keys):
            p = plan_of(c)
            priced.append((p.time.total, c.index, p))
            note(c.layout, p.memory.total)
    priced.sort(key=lambda t: (t[0], t[1]))
    return [p for _, _, p in priced]
