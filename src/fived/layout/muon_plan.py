"""Muon's step laid out on the ranks, in plain Python: which tensors Muon orthogonalises, the whole
matrices ("units") it orthogonalises, which rank owns each, and where every piece of every unit
lives, so the runtime (`fived.parallel.muon_exchange`) and the planner (bytes, memory, time) read
one description.

Newton-Schulz needs a whole matrix, and fived's layouts cut matrices by tp (heads, feed-forward
width), ep (experts), ZeRO-1/2 (flat ranges of a buffer, which may end anywhere in a matrix) and
ZeRO-3 (rows), and repeat them over data-parallel ranks (ZeRO-0), HSDP replicas and edp. The scheme,
within one pipeline stage (its dp*cp*tp ranks: the "stage group", mesh group dp_cp_tp):
  units    every Muon tensor whole; a routed experts' tensor [E, in, out] is E units, one per expert
  buckets  the step works through the units in buckets of about train.muon_bucket_mb MiB (Newton-
           Schulz dtype) of whole matrices per member, one after another (gather, orthogonalise,
           scatter, apply), so its transient memory is one bucket's. A bucket takes units across
           the storage slots that hold them (ZeRO-1/2's shards own consecutive layers; ep ranks their
           experts), so its pieces are spread over the members as the stage's are.
  owners   each unit of a bucket goes to one member of the stage group (a routed expert under ep > 1:
           a member of its ep rank), greedily by Newton-Schulz cost: longest first, to the candidate
           least loaded in the bucket, then over all buckets, the lowest on ties. Every unit is
           orthogonalised exactly once per step, on its exact assembled matrix: in float64 the
           result equals one device's.
  gather   every piece of a unit the owner does not hold itself is sent to it by one holder, the
           one nearest the owner on the mesh (fewest differing coordinates, then the lowest):
           under ZeRO-0 or HSDP that is a peer of the owner's own replica (a tp neighbour), not
           replica 0. One all-to-all over the stage group per bucket.
  scatter  the owner sends every other holder (replicas included) its pieces of the result: a
           second all-to-all per bucket. Both run in the Newton-Schulz dtype (the compute dtype).
Every member derives the same units, buckets and owners from the layout (O(units log members)), and
its own part of the exchange from its own pieces and those of the units it owns (`MemberPlan`):
nobody lays out every member's pieces. The runtime checks the plan's placement of its own pieces
against its placement table (`fived.layout.placement`) when it builds the optimizer. The planner prices
the busiest member of each bucket from aggregates (`fived.layout.muon_load.busiest_loads`), without any
member's lists.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property, lru_cache

from fived.config import ModelConfig
from fived.layout.layout import PRECISION_SPECS, Layout
from fived.layout.placement import Box, Placement
from fived.layout.spec import DataRank, FlatLayout, TensorSpec, chunk_specs, in_flat_buffer
from fived.layout.stages import model_key


def is_muon_tensor(spec: TensorSpec) -> bool:
    """Muon orthogonalises the hidden weight matrices: attention, the dense and shared feed-forward,
    the routed experts; AdamW keeps the embedding, the head, norms and the router (and buffers)."""
    return spec.part == "layer" and not spec.buffer and len(spec.shape) >= 2 and not spec.name.endswith("router.weight")


def ns_flops(rows: int, cols: int, steps: int) -> float:
    """Multiply-add flops (x2) of `steps` Newton-Schulz iterations on a rows x cols matrix: with
    m <= n its sides, X X^T (2 m^2 n), A A (2 m^3) and B X (2 m^2 n) per iteration."""
    m, n = sorted((rows, cols))
    return steps * (4.0 * m * m * n + 2.0 * m**3)


def ns_workspace(rows: int, cols: int) -> int:
    """Elements `fived.optim.muon.newton_schulz` allocates on a rows x cols matrix (m <= n its sides): the
    normalised X and the next one (m n each), A = X X^T and b A + c A^2 (m^2 each)."""
    m, n = sorted((rows, cols))
    return 2 * m * n + 2 * m * m


@dataclass(frozen=True)
class Unit:
    name: str  # the canonical tensor name
    expert: int  # -1: the whole tensor; else the routed expert's index
    box: Box  # its region of the whole tensor
    rows: int  # the matrix as stored: a Linear's (out, in), an expert's (in, out)
    cols: int
    owner: int  # member of the stage group

    @property
    def fans(self) -> tuple[int, int]:
        """(fan_out, fan_in), for the update's scale."""
        return (self.cols, self.rows) if self.expert >= 0 else (self.rows, self.cols)


