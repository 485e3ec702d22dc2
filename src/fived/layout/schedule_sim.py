"""Bubble of a pipeline schedule from its per-rank action lists, costed with unit times; and the
action lists of fived's six schedules generated without running anything (for the planner).

Each rank runs its compute actions in the given order; an action starts when the rank is free and
its inputs exist: F(s, m) needs F(s-1, m); B or I(s, m) needs F(s, m) and the input gradient from
B or I(s+1, m); W(s, m) needs I(s, m). Communication is free. A stage's share of a layer-sized unit
is 1/chunks (a rank holding v stages does 1/v of its work per action): F = 1, B = 2, I = W = 1,
each divided by the number of stages per rank. The bubble is the idle fraction of the makespan,
averaged over ranks: for GPipe and 1F1B exactly (p-1)/(m+p-1).

Generated orders (`schedule_actions`) are the orders the runtime executes, without torch: the
multi-stage schedules' from fived.layout.schedule_orders (checked against torch's own generators);
GPipe's and 1F1B's, whose runtime order is hard-coded in their `_step_microbatches`, from a few
lines here.
"""

from __future__ import annotations

import functools
from typing import Any

from fived.layout.layout import SINGLE_STAGE, stages_per_rank
from fived.layout.schedule_orders import multi_stage_order

COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev")
Actions = dict[int, list[tuple[str, int, int]]]


