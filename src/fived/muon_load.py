"""The figures of Muon's step on the ranks of a pipeline stage, in elements, for the planner's
memory and time (`fived.planner.memory`, `.communication`, `.timing`): one member's own, from its
exchange lists (`member_load`), and a bound of the busiest member's, from aggregates over the plan's
units (`busiest_load`: no member's lists are built, so it costs O(units + members)).
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from fived.layout.spec import TensorSpec
from fived.muon_plan import Exchange, MemberPlan, StagePlan, Unit, ns_workspace


@dataclass(frozen=True)
class StepLoad:
    """Elements one member handles in Muon's step: the pieces it stores (`stored`; their directions
    in the Newton-Schulz dtype), the units it owns (`owned`: assembled, then their results), what it
    sends and receives in each all-to-all, Newton-Schulz's workspace on its largest owned unit, and
    its largest piece (a direction is made in the optimizer's dtype before its cast)."""

    stored: int
    owned: int
    gather_send: int
    gather_recv: int
    scatter_send: int
    scatter_recv: int
    workspace: int
    piece: int

    def peak(self, ns_bytes: int, optimizer_bytes: int) -> int:
        """Bytes alive at the step's peak, as `fived.parallel.muon_exchange` frees them: the directions
        (one piece at a time made in the optimizer's dtype), then with the gather's buffers, then
        with the received pieces, the assembled units and their results, and Newton-Schulz's
        workspace, then (directions and gathered pieces let go) the results with the scatter's."""
        s = self
        ns = max(s.stored + s.gather_send + s.gather_recv, s.stored + s.gather_recv + s.owned + s.workspace,
                 s.owned + s.scatter_send + s.scatter_recv)
        return max(ns * ns_bytes, s.stored * ns_bytes + s.piece * optimizer_bytes,
                   (s.owned + s.scatter_recv) * ns_bytes + s.piece * optimizer_bytes)


def member_load(member: MemberPlan) -> StepLoad:
    """One member's own figures in Muon's step."""
    units, x = member.plan.units, member.exchange
    pieces = [b.numel for boxes in member.pieces for b in boxes]
    return StepLoad(stored=sum(pieces), owned=sum(units[u].box.numel for u in member.owned),
                    gather_send=Exchange.elements(x.gather_send), gather_recv=Exchange.elements(x.gather_recv),
                    scatter_send=Exchange.elements(x.scatter_send), scatter_recv=Exchange.elements(x.scatter_recv),
                    workspace=max((ns_workspace(units[u].rows, units[u].cols) for u in member.owned), default=0),
                    piece=max(pieces, default=0))


def busiest_load(plan: StagePlan, units: list[Unit]) -> StepLoad:
    """An upper bound of every member's `StepLoad` over `units`, from aggregates: the most any
    member stores (`most_stored`), the most any owns (the owners are known), a sender sends at most
    what it stores and an owner receives at most what it owns, and sends its results to at most the
    replicas of each piece."""
    owned = [0] * plan.size
    for unit in units:
        owned[unit.owner] += unit.box.numel
    stored, piece = most_stored(plan, units)
    most = max(owned)
    replicas = max((len(next(iter(plan.groups(plan.specs[unit.name]).values()))) for unit in units), default=1)
    workspace = max((ns_workspace(u.rows, u.cols) for u in units), default=0)
    return StepLoad(stored, most, stored, most, replicas * most, stored, workspace, piece)


def most_stored(plan: StagePlan, units: list[Unit]) -> tuple[int, int]:
    """(at least the most elements of `units` any member stores, at least its largest piece of one).
    Per storage slot: the flat buffer's shards by the ranges they own, a routed expert by the ZeRO-3
    shard holding its row (edp under ep > 1, where ep ranks hold different experts), whole tensors
    once; ZeRO-3's rows of whole tensors at the first shard, the largest."""
    L = plan.layout
    dense: dict[int, int] = defaultdict(int)  # slot -> elements (tensors not apart)
    apart: dict[tuple, int] = defaultdict(int)  # (ep rank, slot) -> elements (routed experts under ep > 1)
    first_rows = piece = 0
    for unit in units:
        spec = plan.specs[unit.name]
        slots = _slot_parts(plan, spec, unit)
        if spec.expert and L.ep > 1:
            for slot, n in slots:
                apart[(unit.expert // (spec.shape[0] // L.ep), slot)] += n
        elif L.zero == 3 and unit.expert < 0:
            first_rows += slots[0][1]
        else:
            for slot, n in slots:
                dense[slot] += n
        piece = max(piece, max((n for _, n in slots), default=0))
    return first_rows + max(dense.values(), default=0) + max(apart.values(), default=0), piece


def _slot_parts(plan: StagePlan, spec: TensorSpec, unit: Unit) -> list[tuple[int, int]]:
    """(storage slot, elements) of a unit's tp/ep-local elements by the slots storing them; of a
    whole tensor under ZeRO-3, the first slot's rows only (the most any slot holds)."""
    L, dim0 = plan.layout, spec.local_shape[0]
    cols = math.prod(spec.local_shape) // dim0
    if unit.expert < 0:
        row, rows = 0, dim0
    else:  # one row of the local [experts, in, out] tensor
        row, rows = unit.expert % dim0, 1
    if L.zero == 3:
        shards = L.dp * L.cp // L.ep if spec.expert and L.ep > 1 else L.dp_shard * L.cp
        chunk = math.ceil(dim0 / shards)
        return [(row // chunk, min(chunk, rows) * cols)]
    if plan.flat is None or (spec.expert and L.ep > 1):
        return [(0, rows * cols)]
    return plan.flat.owners(spec.name, row * cols, (row + rows) * cols)
