"""Muon's step laid out on the ranks, in plain Python: which tensors Muon orthogonalises, the whole
matrices ("units") it orthogonalises, which rank owns each, and where every piece of every unit
lives, so the runtime (`fived.parallel.muon_exchange`) and the planner (bytes, memory, time) read
one description.

Newton-Schulz needs a whole matrix, and fived's layouts cut matrices by tp (heads, feed-forward
width), ep (experts), ZeRO-1/2 (flat ranges of a buffer, which may end anywhere in a matrix) and
ZeRO-3 (rows), and repeat them over data-parallel ranks (ZeRO-0), HSDP replicas and edp. The scheme,
within one pipeline stage (its dp*cp*tp ranks: the "stage group", mesh group dp_cp_tp):
  units    every Muon tensor whole; a routed experts' tensor [E, in, out] is E units, one per expert
  owners   each unit goes to one member of the stage group (a routed expert under ep > 1: a member
           of its ep rank), greedily by Newton-Schulz cost: longest first, to the least-loaded
           candidate, the lowest on ties. Every unit is orthogonalised exactly once per step, on
           its exact assembled matrix: in float64 the result equals one device's.
  gather   every piece of a unit the owner does not hold itself is sent to it by one holder, the
           one nearest the owner on the mesh (fewest differing coordinates, then the lowest):
           under ZeRO-0 or HSDP that is a peer of the owner's own replica (a tp neighbour), not
           replica 0. One all-to-all over the stage group.
  scatter  the owner sends every other holder (replicas included) its pieces of the result: a
           second all-to-all. Both run in the Newton-Schulz dtype (the run's compute dtype).
Every member derives the same plan from the layout; the runtime checks the plan's placement of its
own pieces against its placement table (`fived.placement`) when it builds the optimizer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache

from fived.config import ModelConfig
from fived.layout.layout import PRECISION_SPECS, Layout
from fived.layout.spec import DataRank, FlatLayout, TensorSpec, chunk_specs, in_flat_buffer, keeps_flat_buffer
from fived.layout.stages import model_key
from fived.placement import Box, Placement


def is_muon_tensor(spec: TensorSpec) -> bool:
    """Muon orthogonalises the hidden weight matrices: attention, the dense and shared feed-forward,
    the routed experts; AdamW keeps the embedding, the head, norms and the router (and buffers)."""
    return spec.part == "layer" and not spec.buffer and len(spec.shape) >= 2 and not spec.name.endswith("router.weight")


def ns_flops(rows: int, cols: int, steps: int) -> float:
    """Multiply-add flops (x2) of `steps` Newton-Schulz iterations on a rows x cols matrix: with
    m <= n its sides, X X^T (2 m^2 n), A A (2 m^3) and B X (2 m^2 n) per iteration."""
    m, n = sorted((rows, cols))
    return steps * (4.0 * m * m * n + 2.0 * m ** 3)


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
    def at(cls, layout: Layout, index: int) -> "Member":
        rest, tp = divmod(index, layout.tp)
        rest, cp = divmod(rest, layout.cp)
        replicate, shard = divmod(rest, layout.dp_shard)
        dp_cp = (replicate * layout.dp_shard + shard) * layout.cp + cp
        return cls(index, replicate, shard, cp, tp, dp_cp, shard * layout.cp + cp, dp_cp % layout.ep,
                   dp_cp // layout.ep)

    def data_rank(self, layout: Layout) -> DataRank:
        L = layout
        return DataRank(L.zero, L.pp, L.ep, L.dp * L.cp, L.dp_shard * L.cp, self.shard_cp, self.replicate, self.dp_cp)

    def distance(self, other: "Member") -> int:
        return sum(a != b for a, b in ((self.replicate, other.replicate), (self.shard, other.shard),
                                      (self.cp, other.cp), (self.tp, other.tp)))


def flat_layout(specs: list[TensorSpec], layout: Layout, dtype: str) -> FlatLayout | None:
    """The stage's flat buffer as `fived.parallel.zero` lays it out (None: the layout keeps none)."""
    L = layout
    if not keeps_flat_buffer(L.zero, L.pp, L.dp * L.cp):
        return None
    flat = [s for s in specs if in_flat_buffer(s, L.ep)]
    return FlatLayout([s.name for s in flat], [math.prod(s.local_shape) for s in flat],
                      1 if L.zero == 0 else L.dp_shard * L.cp, L.bucket_elements(PRECISION_SPECS[dtype].weight_bytes))