def simulate(actions_per_rank: Actions, n_stages: int, record: list | None = None) -> dict[str, Any]:
    """actions_per_rank: rank -> [(kind, stage, microbatch)] in execution order (F/B/I/W only).
    Returns makespan, busy time per rank and the bubble fraction.

    Every action's start is fixed by its rank's previous action and its dependencies, so the times
    do not depend on the order in which ranks are visited. A rank runs ahead until it blocks on a
    dependency and is woken when that dependency completes: each action is visited once (sweeping
    all ranks until none progresses would cost ranks x waves). Finish times live in flat lists
    indexed by stage * mbs + microbatch, about twice as fast as a dict keyed by tuples. `record`: a
    list to append every action's (rank, kind, stage, microbatch, start, duration) to."""
    ranks = sorted(actions_per_rank)
    per_rank_stages = max(1, n_stages // len(ranks))
    cost_of = {k: c / per_rank_stages for k, c in COST.items()}
    mbs = 1 + max((mb for acts in actions_per_rank.values() for _, _, mb in acts), default=0)
    # finish times of F, I and G: the input gradient a stage sends back, from its B or its I
    done_f: list[float | None] = [None] * (n_stages * mbs)
    done_i: list[float | None] = [None] * (n_stages * mbs)
    done_g: list[float | None] = [None] * (n_stages * mbs)
    # index -> ranks blocked on it, per table (the dependencies spelled out per kind: the hot loop)
    wait_f: dict[int, list[int]] = {}
    wait_i: dict[int, list[int]] = {}
    wait_g: dict[int, list[int]] = {}
    free = dict.fromkeys(ranks, 0.0)
    busy = dict.fromkeys(ranks, 0.0)
    cursor = dict.fromkeys(ranks, 0)
    last = n_stages - 1
    runnable = list(reversed(ranks))
    while runnable:
        r = runnable.pop()
        queue, i, ready_at, spent = actions_per_rank[r], cursor[r], free[r], busy[r]
        n = len(queue)
        while i < n:
            kind, stage, mb = queue[i]
            x = stage * mbs + mb
            start = ready_at
            if kind == "F":  # the previous stage's output
                if stage > 0:
                    t = done_f[x - mbs]
                    if t is None:
                        wait_f.setdefault(x - mbs, []).append(r)
                        break
                    if t > start:
                        start = t
            elif kind == "W":  # after its own I
                t = done_i[x]
                if t is None:
                    wait_i.setdefault(x, []).append(r)
                    break
                if t > start:
                    start = t
            else:  # B or I: own forward and (but on the last stage) the next stage's input gradient
                t = done_f[x]
                if t is None:
                    wait_f.setdefault(x, []).append(r)
                    break
                if t > start:
                    start = t
                if stage < last:
                    t = done_g[x + mbs]
                    if t is None:
                        wait_g.setdefault(x + mbs, []).append(r)
                        break
                    if t > start:
                        start = t
            cost = cost_of[kind]
            if record is not None:
                record.append((r, kind, stage, mb, start, cost))
            ready_at = start + cost
            spent += cost
            i += 1
            if kind == "F":
                done_f[x] = ready_at
                if x in wait_f:
                    runnable.extend(wait_f.pop(x))
            elif kind != "W":  # B fills G; I fills I, and G unless a B has (a malformed list's: B wins)
                if kind == "I":
                    done_i[x] = ready_at
                    if x in wait_i:
                        runnable.extend(wait_i.pop(x))
                if kind == "B" or done_g[x] is None:
                    done_g[x] = ready_at
                if x in wait_g:
                    runnable.extend(wait_g.pop(x))
        cursor[r], free[r], busy[r] = i, ready_at, spent
    if any(cursor[r] < len(actions_per_rank[r]) for r in ranks):
        raise ValueError("the action lists deadlock: some dependency is never produced")
    makespan = max(free.values())
    bubble = sum(1 - busy[r] / makespan for r in ranks) / len(ranks)
    return {"makespan": makespan, "bubble": bubble, "busy": busy}


def bubble_of(actions, n_stages: int) -> float:
    """Bubble fraction from recorded `Action`s (any ranks, any order of the list)."""
    per_rank: dict[int, list] = {}
    for a in sorted(actions, key=lambda a: (a.rank, a.start)):
        if a.kind in COST:
            per_rank.setdefault(a.rank, []).append((a.kind, a.stage, a.microbatch))
    return simulate(per_rank, n_stages)["bubble"]


# ----------------------------------------------------------------------------------------------
# Action lists without running: what the runtime (fived.parallel.pipeline + torch) executes.


def n_stages_of(schedule: str, pp: int, virtual: int) -> int:
    return pp * stages_per_rank(schedule, virtual) if pp > 1 else 1


def check_schedule(schedule: str, pp: int, virtual: int, microbatches: int) -> None:
    """Raise ValueError where fived's config check or torch's schedule constructor would refuse."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; one of {', '.join(SCHEDULES)}")
    if pp < 1 or virtual < 1 or microbatches < 1:
        raise ValueError(f"pp, virtual and microbatches must be >= 1, got {pp}, {virtual}, {microbatches}")
    if pp == 1:
        return
    if microbatches < pp:  # fived.parallel.mesh (torch's 1F1B refuses it too)
        raise ValueError(f"{microbatches} micro-batches < pp={pp}")
    if schedule == "dualpipev" and microbatches < 2 * pp:  # torch: at least as many as stages
        raise ValueError(f"dualpipev needs >= 2*pp={2 * pp} micro-batches, got {microbatches}")
    rounds = max(1, microbatches // pp)
    if schedule in ("interleaved-1f1b", "zero-bubble") and microbatches % rounds:
        raise ValueError(f"{schedule} needs micro-batches divisible by the rounds ({rounds}), got {microbatches}")


def schedule_actions(schedule: str, pp: int, virtual: int, microbatches: int) -> Actions:
    """rank -> [(kind, stage, microbatch)] in the order the runtime executes them (F, B, I, W; no
    communication). Stages and their ranks as in fived.parallel.pipeline.stage_rank. `virtual` only
    matters for interleaved-1f1b and zero-bubble (V-shaped schedules hold 2 stages per rank). pp == 1
    is fived's unpipelined gradient accumulation: F then B per micro-batch."""
    check_schedule(schedule, pp, virtual, microbatches)
    m = microbatches
    if pp == 1:
        return {0: [a for i in range(m) for a in (("F", 0, i), ("B", 0, i))]}
    if schedule == "gpipe":  # all forwards, then all backwards (ScheduleGPipe._step_microbatches)
        return {r: [("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)] for r in range(pp)}
    if schedule == "1f1b":
        return {r: _one_f_one_b(r, pp, m) for r in range(pp)}
    local = stages_per_rank(schedule, virtual)
    return {r: multi_stage_order(schedule, pp, local, m, r) for r in range(pp)}


def _one_f_one_b(rank: int, pp: int, m: int) -> list[tuple[str, int, int]]:
    """Schedule1F1B._step_microbatches: min(m, pp - rank) warm-up forwards, then B,F pairs, then the
    remaining backwards. (Its `_get_pipeline_order` is not what runs, and in torch 2.13 it numbers
    the last rank's forwards from 1.)"""
    warmup = min(m, pp - rank)
    out = [("F", rank, i) for i in range(warmup)]
    for i in range(m):
        out.append(("B", rank, i))
        if warmup + i < m:
            out.append(("F", rank, warmup + i))
    return out


def schedule_bubble(schedule: str, pp: int, virtual: int, microbatches: int) -> float:
    """Bubble fraction (unit costs, see `simulate`) of a schedule, without running it. Memoised."""
    return analyse(schedule, pp, virtual, microbatches)[0]


def in_flight_microbatches(schedule: str, pp: int, virtual: int, microbatches: int) -> list[float]:
    """Per rank: the most micro-batch activations alive at once, in whole-rank micro-batches.

    F(s, m) stays alive until its B, or until its W where the backward is split: the weight
    gradient still needs the layer inputs after I. Only the rank's own actions change its count,
    so the peak follows from the order alone. Counted per stage and divided by stages per rank
    (a stage holds 1/v of the rank's layers), so it can be a half: GPipe gives m, 1F1B
    min(pp - rank, m), ZB-V pp on every rank once m >= 2pp - 1. Memoised."""
    return list(analyse(schedule, pp, virtual, microbatches)[1])


@functools.lru_cache(maxsize=4096)
def analyse(schedule: str, pp: int, virtual: int, microbatches: int) -> tuple[float, tuple[float, ...]]:
    """Bubble and in-flight counts from one generation of the action lists (the planner asks for
    both; the lists themselves are too big to keep: 786k actions at pp=64, m=2048). GPipe's and
    1F1B's in closed form (`_single_stage_profile`)."""
    if pp > 1 and schedule in SINGLE_STAGE:
        check_schedule(schedule, pp, virtual, microbatches)
        return _single_stage_profile(schedule, pp, microbatches)
    actions = schedule_actions(schedule, pp, virtual, microbatches)
    n_stages = n_stages_of(schedule, pp, virtual)
    in_flight = tuple(peak_alive(actions[rank]) / (n_stages // pp) for rank in sorted(actions))
    return simulate(actions, n_stages)["bubble"], in_flight


def _single_stage_profile(schedule: str, pp: int, m: int) -> tuple[float, tuple[float, ...]]:
    """`analyse` of GPipe or 1F1B (m >= pp) without simulating: every rank busy 3m (F = 1, B = 2), the
    last backward ending at 3(m + pp - 1); in flight, GPipe's m and 1F1B's warm-up min(m, pp - rank).
    Summed as `simulate` sums, so the same floats (tests/test_schedule_sim.py, against the simulation)."""
    makespan, busy = 3.0 * (m + pp - 1), 3.0 * m
    bubble = sum(1 - busy / makespan for _ in range(pp)) / pp
    return bubble, tuple(float(m if schedule == "gpipe" else min(m, pp - r)) for r in range(pp))


def schedule_timeline(schedule: str, pp: int, virtual: int, microbatches: int) -> list[tuple]:
    """(rank, kind, stage, microbatch, start, duration) of every action of one step, unit costs."""
    record: list = []
    simulate(schedule_actions(schedule, pp, virtual, microbatches), n_stages_of(schedule, pp, virtual), record)
    return record


def peak_alive(actions: list[tuple[str, int, int]]) -> int:
    """Most (stage, micro-batch) forwards of one rank's ordered actions alive at once: from F to B,
    or to W where the backward is split (I frees nothing, W still needs the layer inputs)."""
    alive = peak = 0
    for kind, _, _ in actions:
        if kind == "F":
            alive += 1
            peak = max(peak, alive)
        elif kind in ("B", "W"):
            alive -= 1
    return peak


EXACT_ROUNDS = 3  # micro-batches per pipeline rank simulated exactly; beyond, the idle time is constant


@functools.lru_cache(maxsize=65536)
def pipeline_profile(schedule: str, pp: int, virtual: int, microbatches: int) -> tuple[float, tuple[float, ...]]:
    """(bubble fraction, in-flight micro-batches per rank), as `analyse`, for any number of
    micro-batches at the cost of a few rounds: past EXACT_ROUNDS*pp micro-batches the fill and drain
    idle time no longer changes (steady state), so the simulation at that size is extrapolated:
    bubble = idle / (idle + 3m) with unit costs F=1, B=2; in-flight counts stay put (or grow with m,
    as GPipe's, if they grew over the last pp). tests/test_planner.py checks the extrapolation
    against the full simulation."""
    cap = EXACT_ROUNDS * pp
    if microbatches <= cap or (microbatches % pp and schedule not in SINGLE_STAGE):
        # (looped multi-stage schedules settle into a different steady state when m is not a
        # multiple of pp: simulated in full)
        return analyse(schedule, pp, virtual, microbatches)
    bubble, flight = analyse(schedule, pp, virtual, cap)
    _, before = analyse(schedule, pp, virtual, cap - pp)
    idle = bubble / (1 - bubble) * 3 * cap
    grow = [(a - b) / pp for a, b in zip(flight, before)]
    return idle / (idle + 3 * microbatches), tuple(f + g * (microbatches - cap) for f, g in zip(flight, grow))
