"""Every collective one rank issues in one training step, by formula: the one model of the runtime's
communication. `fived train --report` prints its bytes next to the ledger's (`ledger_bytes`), the
planner prices the same list on the links the groups use (`fived.planner.timing`).

Conventions (the ledger's): a collective's bytes are its full tensor — a reduce-scatter's input, an
all-gather's output, an all-to-all's input, a send's tensor. Groups are logical (GROUPS); the ledger
names a group by the first of `fived.layout.layout.GROUP_NAMES` with the same ranks (dp_cp is "dp" without
context parallelism). B = tokens of one micro-batch on the rank (micro_batch * seq_len / cp), h =
dim, e = the matmul dtype's bytes, w = the residual stream's (float32 in fived's bf16 runs), r = the
gradient reduction's, g = the parameter gathers'. Per micro-batch unless said, times 2 for forward
collectives when full checkpointing recomputes the forward:

  tp   per layer 2 regions. Without SP: an all-reduce of each region's output (B h e) and, in
       backward, of each region input's gradient (B h w); with SP: all-gather of the input (w) and
       reduce-scatter of the output (e) forward, all-gather of the output's gradient (e) and
       reduce-scatter of the input's gradient (w) backward, plus a backward re-gather of the inputs
       (fived outside bf16 — bf16 linears keep their gathered copy — and Megatron). Full (and fived's
       selective) checkpointing recomputes every entry but only the attention region's exit (early stop). With
       tp_overlap (fived) attention and dense MLP regions move the same bytes point to point around the
       tp ring (tp-1 sends and receives of 1/tp each: the input and the output forward, the output's
       gradient backward; all exits again when recomputed), their backward re-gather always; without SP
       their output's all-reduce goes in tp chunks of tokens. The embedding's
       exit and the head's entry are a region boundary each; the vocab-parallel loss all-reduces 3
       values per token. Per step: the gradients summed over tp, one all-reduce per tensor the
       sharding spec marks (`TensorSpec.tp_summed`: routers, q/k-norm weights, norm gains with SP,
       whole experts folded over tp, replicated kv heads' slots) and the clipping norm's 8 bytes.
  cp   per layer, the ring: forward cp-1 hops of K, V (and positions where blocks are masked:
       fived's int64 order keys with document masking), backward cp-1 hops of K, V, dK, dV (keys)
       and a last hop of dK, dV home (fived keeps dK, dV in at least float32). Ulysses (cp_mode
       ulysses over cp, hybrid over cp_ulysses): per layer an all-to-all of each of q, k, v and the
       output forward, of their gradients backward (kv heads repeated up to u when fewer), and an
       all-gather of the tokens' order keys; hybrid then rings over cp_ring with u times the tokens
       and a u-th of the heads. A windowed layer (fived) moves its halo instead of the ring
       (`fived.layout.cp_chunks.busiest_halo`; its keys all-gathered with document masking).
       Per MoE layer the sequence's routing statistics summed over cp.
  ep   per MoE layer: the per-expert counts (int64), dispatch (w) and combine (e) forward, their
       gradients backward; B*top_k routing slots (dropless, balanced). With ep_overlap each of these
       four exchanges runs as EP_OVERLAP_CHUNKS calls carrying a share each (same bytes, more calls).
  pp   per micro-batch and stage boundary: the activations (B h w, B/tp with SP) forward and their
       gradient backward, unless both stages sit on this rank (V-shaped schedules); the norm's 8 bytes.
  dp   per step (gradient accumulation reduces once): ZeRO-0 all-reduces every gradient (DDP's
       buckets; one flat buffer under pipelines); ZeRO-1/2 reduce-scatter and all-gather one flat
       buffer padded to a multiple of S = dp_shard*cp; ZeRO-3 (FSDP2) gathers every parameter
       (rows padded to a multiple of S) per micro-batch for forward and the blocks again for
       backward (once per step when kept gathered: pipelines, zero3_keep_gathered), reduce-scatters
       once; HSDP all-reduces the shard over replicas. Experts (ep > 1) are reduced over edp: an
       all-reduce (ZeRO-0/1/2) or FSDP2 over edp (ZeRO-3). The clipping norm's 8 bytes per group.
  dp_cp_tp  train.optimizer=muon: per step and bucket of matrices, the pieces of whole matrices this
       rank sends to their owners, then the orthogonalised results it sends back to their other
       holders (two all-to-alls over the pipeline stage's ranks, `fived.layout.muon_plan`; priced as
       optimizer time).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from operator import attrgetter
from typing import Any

from fived.config import ModelConfig
from fived.layout.cp_chunks import busiest_halo, chunks_per_rank
from fived.layout.layout import EP_OVERLAP_CHUNKS, MESH_FIELDS, PRECISION_SPECS, Layout
from fived.layout.muon_load import busiest_loads
from fived.layout.muon_plan import Exchange, stage_plan
from fived.layout.spec import chunk_specs, kv_width
from fived.layout.stages import model_key, model_of, stage_rank
from fived.planner.memory import (
    ACTIVATION_BYTES,
    WEIGHT_BYTES,
    flat_cut,
    flat_numels,
    moe_layer_count,
    rank_parameters,
)
from fived.planner.runtimes import FIVED, Runtime, reduces_every_microbatch

GROUPS = ("tp", "cp", "ep", "edp", "pp", "dp_cp", "dp_shard_cp", "dp_replicate", "dp_cp_tp", "cp_ulysses", "cp_ring")
NORM = 8  # the clipping norm: one float64 per group


@dataclass(frozen=True)
class Collective:
    group: str  # one of GROUPS
    op: str  # the ledger's name: all_reduce, all_gather_single, reduce_scatter_single, all_to_all_single, send, recv
    nbytes: float  # per call
    calls: float  # per step
    part: str  # the step-time part that prices it (tp, cp, ep, pp, dp, dp_gather), "" for none (a recv)
    sent_only: bool = False  # the bytes leave out the rank's own share (Muon's exchange): no (n-1)/n of them

    @property
    def total(self) -> float:
        return self.nbytes * self.calls


def group_span(layout: Layout, group: str) -> tuple[int, int]:
    """(ranks in the group, their distance on the mesh): `Layout.span`, the mesh's order; a pipeline
    rank's point-to-point partners are 2 ranks a stage's ranks apart."""
    size, stride = layout.span(group)
    return (2, stride) if group == "pp" else (size, stride)


def group_spans(layout: Layout) -> dict[str, tuple[int, int]]:
    """`group_span` of every group in GROUPS at once (cached by the mesh: the search asks for each layout's)."""
    return _group_spans(layout.mesh_key)


@lru_cache(maxsize=16384)
def _group_spans(mesh_key: tuple) -> dict[str, tuple[int, int]]:
    layout = Layout(**dict(zip(MESH_FIELDS, mesh_key)))
    return {group: group_span(layout, group) for group in GROUPS}


# The layout fields only the data-parallel collectives (and Muon's exchange) read: ZeRO, HSDP, the
# buckets, the optimizer. Layouts equal in every other field issue the same model-parallel collectives
# (`model_parallel_collectives`), which the planner's caches key on (`model_parallel_values`).
DATA_PARALLEL_FIELDS = frozenset(
    {
        "zero",
        "dp_replicate",
        "reduce_dtype",
        "zero3_keep_gathered",
        "overlap_grad_reduce",
        "overlap_param_gather",
        "zero2_reduce_every_microbatch",
        "bucket_mb",
        "optimizer",
        "muon_bucket_mb",
        "muon_ns_steps",
    }
)
model_parallel_values = attrgetter(*(f.name for f in fields(Layout) if f.name not in DATA_PARALLEL_FIELDS))
_DATA_PARALLEL_DEFAULTS = {f.name: f.default for f in fields(Layout) if f.name in DATA_PARALLEL_FIELDS}
# the runtime's switches only its data-parallel reductions read (and the bytes they move)
DATA_PARALLEL_RUNTIME: dict[str, Any] = {
    f.name: f.default
    for f in fields(Runtime)
    if f.name
    in (
        "grad_overlap",
        "zero12_overlap",
        "pipeline_grad_overlap",
        "reduce_per_microbatch",
        "expert_grad_overlap",
        "reduce_bytes",
        "gather_bytes",
    )
}


# The layout fields only the model-parallel collectives read (sequence parallelism, recomputation, the
# tp and ep overlaps, how cp splits): layouts equal in every other field issue the same data-parallel
# collectives (`data_parallel_collectives` but Muon's exchange), which the step time's cache keys on.
MODEL_PARALLEL_FIELDS = frozenset(
    {"sp", "checkpointing", "tp_overlap", "ep_overlap", "cp_mode", "cp_ulysses", "cp_balance", "document_mask"}
)
data_parallel_values = attrgetter(*(f.name for f in fields(Layout) if f.name not in MODEL_PARALLEL_FIELDS))
_MODEL_PARALLEL_DEFAULTS = {f.name: f.default for f in fields(Layout) if f.name in MODEL_PARALLEL_FIELDS}


def data_parallel_layout(layout: Layout) -> Layout:
    """`layout` with MODEL_PARALLEL_FIELDS at their defaults (as `model_parallel_layout`)."""
    return layout.with_(**_MODEL_PARALLEL_DEFAULTS)


def model_parallel_layout(layout: Layout) -> Layout:
    """`layout` with DATA_PARALLEL_FIELDS at their defaults: what a cache of model-parallel figures
    keyed on `model_parallel_values` computes from (so an entry is a function of its key)."""
    return layout.with_(**_DATA_PARALLEL_DEFAULTS)


@lru_cache(maxsize=256)
def model_parallel_runtime(runtime: Runtime) -> Runtime:
    """`runtime` with DATA_PARALLEL_RUNTIME's switches at their defaults (see `model_parallel_layout`)."""
    return replace(runtime, **DATA_PARALLEL_RUNTIME)


def step_collectives(
    m: ModelConfig,
    layout: Layout,
    seq_len: int,
    global_batch: int,
    dtype: str,
    chunks,
    stages=(),
    runtime: Runtime = FIVED,
    *,
    member: int | None = None,
) -> list[Collective]:
    """The collectives of one step on a rank holding `chunks` [(layers, first, last)] — pipeline
    stages `stages` (their indices, to know which boundaries leave the rank) — at position `member`
    of its stage's dp*cp*tp ranks (only Muon's exchange differs between them; None: its busiest):
    the model-parallel ones, then the data-parallel ones."""
    return model_parallel_collectives(m, layout, seq_len, global_batch, dtype, chunks, stages, runtime) + (
        data_parallel_collectives(m, layout, global_batch, dtype, chunks, runtime, member=member)
    )


def _adder(out: list, layout: Layout):
    """add(group, op, bytes, calls, part): a Collective appended to `out` if it moves anything."""
    sizes = {g: size for g, (size, _) in group_spans(layout).items()}

    def add(group, op, nbytes, calls, part):
        if sizes[group] > 1 and nbytes > 0 and calls > 0:
            out.append(Collective(group, op, nbytes, calls, part))

    return add, sizes


def model_parallel_collectives(
    m: ModelConfig,
    layout: Layout,
    seq_len: int,
    global_batch: int,
    dtype: str,
    chunks,
    stages=(),
    runtime: Runtime = FIVED,
) -> list[Collective]:
    """`step_collectives`' tp, ep, cp and pp collectives: they read no field in DATA_PARALLEL_FIELDS."""
    out: list[Collective] = []
    add, _ = _adder(out, layout)
    L = layout
    micro = L.microbatches(global_batch)
    tokens = L.micro_batch * seq_len // L.cp
    e = ACTIVATION_BYTES[dtype]
    w = runtime.residual_bytes or WEIGHT_BYTES[dtype]
    fwd = 2 if L.checkpointing == "full" else 1
    layers = sum(len(c[0]) for c in chunks)
    moe_layers = sum(moe_layer_count(m, c[0]) for c in chunks)
    first, last = any(c[1] for c in chunks), any(c[2] for c in chunks)
    grad_w = runtime.grad_bytes or WEIGHT_BYTES[dtype]
    if L.tp > 1:
        # fived's selective checkpointing recomputes a block (GEMM outputs cached) and its tp collectives
        rec = 2 if L.checkpointing == "full" or (L.checkpointing == "selective" and runtime.is_fived) else 1
        _tensor_parallel(
            add,
            m,
            L,
            chunks,
            tokens,
            e,
            w,
            grad_w,
            micro,
            rec,
            layers,
            moe_layers,
            first,
            last,
            regather=not (runtime.is_fived and PRECISION_SPECS[dtype].autocast),
            overlap=L.tp_overlap and runtime.is_fived,
        )
    if L.ep > 1 and moe_layers:  # dispatch (w) and combine (e), again when recomputed, and their gradients
        slots = tokens * m.top_k * L.expert_tp // L.tp
        add("ep", "all_to_all_single", 8 * m.n_experts, fwd * moe_layers * micro, "ep")  # tokens per expert
        n = EP_OVERLAP_CHUNKS if L.ep_overlap else 1  # (overlapped: each exchange in n chunks, same bytes)
        add("ep", "all_to_all_single", slots * m.dim * w / n, n * (fwd + 1) * moe_layers * micro, "ep")
        add("ep", "all_to_all_single", slots * m.dim * e / n, n * (fwd + 1) * moe_layers * micro, "ep")
    if L.cp > 1:
        windows = [m.layer_window(i) if i < m.n_layers else 0 for c in chunks for i in c[0]]
        _context_parallel(add, m, L, seq_len, e, fwd, windows, micro, runtime)
        # MoE load-balancing statistics summed over the sequence's cp ranks: [b, 2E+1] per layer
        add("cp", "all_reduce", L.micro_batch * (2 * m.n_experts + 1) * max(e, 4), fwd * moe_layers * micro, "cp")
    if L.pp > 1:
        _pipeline(add, m, L, tokens, w, micro, stages)
    return out


def data_parallel_collectives(
    m: ModelConfig,
    layout: Layout,
    global_batch: int,
    dtype: str,
    chunks,
    runtime: Runtime = FIVED,
    *,
    member: int | None = None,
) -> list[Collective]:
    """`step_collectives`' gradient reductions and parameter gathers, and Muon's exchange."""
    out: list[Collective] = []
    add, sizes = _adder(out, layout)
    _data_parallel(add, m, layout, chunks, layout.microbatches(global_batch), dtype, runtime)
    if layout.optimizer == "muon" and runtime.is_fived and sizes["dp_cp_tp"] > 1:
        out += _muon_exchange(m, layout, dtype, chunks, member)
    return out


def _context_parallel(add, m, L, seq_len, e, fwd, windows, micro, runtime) -> None:
    """Ulysses' all-to-alls inside groups of u = L.ulysses ranks, then the ring across cp/u of them
    (ring mode: u = 1; ulysses: the whole cp group; hybrid: cp_ulysses ranks, cp_ring across);
    fived's windowed layers exchange their halo instead of the ring (`windows`: each layer's)."""
    u, tokens, layers = L.ulysses, L.micro_batch * seq_len // L.cp, len(windows)
    halos = [w for w in windows if w and runtime.is_fived and L.cp > u]
    kv_heads = kv_width(m, L.tp) // m.head_dim
    # fived's order keys (document << 32 | position, int64) travel where blocks are masked
    keys = 8 * tokens if runtime.is_fived and (L.document_mask or u > 1) else 0
    if u > 1:  # q, k, v and the output, forward and (their gradients) backward; keys gathered forward
        group = "cp" if u == L.cp else "cp_ulysses"
        kv_heads = kv_heads if kv_heads % u == 0 else u  # (kv heads repeated up to u)
        a2a = tokens * m.head_dim * e * (2 * m.n_heads // L.tp + 2 * kv_heads)
        add(group, "all_to_all_single", a2a / 4, 4 * (fwd + 1) * layers * micro, "cp_a2a")
        add(group, "all_gather_single", u * keys, fwd * layers * micro, "cp_a2a")
        tokens, kv_heads = u * tokens, kv_heads // u
    ranks = L.cp // u
    if ranks == 1:
        return
    ring = e if runtime.flash_ring else max(e, 4)
    kv = tokens * kv_heads * m.head_dim * ring
    dkv = kv * max(ring, 4) // ring if runtime.is_fived else kv  # fived accumulates dK, dV in >= fp32
    # (a layer with sinks runs the masked ring too: keys travel)
    ring_keys = keys or (8 * tokens if runtime.is_fived and m.attention_sinks else 0)
    positions = (ring_keys * u) if runtime.flash_ring else 8 * seq_len // L.cp
    per_layer = fwd * (ranks - 1) * (2 * kv + positions) + (ranks - 1) * (2 * kv + 2 * dkv + positions) + 2 * dkv
    hops = fwd * (ranks - 1) + ranks
    group = "cp" if u == 1 else "cp_ring"
    add(group, "send", per_layer / hops, hops * (layers - len(halos)) * micro, "cp")
    add(group, "recv", per_layer / hops, hops * (layers - len(halos)) * micro, "")
    for window, count in Counter(halos).items():  # (the member sending the most; a bound with documents)
        balance = chunks_per_rank(seq_len, L.cp, L.cp_balance) if L.document_mask else 0
        sent, received = busiest_halo(seq_len, L.cp, window, u, balance, kv // tokens, dkv // tokens, fwd)
        add(group, "send", L.micro_batch * sent / (fwd + 1), (fwd + 1) * count * micro, "cp")
        add(group, "recv", L.micro_batch * received / (fwd + 1), (fwd + 1) * count * micro, "")
        add(group, "all_gather_single", ranks * keys * u, fwd * count * micro, "cp")  # (document masking)


def _muon_exchange(m: ModelConfig, L: Layout, dtype: str, chunks, member: int | None) -> list[Collective]:
    """Muon's all-to-alls over the stage (`fived.layout.muon_plan`), two per bucket, in the compute dtype:
    the pieces `member` sends to their owners, then the results it sends their other holders (member
    None: the busiest member's bound, `fived.layout.muon_load.busiest_loads`, what each call waits for). A
    phase in which no rank sends is skipped by all; one in which only this rank sends nothing still
    calls."""
    plan = stage_plan(m, L, dtype, chunks)
    if member is None:
        sent = [(max(x.gather_send, x.gather_recv), max(x.scatter_send, x.scatter_recv)) for x in busiest_loads(plan)]
    else:
        sent = [
            (Exchange.elements(x.gather_send), Exchange.elements(x.scatter_send))
            for x in plan.member_plan(member).exchanges
        ]
    out = []
    for phase in (0, 1):
        active = [n[phase] for n, on in zip(sent, plan.traffic) if on[phase]]
        if active:
            out.append(
                Collective(
                    "dp_cp_tp",
                    "all_to_all_single",
                    sum(active) * ACTIVATION_BYTES[dtype] / len(active),
                    len(active),
                    "optimizer",
                    sent_only=True,
                )
            )
    return out


def _tensor_parallel(
    add, m, L, chunks, tokens, e, w, grad_w, micro, fwd, layers, moe_layers, first, last, regather, overlap
):
    narrow, wide = tokens * m.dim * e, tokens * m.dim * w
    # folded (etp 1): a MoE block is no region, its shared experts (a dense MLP) are one of their own
    unfolded = 0 if L.folded else moe_layers
    regions = 2 * layers - (moe_layers if L.folded and not m.n_shared_experts else 0)
    ends = int(first) + int(last)
    # tp_overlap: attention and dense MLP regions are `fived.parallel.tensor_overlap`'s, MoE ones plain
    ring = (regions - unfolded) if overlap else 0
    plain = regions - ring
    # a recomputed block stops once it has rebuilt what backward needs (torch's early stop): every
    # region's entry again, but only the attention region's exit (the MLP's output is not saved);
    # an overlapped region's exit is inside the function that saves its input: it runs again
    exits = plain + (fwd - 1) * (0 if overlap else layers)
    if L.sp:
        # backward re-gathers the inputs SP did not keep (a recomputed block gathered them again);
        # an overlapped region keeps its input's shard and always gathers it in backward
        again = (plain if fwd == 1 else 0) + last if regather else 0
        add("tp", "all_gather_single", wide, micro * (fwd * plain + ends + again + ring), "tp")
        add("tp", "all_gather_single", narrow, micro * plain, "tp")
        add("tp", "reduce_scatter_single", narrow, micro * exits, "tp")
        add("tp", "reduce_scatter_single", wide, micro * (regions + ends), "tp")
        # the rings: tp-1 hops of a 1/tp chunk; the input forward, the output forward and its gradient
        # backward (the bytes of the all-gather / reduce-scatter they replace)
        hops = micro * (L.tp - 1)
        for nbytes, calls in ((wide / L.tp, fwd * ring), (narrow / L.tp, fwd * ring + ring)):
            add("tp", "send", nbytes, hops * calls, "tp")
            add("tp", "recv", nbytes, hops * calls, "")
    else:
        add("tp", "all_reduce", narrow, micro * exits, "tp")
        add("tp", "all_reduce", narrow / L.tp, micro * fwd * ring * L.tp, "tp")  # in tp chunks of tokens
        add("tp", "all_reduce", wide, micro * (regions + ends), "tp")
    add("tp", "all_reduce", tokens * max(e, 4), micro * 3 * last, "tp")  # the loss: max, sum of exp, target
    if L.folded:  # each tp rank routed its own tokens: the per-sequence statistics [b, 2E+1] summed
        add("tp", "all_reduce", L.micro_batch * (2 * m.n_experts + 1) * max(e, 4), fwd * moe_layers * micro, "tp")
    # per step, the gradients summed over tp, one all-reduce per tensor, as the sharding spec lists
    # them (`TensorSpec.tp_summed`: norm gains under SP, q/k-norm weights, routers, folded whole
    # experts, replicated kv heads' slots)
    for elements, calls in tp_gradient_sums(m, L, chunks).items():
        add("tp", "all_reduce", elements * grad_w, calls, "dp")
    add("tp", "all_reduce", NORM, 1, "dp")


def tp_gradient_sums(m: ModelConfig, layout: Layout, chunks) -> dict[int, int]:
    """{elements: all-reduces} of the gradients summed over tp on a rank holding `chunks`
    [(layers, first, last)], read from the sharding spec (`TensorSpec.tp_summed`)."""
    out: dict[int, int] = {}
    L = layout
    for layers, first, last in chunks:
        for n, k in _tp_sums(model_key(m), L.tp, L.ep, L.sp, L.etp, tuple(layers), first, last):
            out[n] = out.get(n, 0) + k
    return out


@lru_cache(maxsize=4096)
def _tp_sums(key: tuple, tp: int, ep: int, sp: bool, etp: int, layers: tuple, first: bool, last: bool):
    specs = chunk_specs(model_of(key), layers, first, last, tp=tp, ep=ep, sp=sp, etp=etp)
    return tuple(Counter(s.tp_summed for s in specs if s.tp_summed and not s.buffer).items())


def _pipeline(add, m, L, tokens, w, micro, stages) -> None:
    boundary = tokens // (L.tp if L.sp else 1) * m.dim * w
    here = stage_rank(stages[0], L.pp, L.pp_schedule) if stages else 0
    away = [s for s in range(L.n_stages) if stage_rank(s, L.pp, L.pp_schedule) != here]
    sends = sum(int(s + 1 in away) + int(s - 1 in away) for s in stages)  # activations on, gradients back
    recvs = sum(int(s - 1 in away) + int(s + 1 in away and s + 1 < L.n_stages) for s in stages)
    add("pp", "send", boundary, micro * sends, "pp")
    add("pp", "recv", boundary, micro * recvs, "")
    add("pp", "all_reduce", NORM, 1, "dp")


def reduce_bytes(dtype: str, reduce_dtype: str) -> int:
    """Bytes per gradient element fived reduces: bf16 runs (both modes) in parallel.reduce_dtype,
    others in their weights' dtype."""
    return ACTIVATION_BYTES[reduce_dtype] if ACTIVATION_BYTES[dtype] == 2 else WEIGHT_BYTES[dtype]


def _padded(shapes, shards: int) -> int:
    """Elements of `shapes` with each first dimension padded to a multiple of `shards` (FSDP2)."""
    return sum(math.ceil(r / shards) * shards * c * k for (r, c), k in shapes)


def _data_parallel(add, m: ModelConfig, L: Layout, chunks, micro: int, dtype: str, runtime: Runtime) -> None:
    params = rank_parameters(m, L, chunks)
    dense, expert, ends = params.dense, params.expert, params.ends
    n, n_exp = params.dense_elements, params.expert_elements
    shards = L.shards
    r = runtime.reduce_bytes or reduce_bytes(dtype, L.reduce_dtype)
    cap = L.bucket_elements(WEIGHT_BYTES[dtype])  # (None: one flat buffer, nothing overlapped)
    if L.zero == 0:  # DDP's buckets, or one flat buffer under pipelines (buckets with overlap)
        if L.pp > 1:
            buckets = len(flat_cut(flat_numels(m, L, chunks), 1, cap))
        else:
            buckets = max(1, math.ceil(n * WEIGHT_BYTES[dtype] / (L.bucket_mb * 2**20)))
        add("dp_cp", "all_reduce", n * r / buckets, buckets, "dp")
    elif L.zero in (1, 2):
        cut = flat_cut(flat_numels(m, L, chunks), shards, cap) if cap else ()
        padded = sum(b.piece for b in cut) * shards if cut else math.ceil(n / shards) * shards
        calls = max(1, len(cut))
        g = runtime.gather_bytes or WEIGHT_BYTES[dtype]
        every = micro if reduces_every_microbatch(runtime, L) else 1
        add("dp_shard_cp", "reduce_scatter_single", padded * r / calls, calls * every, "dp")
        add("dp_shard_cp", "all_gather_single", padded * g / calls, calls, "dp")
        add("dp_replicate", "all_reduce", padded // shards * r / calls, calls, "dp")
        add("dp_shard_cp", "all_reduce", NORM, 1, "dp")
    else:
        g = runtime.gather_bytes or ACTIVATION_BYTES[dtype]  # the compute dtype
        padded, root = _padded(dense, shards), _padded(ends, shards)
        keep = L.zero3_keep_gathered or L.pp > 1
        layers = sum(len(c[0]) for c in chunks)
        modules = layers + len(chunks)  # one collective per block and per chunk's root, each call
        if keep:
            add("dp_shard_cp", "all_gather_single", padded * g / modules, modules, "dp_gather")
        else:  # per micro-batch: everything for forward, the blocks again for backward (the root stays)
            add(
                "dp_shard_cp",
                "all_gather_single",
                (2 * padded - root) * g / (modules + layers),
                micro * (modules + layers),
                "dp_gather",
            )
        add("dp_shard_cp", "reduce_scatter_single", padded * r / modules, modules, "dp")
        add("dp_replicate", "all_reduce", padded // shards * r, 1, "dp")
        add("dp_shard_cp", "all_reduce", NORM, 1, "dp")
        experts = _padded(expert, L.edp)
        add("edp", "all_gather_single", experts * g, 1 if keep else 2 * micro, "dp_gather")
        add("edp", "reduce_scatter_single", experts * r, 1, "dp")
    if L.zero < 3 and n_exp:
        # a runtime whose ZeRO-2 reduces every micro-batch's gradients reduces the experts' with them
        # (sharded gradients leave nowhere to accumulate); fived's go on the last micro-batch only
        per_microbatch = reduces_every_microbatch(runtime, L) and not runtime.is_fived
        add("edp", "all_reduce", n_exp * r, micro if per_microbatch else 1, "dp_expert")
        add("ep", "all_reduce", NORM, 1, "dp")


def owned_parameters(m: ModelConfig, L: Layout, chunks) -> float:
    """Parameters this rank's optimizer steps (AdamW streams 28 bytes per one)."""
    params = rank_parameters(m, L, chunks)
    n, n_exp = params.dense_elements, params.expert_elements
    return (n / L.shards if L.zero else n) + n_exp / (L.edp if L.zero == 3 else 1)


def ledger_bytes(collectives: list[Collective], layout: Layout) -> dict[str, int]:
    """{"<ledger group name>/<op>": bytes} as `fived.parallel.comm.CommRecorder.summary` keys them."""
    out: dict[str, int] = {}
    for c in collectives:
        key = f"{layout.ledger_name(c.group)}/{c.op}"
        out[key] = out.get(key, 0) + round(c.total)
    return out
