"""Bubble of a pipeline schedule from its per-rank action lists, costed with unit times.

Each rank runs its compute actions in the given order; an action starts when the rank is free and
its inputs exist: F(s, m) needs F(s-1, m); B or I(s, m) needs F(s, m) and the input gradient from
B or I(s+1, m); W(s, m) needs I(s, m). Communication is free. A stage's share of a layer-sized unit
is 1/chunks (a rank holding v stages does 1/v of its work per action): F = 1, B = 2, I = W = 1,
each divided by the number of stages per rank. The bubble is the idle fraction of the makespan,
averaged over ranks: for GPipe and 1F1B exactly (p-1)/(m+p-1).
"""
from __future__ import annotations

COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def simulate(actions_per_rank: dict[int, list[tuple[str, int, int]]], n_stages: int) -> dict[str, float]:
    """actions_per_rank: rank -> [(kind, stage, microbatch)] in execution order (F/B/I/W only).
    Returns makespan, busy time per rank and the bubble fraction."""
    ranks = sorted(actions_per_rank)
    per_rank_stages = max(1, n_stages // len(ranks))
    done: dict[tuple[str, int, int], float] = {}
    free = {r: 0.0 for r in ranks}
    busy = {r: 0.0 for r in ranks}
    cursor = {r: 0 for r in ranks}
    remaining = sum(len(a) for a in actions_per_rank.values())
    while remaining:
        progressed = False
        for r in ranks:
            queue = actions_per_rank[r]
            while cursor[r] < len(queue):
                kind, stage, mb = queue[cursor[r]]
                deps = _dependencies(kind, stage, mb, n_stages)
                if any(_finished(done, d) is None for d in deps):
                    break
                ready = max([free[r]] + [_finished(done, d) for d in deps])
                cost = COST[kind] / per_rank_stages
                done[(kind, stage, mb)] = ready + cost
                free[r] = ready + cost
                busy[r] += cost
                cursor[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("the action lists deadlock: some dependency is never produced")
    makespan = max(free.values())
    bubble = sum(1 - busy[r] / makespan for r in ranks) / len(ranks)
    return {"makespan": makespan, "bubble": bubble, "busy": busy}


def _dependencies(kind: str, stage: int, mb: int, n_stages: int) -> list[tuple[str, int, int]]:
    if kind == "F":
        return [("F", stage - 1, mb)] if stage > 0 else []
    if kind in ("B", "I"):
        deps = [("F", stage, mb)]
        if stage < n_stages - 1:
            deps.append(("grad", stage + 1, mb))
        return deps
    return [("I", stage, mb)]  # W


def _finished(done: dict, dep: tuple[str, int, int]) -> float | None:
    kind, stage, mb = dep
    if kind == "grad":  # the input gradient of the next stage: from its B or its I
        return done.get(("B", stage, mb), done.get(("I", stage, mb)))
    return done.get(dep)


def bubble_of(actions, n_stages: int) -> float:
    """Bubble fraction from recorded `Action`s (any ranks, any order of the list)."""
    per_rank: dict[int, list] = {}
    for a in sorted(actions, key=lambda a: (a.rank, a.start)):
        if a.kind in COST:
            per_rank.setdefault(a.rank, []).append((a.kind, a.stage, a.microbatch))
    return simulate(per_rank, n_stages)["bubble"]
