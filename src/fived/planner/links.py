"""The links a group's collectives run on and the seconds they take there (`fived.planner.timing`'s
communication terms), and a step's collectives priced in two halves, each memoised on the layout fields it
reads (`fived.planner.communication.DATA_PARALLEL_FIELDS`, `MODEL_PARALLEL_FIELDS`): a search prices each
mesh under every ZeRO stage and HSDP, each data-parallel layout under every recomputation. A memo computes
from the layout (and runtime) with the other half's fields at their defaults, so that an entry is a
function of its key; `step_time` uses them only with the shipped constants (a calibration fit's constants
record which fields a figure read, and a memo key would read them all).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from fived.layout.layout import Layout
from fived.layout.stages import model_of, rank_chunks, rank_stages
from fived.planner.communication import (
    data_parallel_collectives,
    data_parallel_layout,
    data_parallel_values,
    group_spans,
    model_parallel_collectives,
    model_parallel_layout,
    model_parallel_values,
)
from fived.planner.constants import Constants
from fived.planner.hardware import Cluster, Hardware
from fived.planner.layout_cache import layout_memo
from fived.planner.runtimes import Runtime


def in_node(gpus_per_node: int, stride: int, size: int) -> bool:
    """A mesh group of `size` ranks `stride` apart lies inside one node."""
    span = stride * size
    return span <= gpus_per_node and gpus_per_node % span == 0


_RING = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather_single": lambda n: (n - 1) / n,
    "reduce_scatter_single": lambda n: (n - 1) / n,
    "all_to_all_single": lambda n: (n - 1) / n,
    "send": lambda n: 1.0,
}


@dataclass(frozen=True)
class Link:
    """What a group's collectives run on: `size` ranks, `per_node` of them in each node they span."""

    size: int
    per_node: int
    nvlink: float  # bytes/s per GPU inside a node (times link_efficiency)
    network: float  # bytes/s of each GPU's own NIC (times link_efficiency)
    latency: float  # per collective call

    @property
    def crosses(self) -> bool:
        return self.per_node < self.size

    def ring(self, c: Constants) -> float:
        """Bytes/s a ring collective moves per rank: NVLink inside a node; across nodes NCCL runs
        rings over several NICs, so a group with k ranks in each node reaches up to k NICs' worth —
        `c.cross_node_rails` of them at most (fitted: congestion and rail alignment decide how many
        pay off), and never more than NVLink."""
        if not self.crosses:
            return self.nvlink
        return min(self.nvlink, min(self.per_node, c.cross_node_rails) * self.network)