def member_placement(spec: TensorSpec, layout: Layout, member: Member, flat: FlatLayout | None) -> Placement:
    """Where `member` stores its piece of `spec` for the optimizer: the storage rules the runtime's
    data-parallel strategies apply (`fived.layout.spec.DataRank`)."""
    local = Box(*spec.local_box(tp_rank=member.tp, ep_rank=member.ep))
    stored = member.data_rank(layout).stored(spec, flat)
    return Placement(spec.shape, local, spec.tp_replica(member.tp) + layout.tp * stored.replica, stored.rows,
                     stored.flat)


@dataclass(frozen=True)
class Exchange:
    """One member's lists, each item (unit index, box of the whole tensor), per peer member: what it
    sends and receives in the gather (pieces to owners) and the scatter (results to holders)."""

    gather_send: tuple
    gather_recv: tuple
    scatter_send: tuple
    scatter_recv: tuple

    @staticmethod
    def elements(lists) -> int:
        return sum(box.numel for items in lists for _, box in items)


class StagePlan:
    """Muon's units on one pipeline rank's stage group (its `chunks`), their owners, and which
    pieces of each unit every member holds (`member_placement`)."""

    def __init__(self, m: ModelConfig, layout: Layout, dtype: str, chunks):
        L = layout
        self.layout, self.size = L, L.dp * L.cp * L.tp
        self.members = [Member.at(L, i) for i in range(self.size)]
        specs = [s for layers, first, last in chunks
                 for s in chunk_specs(m, layers, first, last, tp=L.tp, ep=L.ep, sp=L.sp)]
        flat = flat_layout(specs, L, dtype)
        self.specs = [s for s in specs if is_muon_tensor(s)]
        self.names = [s.name for s in self.specs]
        self.placements = [{s.name: member_placement(s, L, member, flat) for s in self.specs} for member in self.members]
        self.units = self._assign(self._units())
        self._boxes = [{name: p.boxes() for name, p in placed.items()} for placed in self.placements]
        self._exchanges: dict[int, Exchange] = {}

    def _units(self) -> list[tuple]:
        """(name, expert, box, rows, cols, candidate owners) of every matrix, in model order: a routed
        expert under ep > 1 goes to a member of its own ep rank (which holds it), any other to any."""
        out, everyone = [], list(range(self.size))
        for s in self.specs:
            if not s.expert:
                out.append((s.name, -1, Box((0, 0), s.shape), s.shape[0], s.shape[1], everyone))
                continue
            per_rank = s.shape[0] // self.layout.ep  # [E, in, out]: one matrix per expert, E/ep per ep rank
            for j in range(s.shape[0]):
                holders = [m.index for m in self.members if m.ep == j // per_rank] if self.layout.ep > 1 else everyone
                out.append((s.name, j, Box((j, 0, 0), (1,) + s.shape[1:]), s.shape[1], s.shape[2], holders))
        return out

    def _assign(self, units: list[tuple]) -> list[Unit]:
        """Owners by Newton-Schulz cost: longest first (model order on ties), each to its least-loaded
        candidate (the lowest on ties)."""
        self.load = [0.0] * self.size
        owners = [0] * len(units)
        for i in sorted(range(len(units)), key=lambda i: -ns_flops(units[i][3], units[i][4], 1)):
            *_, rows, cols, candidates = units[i]
            owners[i] = min(candidates, key=lambda c: (self.load[c], c))
            self.load[owners[i]] += ns_flops(rows, cols, 1)
        return [Unit(*u[:5], owner) for u, owner in zip(units, owners)]

    def held(self, unit: Unit, member: int) -> list[Box]:
        """The boxes of `unit` (whole-tensor coordinates) `member` stores, in its placement's order."""
        return [b for b in (box.intersection(unit.box) for box in self._boxes[member][unit.name]) if b is not None]

    @cached_property
    def pieces(self) -> list[list[tuple[Box, list[int]]]]:
        """Per unit, each distinct piece with the members holding it (replicas hold equal boxes)."""
        out = []
        for unit in self.units:
            held: dict[Box, list[int]] = {}
            for member in range(self.size):
                for box in self.held(unit, member):
                    held.setdefault(box, []).append(member)
            out.append(list(held.items()))
        return out

    def sender(self, holders: list[int], owner: int) -> int:
        """Who sends a piece the owner lacks: the holder nearest it on the mesh, then the lowest."""
        me = self.members[owner]
        return min(holders, key=lambda h: (self.members[h].distance(me), h))

    @cached_property
    def traffic(self) -> tuple[bool, bool]:
        """(any piece gathered, any result scattered): a phase nobody sends in is skipped by all."""
        gather = scatter = False
        for unit, pieces in zip(self.units, self.pieces):
            for _, holders in pieces:
                gather = gather or unit.owner not in holders
                scatter = scatter or any(h != unit.owner for h in holders)
        return gather, scatter

    def exchange(self, me: int) -> Exchange:
        """Member `me`'s lists; items ordered by unit, then by the sending member's placement order,
        so that every sender and receiver agree."""
        if me not in self._exchanges:
            self._exchanges[me] = self._exchange(me)
        return self._exchanges[me]

    def _exchange(self, me: int) -> Exchange:
        lists = [[[] for _ in range(self.size)] for _ in range(4)]
        gather_send, gather_recv, scatter_send, scatter_recv = lists
        for u, (unit, pieces) in enumerate(zip(self.units, self.pieces)):
            owner = unit.owner
            for box, holders in pieces:
                if owner in holders or (owner != me and me not in holders):
                    continue
                sender = self.sender(holders, owner)
                if sender == me:
                    gather_send[owner].append((u, box))
                if owner == me:
                    gather_recv[sender].append((u, box))
            if owner == me:
                for member in range(self.size):
                    if member != me:
                        scatter_send[member] += [(u, box) for box in self.held(unit, member)]
            else:
                scatter_recv[owner] += [(u, box) for box in self.held(unit, me)]
        return Exchange(*(tuple(tuple(items) for items in lst) for lst in lists))

    def stored_elements(self, member: int) -> int:
        """Elements of Muon tensors `member` stores (each gets one momentum buffer)."""
        return sum(math.prod(p.stored_shape) for p in self.placements[member].values())

    def owned(self, member: int) -> list[Unit]:
        return [u for u in self.units if u.owner == member]

    def member_of_shard(self, shard_index: int) -> int:
        """The first member (replica 0, tp rank 0) at position `shard_index` of the dp_shard*cp group."""
        return shard_index * self.layout.tp

    def buffer_elements(self, member: int, *, cast: bool) -> tuple[int, int]:
        """(elements in the Newton-Schulz dtype, elements in the optimizer's dtype) `member` allocates
        for a step, all counted as alive at once: its stored pieces' directions (optimizer dtype),
        their updates and, with `cast` (the two dtypes differ), their copies (Newton-Schulz dtype),
        its owned units' results, the larger phase's send and receive buffers, and the largest owned
        unit's Newton-Schulz workspace (X and the products of its iteration: 3 m n + 3 m^2, m <= n)."""
        stored, owned = self.stored_elements(member), self.owned(member)
        lists = self.exchange(member)
        exchanged = max(Exchange.elements(lists.gather_send) + Exchange.elements(lists.gather_recv),
                        Exchange.elements(lists.scatter_send) + Exchange.elements(lists.scatter_recv))
        workspace = max((3 * u.rows * u.cols + 3 * min(u.rows, u.cols) ** 2 for u in owned), default=0)
        return (1 + cast) * stored + sum(u.box.numel for u in owned) + exchanged + workspace, stored


@lru_cache(maxsize=256)
def _stage_plan(key: tuple, layout: Layout, dtype: str, chunks: tuple) -> StagePlan:
    return StagePlan(ModelConfig(**dict(key)), layout, dtype, chunks)


def stage_plan(m: ModelConfig, layout: Layout, dtype: str, chunks) -> StagePlan:
    """The plan of the stage group holding `chunks` [(layers, first, last)] (cached: the planner asks
    again for every layout that differs only in activation choices)."""
    chunks = tuple((tuple(layers), first, last) for layers, first, last in chunks)
    return _stage_plan(model_key(m), layout.with_(micro_batch=1, checkpointing="none"), dtype, chunks)