@dataclass(frozen=True)
class Member:
    """A rank of the stage group by its mesh coordinates (MESH_DIMS order: dp_replicate, dp_shard,
    cp, tp, tp innermost) and the expert mesh's (ep innermost over dp*cp, edp across)."""

    index: int
    replicate: int
    shard: int  # in dp_shard
    cp: int
    tp: int
    dp_cp: int  # in the flattened dp*cp
    shard_cp: int  # in the flattened dp_shard*cp: the ZeRO shard index
    ep: int
    edp: int

    @classmethod
    def at(cls, layout: Layout, index: int) -> Member:
        # (`index` among a stage's ranks: the global rank of the first stage's member, the mesh's order)
        at, experts = layout.mesh_coordinates(index), layout.mesh_coordinates(index, "expert")
        return cls(
            index,
            at["dp_replicate"],
            at["dp_shard"],
            at["cp"],
            at["tp"],
            layout.group_index("dp_cp", index),
            layout.group_index("dp_shard_cp", index),
            experts["ep"],
            experts["edp"],
        )

    def data_rank(self, layout: Layout) -> DataRank:
        L = layout
        return DataRank(
            L.zero,
            L.pp,
            L.ep,
            L.dp_cp,
            L.shards,
            self.shard_cp,
            self.replicate,
            self.dp_cp,
            L.edp,
            L.expert_index(self.dp_cp, self.tp),
        )

    def distance(self, other: Member) -> int:
        return sum(
            a != b
            for a, b in (
                (self.replicate, other.replicate),
                (self.shard, other.shard),
                (self.cp, other.cp),
                (self.tp, other.tp),
            )
        )


def bucket_ranges(sizes: list[int], cap: float) -> list[tuple[int, int]]:
    """Consecutive [first, last) ranges of units of `sizes` elements, each at most `cap` in all (a unit
    larger than `cap` alone)."""
    out, first, total = [], 0, 0
    for i, n in enumerate(sizes):
        if i > first and total + n > cap:
            out.append((first, i))
            first, total = i, 0
        total += n
    return out + [(first, len(sizes))] if sizes else []


def flat_layout(specs: list[TensorSpec], layout: Layout, dtype: str) -> FlatLayout | None:
    """The stage's flat buffer as `fived.parallel.zero` lays it out (None: the layout keeps none)."""
    L = layout
    if not L.flat_buffer:
        return None
    flat = [s for s in specs if in_flat_buffer(s, L.ep)]
    return FlatLayout(
        [s.name for s in flat],
        [math.prod(s.local_shape) for s in flat],
        1 if L.zero == 0 else L.shards,
        L.bucket_elements(PRECISION_SPECS[dtype].weight_bytes),
    )


@dataclass(frozen=True)
class Exchange:
    """One member's lists, by peer member (peers with nothing left out), each item (unit index, box
    of the whole tensor): what it sends and receives in the gather (pieces to owners) and the
    scatter (results to holders). Both sides list a pair's items in the same order: by unit, then
    in the sender's (gather) or the holder's (scatter) placement order."""

    gather_send: dict
    gather_recv: dict
    scatter_send: dict
    scatter_recv: dict

    @staticmethod
    def elements(lists: dict) -> int:
        return sum(box.numel for items in lists.values() for _, box in items)


