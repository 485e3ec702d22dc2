"""The figures of Muon's step on the ranks of a pipeline stage, per bucket, in elements, for the
planner's memory and time (`fived.planner.memory`, `.communication`, `.timing`): one member's own,
from its exchange lists (`member_load`), and a bound of the busiest member's, from aggregates over
the bucket's units (`busiest_load`: no member's lists are built, so it costs O(units + members)).
The buckets run one after another: a step's peak is its largest bucket's.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from fived.layout.muon_plan import Exchange, MemberPlan, StagePlan, Unit, ns_workspace


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
        ns = max(
            s.stored + s.gather_send + s.gather_recv,
            s.stored + s.gather_recv + s.owned + s.workspace,
            s.owned + s.scatter_send + s.scatter_recv,
        )
        return max(
            ns * ns_bytes,
            s.stored * ns_bytes + s.piece * optimizer_bytes,
            (s.owned + s.scatter_recv) * ns_bytes + s.piece * optimizer_bytes,
        )


def stream_bytes(optimizer_bytes: int, ns_bytes: int) -> int:
    """Bytes Muon's step moves through memory per element it stores (AdamW's are 28): the momentum
    (read m, g; write m), the decay (read, write w), the direction (read g, m; write d), each piece
    copied into the gather's buffer, into its assembled matrix, into the scatter's buffer and out of
    it (a read and a write each, in the Newton-Schulz dtype), the update (read w, u; write w), and
    where the dtypes differ the direction's cast to the Newton-Schulz dtype and the update's back."""
    o, n = optimizer_bytes, ns_bytes
    casts = 2 * (o + n) if o != n else 0
    return 3 * o + 2 * o + 3 * o + 4 * 2 * n + 3 * o + casts


def member_load(member: MemberPlan, bucket: int) -> StepLoad:
    """One member's own figures in bucket `bucket` of Muon's step."""
    first, last = member.plan.buckets[bucket]
    units, x, owned = member.plan.units, member.exchanges[bucket], member.owned[bucket]
    pieces = [b.numel for boxes in member.pieces[first:last] for b in boxes]
    return StepLoad(
        stored=sum(pieces),
        owned=sum(units[u].box.numel for u in owned),
        gather_send=Exchange.elements(x.gather_send),
        gather_recv=Exchange.elements(x.gather_recv),
        scatter_send=Exchange.elements(x.scatter_send),
        scatter_recv=Exchange.elements(x.scatter_recv),
        workspace=max((ns_workspace(units[u].rows, units[u].cols) for u in owned), default=0),
        piece=max(pieces, default=0),
    )


def busiest_loads(plan: StagePlan) -> list[StepLoad]:
    """Per bucket, the bound of every member's `StepLoad` (`busiest_load`)."""
    return [busiest_load(plan, plan.units[first:last]) for first, last in plan.buckets]


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
        slots = plan.slots(spec, unit.expert)
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