def members_per_node(gpus_per_node: int, stride: int, size: int) -> int:
    """How many ranks of a group of `size` ranks `stride` apart share each node."""
    if in_node(gpus_per_node, stride, size):
        return size
    return max(1, min(size, gpus_per_node // stride)) if stride < gpus_per_node else 1


def group_link(cluster: Cluster, stride: int, size: int, c: Constants) -> Link:
    """The link of a group of `size` ranks `stride` apart (NVLink inside a node, NICs across)."""
    hw = cluster.hardware
    k = size if size == 1 else members_per_node(cluster.gpus_per_node, stride, size)
    return Link(
        size,
        k,
        hw.nvlink_gbps * 1e9 * c.link_efficiency,
        hw.network_gbps * 1e9 * c.link_efficiency,
        hw.link_latency_s if k == size else hw.network_latency_s,
    )


def collective_seconds(op: str, nbytes: float, link: Link, hw: Hardware, c: Constants) -> float:
    """One call of a collective moving `nbytes` per rank on `link`: ring collectives (all-reduce
    2(n-1)/n of the bytes, all-gather and reduce-scatter (n-1)/n) at the ring's bandwidth with a
    latency per ring step across nodes; an all-to-all sends (k-1)/n of its bytes over NVLink and
    (n-k)/n over the rank's own NIC at once; a send its bytes once."""
    n = link.size
    if hw.profile and hw.profile.collectives:  # measured here (fived calibrate): the op's time at this group and size
        return hw.profile.collective_s(op, n, nbytes)
    if op == "send":
        return nbytes / (link.network if link.crosses else link.nvlink) + link.latency + hw.peer_latency_s
    steps = _RING[op](n) * n  # ring steps: n-1, 2(n-1) for all-reduce
    if op == "all_to_all_single" and link.crosses:
        k = link.per_node
        transfer = nbytes * max((k - 1) / n / link.nvlink, (n - k) / n / link.network)
    else:
        transfer = _RING[op](n) * nbytes / link.ring(c)
    step_latency = hw.peer_latency_s + (c.ring_step_latency_s if link.crosses else 0.0)
    return transfer + link.latency + steps * step_latency


@layout_memo(maxsize=65536, values=model_parallel_values)
def model_parallel_seconds(key: tuple, L: Layout, *rest) -> tuple[dict[str, float], dict[str, float]]:
    """`model_parallel_priced`, the same for every layout equal in all but DATA_PARALLEL_FIELDS: memoised
    on the others (a search prices each mesh under every ZeRO stage and HSDP), computed with those at
    their defaults (and the runtime's: `model_parallel_runtime`), so that an entry is a function of its key."""
    return model_parallel_priced(key, model_parallel_layout(L), *rest)


def model_parallel_priced(
    key: tuple,
    L: Layout,
    cluster: Cluster,
    seq_len: int,
    global_batch: int,
    dtype: str,
    runtime: Runtime,
    c: Constants,
    pp_rank: int,
) -> tuple[dict[str, float], dict[str, float]]:
    """({part: seconds}, {group: bytes}) of pipeline rank `pp_rank`'s model-parallel collectives."""
    m = model_of(key)
    chunks, stages = rank_chunks(m, L, pp_rank), rank_stages(L, pp_rank)
    calls = model_parallel_collectives(m, L, seq_len, global_batch, dtype, chunks, stages, runtime)
    time: dict[str, float] = defaultdict(float)
    moved: dict[str, float] = defaultdict(float)
    price_collectives(calls, L, cluster, c, time, moved)
    return dict(time), dict(moved)


@layout_memo(maxsize=65536, values=data_parallel_values)
def data_parallel_seconds(key: tuple, L: Layout, *rest) -> tuple[list[tuple[str, float, str, float]], float]:
    """`data_parallel_priced`, the same for every layout equal in all but MODEL_PARALLEL_FIELDS:
    memoised on the others, computed with those at their defaults (not for Muon, whose exchange's
    plan reads more: `step_time` asks it unmemoised)."""
    return data_parallel_priced(key, data_parallel_layout(L), *rest)


def data_parallel_priced(
    key: tuple,
    L: Layout,
    cluster: Cluster,
    global_batch: int,
    dtype: str,
    runtime: Runtime,
    c: Constants,
    pp_rank: int,
) -> tuple[list[tuple[str, float, str, float]], float]:
    """([(part, seconds, group, bytes)] of pipeline rank `pp_rank`'s data-parallel collectives in order,
    FSDP2's host seconds for them)."""
    m = model_of(key)
    calls = data_parallel_collectives(m, L, global_batch, dtype, rank_chunks(m, L, pp_rank), runtime)
    host = 0.0  # (per gather / reduce-scatter: CPU ranks do not hide it)
    if L.zero == 3:
        for call in calls:
            if call.part and call.group in ("dp_shard_cp", "edp") and call.op != "all_reduce":
                host += call.calls * cluster.hardware.zero3_overhead_s
    return priced_calls(calls, L, cluster, c), host


def price_collectives(calls, L: Layout, cluster: Cluster, c: Constants, time: dict, moved: dict) -> None:
    """Add each collective's seconds on its group's link to `time` (by part) and bytes to `moved`."""
    for part, seconds, group, nbytes in priced_calls(calls, L, cluster, c):
        time[part] += seconds
        moved[group] += nbytes


def priced_calls(calls, L: Layout, cluster: Cluster, c: Constants) -> list[tuple[str, float, str, float]]:
    """(part, seconds on its group's link, group, bytes) of each collective that a part prices."""
    hw, spans, links, out = cluster.hardware, group_spans(L), {}, []
    for call in calls:
        if not call.part:
            continue
        if call.group not in links:
            size, stride = spans[call.group]
            links[call.group] = group_link(cluster, stride, size, c)
        nbytes = call.nbytes
        if call.sent_only:  # (the rank's own share is not in them: priced as the n/(n-1) a collective passes)
            nbytes *= links[call.group].size / (links[call.group].size - 1)
        out.append(
            (
                call.part,
                call.calls * collective_seconds(call.op, nbytes, links[call.group], hw, c),
                call.group,
                call.total,
            )
        )
    return out