class StagePlan:
    """Muon's units on one pipeline rank's stage group (its `chunks`), their buckets and owners, and
    the rules that say which piece of a unit any member holds (`placement`, `groups`): what every
    member agrees on, computed without laying out every member's pieces."""

    def __init__(self, m: ModelConfig, layout: Layout, dtype: str, chunks):
        L = layout
        self.layout, self.size = L, L.stage_ranks
        self.members = [Member.at(L, i) for i in range(self.size)]
        specs = [
            s for layers, first, last in chunks for s in chunk_specs(m, layers, first, last, tp=L.tp, ep=L.ep, sp=L.sp)
        ]
        self.flat = flat_layout(specs, L, dtype)
        self.specs = {s.name: s for s in specs if is_muon_tensor(s)}
        self.names = list(self.specs)
        units = self._interleaved(self._units())
        cap = L.muon_bucket_mb * 2**20 / PRECISION_SPECS[dtype].compute_bytes * self.size  # whole elements
        self.buckets = bucket_ranges([u[2].numel for u in units], cap)
        self.load = [0.0] * self.size  # Newton-Schulz flops per member, over all buckets
        self.units = [unit for first, last in self.buckets for unit in self._assign(units[first:last])]
        self._groups: dict[tuple, dict] = {}

    def _units(self) -> list[tuple]:
        """(name, expert, box, rows, cols, ep rank or -1) of every matrix, in model order: a routed
        expert under ep > 1 can only go to a member of its own ep rank (which holds it)."""
        out = []
        for s in self.specs.values():
            if not s.expert:
                out.append((s.name, -1, Box((0, 0), s.shape), s.shape[0], s.shape[1], -1))
                continue
            per_rank = s.shape[0] // self.layout.ep  # [E, in, out]: one matrix per expert, E/ep per ep rank
            for j in range(s.shape[0]):
                out.append(
                    (
                        s.name,
                        j,
                        Box((j, 0, 0), (1,) + s.shape[1:]),
                        s.shape[1],
                        s.shape[2],
                        j // per_rank if self.layout.ep > 1 else -1,
                    )
                )
        return out

    def _interleaved(self, units: list[tuple]) -> list[tuple]:
        """The units in the order the buckets take them: merged across the storage slots that hold
        most of each (ZeRO-1/2's shards own consecutive layers, an ep rank its own experts), the
        least-served slot's next unit first, so that a bucket's pieces are spread over the ranks as
        the stage's are; in model order within a slot, and where every slot holds every unit alike
        (whole tensors, ZeRO-3's rows)."""
        by_home: dict[tuple, list] = defaultdict(list)
        for unit in units:
            by_home[self.home(self.specs[unit[0]], unit[1])].append(unit)
        heap = [(0, home, 0) for home in by_home]  # (elements taken, home, next unit)
        heapq.heapify(heap)
        out = []
        while heap:
            taken, home, i = heapq.heappop(heap)
            out.append(by_home[home][i])
            if i + 1 < len(by_home[home]):
                heapq.heappush(heap, (taken + by_home[home][i][2].numel, home, i + 1))
        return out

    def home(self, spec: TensorSpec, expert: int) -> tuple[int, int]:
        """(ep rank, or -1 where every ep rank holds it; the storage slot holding most of it) of the
        unit `expert` of `spec` (-1: the whole tensor)."""
        parts = self.slots(spec, expert)
        slot = max(parts, key=lambda part: (part[1], -part[0]))[0]
        apart = spec.expert and self.layout.ep > 1
        return (expert // (spec.shape[0] // self.layout.ep) if apart else -1), slot

    def slots(self, spec: TensorSpec, expert: int) -> list[tuple[int, int]]:
        """(storage slot, elements) of the tp/ep-local elements of unit `expert` of `spec` (-1: the
        whole tensor) by the slots storing them; of a whole tensor under ZeRO-3, the first slot's rows
        only (the most any slot holds: FSDP2's rows are ceil-sized)."""
        L, dim0 = self.layout, spec.local_shape[0]
        cols = math.prod(spec.local_shape) // dim0
        row, rows = (0, dim0) if expert < 0 else (expert % dim0, 1)  # an expert: one row of [experts, in, out]
        if L.zero == 3:
            shards = L.edp if spec.expert and L.ep > 1 else L.shards
            chunk = math.ceil(dim0 / shards)
            return [(row // chunk, min(chunk, rows) * cols)]
        if self.flat is None or (spec.expert and L.ep > 1):
            return [(0, rows * cols)]
        return self.flat.owners(spec.name, row * cols, (row + rows) * cols)

    def _assign(self, units: list[tuple]) -> list[Unit]:
        """Owners of one bucket's units by Newton-Schulz cost: longest first (bucket order on ties),
        each to its candidate with the least load in the bucket (the buckets run one after another),
        then over all buckets, then the lowest: a heap per ep rank."""
        pools: dict[int, list] = defaultdict(list)
        for member in self.members:
            pools[member.ep if self.layout.ep > 1 else 0].append((0.0, self.load[member.index], member.index))
        for pool in pools.values():
            heapq.heapify(pool)
        owners = [0] * len(units)
        for i in sorted(range(len(units)), key=lambda i: -ns_flops(units[i][3], units[i][4], 1)):
            *_, rows, cols, ep_rank = units[i]
            pool = pools[ep_rank] if ep_rank >= 0 else min(pools.values(), key=lambda heap: heap[0])
            here, _, owners[i] = heapq.heappop(pool)
            cost = ns_flops(rows, cols, 1)
            self.load[owners[i]] += cost
            heapq.heappush(pool, (here + cost, self.load[owners[i]], owners[i]))
        return [
            Unit(name, expert, box, rows, cols, owner)
            for (name, expert, box, rows, cols, _), owner in zip(units, owners)
        ]

    def fans(self, name: str) -> tuple[int, int]:
        """(fan_out, fan_in) of each matrix of tensor `name` (a Linear's (out, in); an expert's
        [in, out] per expert)."""
        shape = self.specs[name].shape
        return (shape[2], shape[1]) if len(shape) == 3 else (shape[0], shape[1])

    def placement(self, name: str, member: int) -> Placement:
        """Where `member` stores its piece of tensor `name` for the optimizer: the storage rules the
        runtime's data-parallel strategies apply (`fived.layout.spec.DataRank`)."""
        spec, who = self.specs[name], self.members[member]
        local = Box(*spec.local_box(tp_rank=who.tp, ep_rank=who.ep))
        stored = who.data_rank(self.layout).stored(spec, self.flat)
        return Placement(
            spec.shape, local, spec.tp_replica(who.tp) + self.layout.tp * stored.replica, stored.rows, stored.flat
        )

    def held(self, unit: Unit, member: int) -> list[Box]:
        """The boxes of `unit` (whole-tensor coordinates) `member` stores, in its placement's order."""
        boxes = (box.intersection(unit.box) for box in self.placement(unit.name, member).boxes())
        return [b for b in boxes if b is not None]

    def groups(self, spec: TensorSpec) -> dict[tuple, list[int]]:
        """The members by the piece of `spec` they hold (key -> members, ascending). Tensors cut and
        stored alike share one grouping (computed once per kind, O(members))."""
        kind = (spec.expert, spec.tp, spec.ep)
        if kind not in self._groups:
            grouped: dict[tuple, list[int]] = defaultdict(list)
            for member in range(self.size):
                grouped[self._kind_key(spec, member)].append(member)
            self._groups[kind] = dict(grouped)
        return self._groups[kind]

    def _kind_key(self, spec: TensorSpec, member: int) -> tuple:
        """Which distinct piece of `spec` `member` holds: its tp and ep cut indices and its storage slot
        (the same for every tensor of a kind, so `groups` computes it once per kind)."""
        who = self.members[member]
        cuts = tuple(cut.index(rank) if cut is not None else 0 for cut, rank in ((spec.tp, who.tp), (spec.ep, who.ep)))
        return cuts, who.data_rank(self.layout).stored(spec, self.flat).slot

    def replicas(self, spec: TensorSpec, member: int) -> list[int]:
        """The members holding the same piece of `spec` as `member` (itself included)."""
        return self.groups(spec)[self._kind_key(spec, member)]

    def sender(self, holders: list[int], owner: int) -> int:
        """Who sends a piece the owner lacks: the holder nearest it on the mesh, then the lowest."""
        me = self.members[owner]
        return min(holders, key=lambda h: (self.members[h].distance(me), h))

    @cached_property
    def traffic(self) -> list[tuple[bool, bool]]:
        """Per bucket, (any piece gathered, any result scattered): a phase nobody sends in is skipped
        by all. An owner holding its unit whole gathers nothing for it (no other piece exists), and
        scatters nothing when no replica holds the unit too."""
        out = []
        for first, last in self.buckets:
            gather = scatter = False
            for unit in self.units[first:last]:
                whole = sum(b.numel for b in self.held(unit, unit.owner)) == unit.box.numel
                gather = gather or not whole
                scatter = scatter or not whole or len(self.replicas(self.specs[unit.name], unit.owner)) > 1
            out.append((gather, scatter))
        return out

    def member_plan(self, member: int) -> MemberPlan:
        return MemberPlan(self, member)

    def stored_elements(self, member: int) -> int:
        """Elements of Muon tensors `member` stores (each gets one momentum buffer)."""
        return sum(math.prod(self.placement(name, member).stored_shape) for name in self.names)

    def member_of_shard(self, shard_index: int) -> int:
        """The first member (replica 0, tp rank 0) at position `shard_index` of the dp_shard*cp group."""
        return shard_index * self.layout.tp


class MemberPlan:
    """One member's part in Muon's step: its pieces, and per bucket the units it owns and its
    exchange lists, derived from its own pieces and those of the units it owns."""

    def __init__(self, plan: StagePlan, me: int):
        self.plan, self.me = plan, me
        self.placements = {name: plan.placement(name, me) for name in plan.names}
        boxes = {name: placement.boxes() for name, placement in self.placements.items()}
        self.pieces = [
            [b for b in (box.intersection(unit.box) for box in boxes[unit.name]) if b is not None]
            for unit in plan.units
        ]  # per unit, the boxes of it stored here
        self._senders: dict[tuple, int] = {}
        self.owned, self.exchanges = [], []  # per bucket
        for first, last in plan.buckets:
            self.owned.append([u for u in range(first, last) if plan.units[u].owner == me])
            lists: list[defaultdict[int, list]] = [defaultdict(list) for _ in range(4)]
            for u in range(first, last):
                self._add(u, plan.units[u], *lists)
            self.exchanges.append(Exchange(*({peer: tuple(items) for peer, items in lst.items()} for lst in lists)))

    def held(self, u: int) -> list[Box]:
        """The boxes of unit `u` (whole-tensor coordinates) this member stores, in its placement's order."""
        return self.pieces[u]

    def _add(self, u: int, unit: Unit, gather_send, gather_recv, scatter_send, scatter_recv) -> None:
        spec, me, owner = self.plan.specs[unit.name], self.me, unit.owner
        if owner == me:
            for holders in self.plan.groups(spec).values():
                boxes = self.held(u) if me in holders else self.plan.held(unit, holders[0])
                if not boxes:
                    continue
                if me not in holders:
                    gather_recv[self._sender(spec, holders, me)] += [(u, box) for box in boxes]
                for h in holders:
                    if h != me:
                        scatter_send[h] += [(u, box) for box in boxes]
            return
        mine = self.held(u)
        if not mine:
            return
        scatter_recv[owner] += [(u, box) for box in mine]
        holders = self.plan.replicas(spec, me)
        if owner not in holders and self._sender(spec, holders, owner) == me:
            gather_send[owner] += [(u, box) for box in mine]

    def _sender(self, spec: TensorSpec, holders: list[int], owner: int) -> int:
        key = (spec.expert, spec.tp, spec.ep, holders[0], owner)
        if key not in self._senders:
            self._senders[key] = self.plan.sender(holders, owner)
        return self._senders[key]


@lru_cache(maxsize=16)
def _stage_plan(key: tuple, layout: Layout, dtype: str, chunks: tuple) -> StagePlan:
    return StagePlan(ModelConfig(**dict(key)), layout, dtype, chunks)


def stage_plan(m: ModelConfig, layout: Layout, dtype: str, chunks) -> StagePlan:
    """The plan of the stage group holding `chunks` [(layers, first, last)] (cached, a few deep: the
    planner asks again for every layout that differs only in activation choices)."""
    chunks = tuple((tuple(layers), first, last) for layers, first, last in chunks)
    # (the plan does not depend on activation choices or Newton-Schulz's iterations)
    layout = layout.with_(micro_batch=1, checkpointing="none", muon_ns_steps=Layout.muon_ns_steps)
    return _stage_plan(model_key(m), layout, dtype, chunks)
