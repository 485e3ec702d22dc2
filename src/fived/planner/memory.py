"""Memory per GPU for a layout, by the runtime's own rules (no model is built: the planner evaluates
thousands of layouts of models with hundreds of billions of parameters).

Model state: each rank's parameter shapes follow what the runtime does to them — tensor parallelism
splits attention heads, feed-forward and expert hidden sizes and the (padded) vocabulary, keeps a
whole kv head per rank when tp > n_kv_heads, replicates norms and routers; expert parallelism keeps
E/ep experts; a pipeline rank holds its stages' layers (split by `split_layers`, the runtime's
cost-balanced split), the embedding on the first stage, the final norm and head on the last. Then:
  ZeRO-0     params, grads, Adam's two moments whole                       (16 B/param in fp32)
  ZeRO-1/2   one flat buffer of every non-expert parameter, padded to a multiple of S = dp_shard*cp;
             rank r owns [r*L, (r+1)*L): Adam state (and with ZeRO-2 the reduced gradients) only for
             the real elements of its slice; experts (with ep > 1) kept whole
  ZeRO-3     FSDP2 shards every parameter's first dimension in ceil(dim0/S) rows (experts over
             edp = dp*cp/ep); a rank holds its rows of params, grads and both moments
Bytes per element (`state_element_bytes`): float32 and bfloat16-autocast runs keep float32 weights,
gradients and Adam state (4, 4, 8), float64 runs float64; bfloat16 runs keep bf16 weights and
gradients and, per optimized element, a float32 master and two float32 moments (2, 2, 12: ZeRO-1
2 + 2 + 12/S, ZeRO-2 2 + 14/S) — under ZeRO-3 FSDP2's float32 sharded parameters are the masters
(4, 4, 8: 16/S). With train.optimizer=muon the Muon matrices' elements keep one moment, not two
(`muon_saving`). These equal the ledger's bytes exactly (tests/test_planner.py, tests/test_muon.py).
Other runtimes (the published runs') keep their own bytes per parameter (`fived.planner.runtimes.Runtime`: e.g.
Megatron's bf16 weights, fp32 main gradients, fp32 master weights and Adam in the optimizer).

Activations: bytes saved for backward per micro-batch (`fived.layout.activation_model`; other runtimes:
`fived.planner.runtimes.framework_activations`), times the number of micro-batches a rank's
schedule keeps in flight (`schedule_sim.in_flight_microbatches`).

Transient buffers (peak, not ledger-measured): bf16 copies of the weights autocast caches during a
forward (bfloat16-autocast); the float32 gradients of the masters while the optimizer steps (bfloat16);
the float32 piece of bf16 flat gradients being reduced (REDUCE_CHUNK_ELEMENTS at a time); ZeRO-2's
full gradient buffer during backward (fived allocates it per step); ZeRO-3's
gathered weights (the root module for the whole step and two blocks: the one in use and the
prefetched one; the whole stage under pipelines) and its unsharded gradients while micro-batches
accumulate; DDP's gradient buckets; tensor-parallel gathered activations of one region; the loss's
backward on the last stage: the gradients of its log-probabilities and of its logits, [tokens, vocab]
each in at least float32, beside the log-probabilities it saved (fived's: measured on a CPU rank,
tests/test_memory_peak.py; one for another framework's loss, `Runtime.loss_gradients`); with checkpointing, one block's activations while backward recomputes it
(after the loss's gradients are freed: the last stage's peak is the larger of the two); Muon's
step (`muon_buffers`: its pieces' directions, its owned whole matrices and their
Newton-Schulz workspace, the all-to-alls' buffers); and a fixed reserve for the CUDA context, NCCL and
allocator fragmentation (RESERVE_GIB + RESERVE_FRACTION: assumed, not fitted — no published run reports its peak memory).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from functools import lru_cache
from operator import attrgetter

from fived.config import ModelConfig
from fived.layout.activation_model import blockwise_layer
from fived.layout.layout import PRECISION_SPECS, Layout, masters_apart
from fived.layout.muon_load import busiest_loads
from fived.layout.muon_plan import stage_plan
from fived.layout.schedule_sim import pipeline_profile
from fived.layout.spec import (
    CAST_PIECES_IN_FLIGHT,
    REDUCE_CHUNK_ELEMENTS,
    FlatBucket,
    chunk_specs,
    flat_buckets,
    flat_owned,
    flat_range,
    in_flat_buffer,
    local_vocab,
    shard_rows,
)
from fived.layout.stages import Chunk, model_key, model_of, placement, rank_chunks_by_key
from fived.planner.layout_cache import layout_memo
from fived.planner.runtimes import FIVED, Runtime, framework_activations, reduces_every_microbatch

RESERVE_GIB = 2.0  # CUDA context, NCCL communicators and workspaces
RESERVE_FRACTION = 0.05  # allocator fragmentation, as a share of the device's memory
DDP_BUCKET_BYTES = 2 * 25 * 2**20  # two 25 MiB gradient buckets in flight
# per train.dtype: bytes of an activation (the compute dtype), of a weight and a gradient as the model
# holds them, and of each of Adam's moments (float32 in bf16 runs)
ACTIVATION_BYTES = {name: p.compute_bytes for name, p in PRECISION_SPECS.items()}
WEIGHT_BYTES = {name: p.weight_bytes for name, p in PRECISION_SPECS.items()}
MOMENT_BYTES = {name: max(4, p.weight_bytes) for name, p in PRECISION_SPECS.items()}


def state_element_bytes(dtype: str, zero: int, runtime: Runtime = FIVED) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer) bytes per element a rank holds — the one rule the planner,
    `--report` and the ledger tests share. train.dtype=bfloat16: bf16 weights and gradients, and per
    optimized element a float32 master and two float32 moments (2, 2, 12); under ZeRO-3 the sharded
    float32 parameters are the masters themselves (4, 4, 8). Other runtimes: their own bytes."""
    b, moment = WEIGHT_BYTES[dtype], MOMENT_BYTES[dtype]
    if not runtime.is_fived:
        return runtime.param_bytes or b, runtime.grad_bytes or b, 2 * moment + runtime.master_bytes
    if PRECISION_SPECS[dtype].master and not masters_apart(dtype, zero):
        return 4, 4, 2 * moment  # (ZeRO-3: the float32 sharded parameters are the masters)
    master = 4 if masters_apart(dtype, zero) else 0
    return runtime.param_bytes or b, runtime.grad_bytes or b, 2 * moment + master


def parameter_shapes(m: ModelConfig, tp: int, ep: int, layers, first: bool, last: bool, etp: int = 0):
    """(dense, expert): ((first dimension, elements per row), how many such parameters) for one
    rank's parameters; experts split over `etp` ranks (0: tp, as fived splits them)."""
    n_moe = moe_layer_count(m, layers)
    return _parameter_shapes(model_key(m), tp, ep, len(layers) - n_moe, n_moe, first, last, etp or tp)


@lru_cache(maxsize=65536)
def _parameter_shapes(key: tuple, tp: int, ep: int, n_dense: int, n_moe: int, first: bool, last: bool, etp: int):
    """Aggregated by layer kind: ((rows, cols), count) pairs, so sums over hundreds of layers stay short."""
    m = model_of(key)
    one_dense, _ = _shape_list(m, tp, ep, [m.n_layers - 1] if not m.is_moe else [0], False, False, etp)
    if m.is_moe and m.n_dense_layers == 0:
        one_dense = _shape_list(ModelConfig(**{**dict(key), "n_experts": 0}), tp, ep, [0], False, False, etp)[0]
    one_moe = _shape_list(m, tp, ep, [m.n_layers - 1], False, False, etp) if m.is_moe else ([], [])
    # (the ends: embedding, final norm, head, and the multi-token prediction modules with their experts)
    ends, ends_experts = _shape_list(m, tp, ep, [], first, last, etp)
    dense: dict = {}
    expert: dict = {}
    for shapes, times, box in (
        (one_dense, n_dense, dense),
        (one_moe[0], n_moe, dense),
        (one_moe[1], n_moe, expert),
        (ends, 1, dense),
        (ends_experts, 1, expert),
    ):
        for shape in shapes:
            box[shape] = box.get(shape, 0) + times
    return tuple((s, k) for s, k in dense.items() if k), tuple((s, k) for s, k in expert.items() if k)


@dataclass(frozen=True)
class RankParameters:
    """A rank's parameters as `parameter_shapes` gives them, its chunks' one after another:
    ((rows, elements per row), count) of the dense ones, of the routed experts (apart when ep > 1),
    and of the chunks' ends (embedding, final norm, head), with their element counts."""

    dense: tuple
    expert: tuple
    ends: tuple
    dense_elements: int
    expert_elements: int
    ends_elements: int


def rank_parameters(m: ModelConfig, layout: Layout, chunks) -> RankParameters:
    """The parameters of a rank holding `chunks` [(layers, first, last)] (memoised: every option of a
    layout that keeps its sizes holds the same)."""
    return _rank_parameters(model_key(m), layout.tp, layout.ep, layout.expert_tp, hashable_chunks(chunks))


def hashable_chunks(chunks) -> tuple:
    """`chunks` [(layers, first, last)] as a tuple of tuples (the stages' own chunks already hold
    tuples of layers: one `tuple` call; a caller's lists of layers are converted)."""
    out = tuple(chunks)
    if all(type(c) is tuple and type(c[0]) is tuple for c in out):
        return out
    return tuple((tuple(layers), first, last) for layers, first, last in out)


@lru_cache(maxsize=16384)
def _rank_parameters(key: tuple, tp: int, ep: int, etp: int, chunks: tuple) -> RankParameters:
    m = model_of(key)
    dense: list = []
    expert: list = []
    ends: list = []
    for layers, first, last in chunks:
        dn, ex = parameter_shapes(m, tp, ep, layers, first, last, etp)
        dense += dn
        expert += ex
        ends += parameter_shapes(m, tp, ep, (), first, last, etp)[0]

    def elements(shapes) -> int:
        return sum(r * c * k for (r, c), k in shapes)

    return RankParameters(tuple(dense), tuple(expert), tuple(ends), elements(dense), elements(expert), elements(ends))


def moe_layer_count(m: ModelConfig, layers) -> int:
    """How many of `layers` (layer ids) are MoE layers."""
    return sum(1 for lid in layers if lid >= m.n_dense_layers) if m.is_moe else 0


def flat_numels(m: ModelConfig, layout: Layout, chunks) -> tuple[int, ...]:
    """Elements of each parameter of ZeRO-0/1/2's flat buffer on a rank holding `chunks`, in the
    runtime's order (the sharding spec's): what `fived.layout.spec.flat_buckets` cuts into buckets."""
    return _rank_flat_numels(model_key(m), layout.tp, layout.ep, layout.expert_tp, hashable_chunks(chunks))


@lru_cache(maxsize=16384)
def _rank_flat_numels(key: tuple, tp: int, ep: int, etp: int, chunks: tuple) -> tuple[int, ...]:
    return tuple(n for layers, first, last in chunks for n in _flat_numels(key, tp, ep, layers, first, last, etp))


@lru_cache(maxsize=16384)
def flat_cut(numels: tuple[int, ...], shards: int, cap: int | None) -> tuple[FlatBucket, ...]:
    """`fived.layout.spec.flat_buckets`, memoised: the planner cuts the same buffer for every
    micro-batch, sequence-parallel and checkpointing option of a layout."""
    return tuple(flat_buckets(list(numels), shards, cap))


@lru_cache(maxsize=65536)
def flat_owned_elements(numels: tuple[int, ...], shards: int, index: int, cap: int | None) -> int:
    """`fived.layout.spec.flat_owned`, memoised (as `flat_cut`)."""
    return flat_owned(list(numels), shards, index, cap)


@lru_cache(maxsize=4096)
def _flat_numels(key: tuple, tp: int, ep: int, layers: tuple, first: bool, last: bool, etp: int) -> tuple:
    specs = chunk_specs(model_of(key), layers, first, last, tp=tp, ep=ep, etp=etp)
    return tuple(math.prod(s.local_shape) for s in specs if in_flat_buffer(s, ep))


def _shape_list(m: ModelConfig, tp: int, ep: int, layers, first: bool, last: bool, etp: int):
    """(dense, expert) local (rows, elements per row) of one rank's parameters, read from the sharding
    spec (`fived.layout.spec`); routed experts apart when ep > 1 (their data parallelism is edp's)."""
    dense: list[tuple[int, int]] = []
    expert: list[tuple[int, int]] = []
    for spec in chunk_specs(m, layers, first, last, tp=tp, ep=ep, etp=etp):
        if spec.buffer:
            continue
        shape = spec.local_shape
        (expert if spec.expert and ep > 1 else dense).append((shape[0], math.prod(shape[1:])))
    return dense, expert


def _rows(dim0: int, shards: int, index: int) -> int:
    """Rows of a first dimension ZeRO-3 gives shard `index` of `shards` (the spec's rule)."""
    a, b = shard_rows(dim0, shards, index)
    return b - a


def muon_saving(
    m: ModelConfig, layout: Layout, dtype: str, chunks, shard_index: int = 0, runtime: Runtime = FIVED
) -> int:
    """Optimizer bytes train.optimizer=muon does not keep on a rank: one moment (of Adam's two) per
    element of the Muon matrices it stores (`fived.layout.muon_plan`); 0 for AdamW."""
    if layout.optimizer != "muon" or not runtime.is_fived:
        return 0
    plan = stage_plan(m, layout, dtype, chunks)
    return plan.stored_elements(plan.member_of_shard(shard_index)) * MOMENT_BYTES[dtype]


def muon_buffers(m: ModelConfig, layout: Layout, dtype: str, chunks, runtime: Runtime = FIVED) -> int:
    """Transient bytes at the peak of Muon's step on the stage's busiest rank, its largest bucket's
    (`fived.layout.muon_load`: a bound from aggregates), in the Newton-Schulz (compute) dtype and the
    optimizer's (float32, float64 in float64 runs)."""
    if layout.optimizer != "muon" or not runtime.is_fived:
        return 0
    loads = busiest_loads(stage_plan(m, layout, dtype, chunks))
    return max(load.peak(ACTIVATION_BYTES[dtype], MOMENT_BYTES[dtype]) for load in loads)


def state_bytes(
    m: ModelConfig,
    layout: Layout,
    dtype: str,
    chunks: Sequence[Chunk],
    shard_index: int = 0,
    edp_index: int = 0,
    runtime: Runtime = FIVED,
) -> dict[str, int]:
    """Parameter, gradient and optimizer bytes of one rank holding `chunks` [(layers, first, last)],
    at position `shard_index` of its dp_shard*cp group and `edp_index` of its expert-data group.
    Memoised on what they depend on (a search's ~10^4 states share ~10^3 of them); Muon's saving reads
    the whole layout: not memoised."""
    if layout.optimizer == "muon":
        return _state_bytes(m, layout, dtype, chunks, shard_index, edp_index, runtime)
    L = layout
    overlapped = L.overlap_grad_reduce or L.overlap_param_gather  # (`Layout.bucket_elements` reads these)
    sizes = (L.zero, L.shards, L.edp, overlapped, L.bucket_mb, L.tp, L.ep, L.expert_tp)
    key = (model_key(m), *sizes, dtype, runtime, hashable_chunks(chunks), shard_index, edp_index)
    found = _STATE_BYTES.get(key)
    if found is None:
        if len(_STATE_BYTES) >= 65536:
            _STATE_BYTES.clear()
        found = _STATE_BYTES[key] = _state_bytes(m, layout, dtype, chunks, shard_index, edp_index, runtime)
    return dict(found)  # (a copy: the caller's to change)


_STATE_BYTES: dict[tuple, dict[str, int]] = {}


def _state_bytes(
    m: ModelConfig, layout: Layout, dtype: str, chunks, shard_index: int, edp_index: int, runtime: Runtime
) -> dict[str, int]:
    pb, gb, ob = state_element_bytes(dtype, layout.zero, runtime)  # ob: per owned (optimized) element
    saving = muon_saving(m, layout, dtype, chunks, shard_index, runtime)
    params = rank_parameters(m, layout, chunks)
    dense, expert = params.dense, params.expert
    shards = layout.shards
    n_exp = params.expert_elements
    if layout.zero == 3:
        edp = layout.edp
        elems = sum(_rows(r, shards, shard_index) * c * k for (r, c), k in dense)
        elems += sum(_rows(r, edp, edp_index) * c * k for (r, c), k in expert)
        return {"params": elems * pb, "grads": elems * gb, "optimizer": elems * ob - saving}
    n = params.dense_elements
    cap = layout.bucket_elements(pb)
    if layout.zero == 0:
        owned = n
    elif cap is not None:  # overlapped reductions: buckets, each padded and sharded on its own
        owned = flat_owned_elements(flat_numels(m, layout, chunks), shards, shard_index, cap)
    else:
        a, b = flat_range(n, shards, shard_index)
        owned = b - a
    grads = owned if layout.zero == 2 else n
    return {"params": (n + n_exp) * pb, "grads": (grads + n_exp) * gb, "optimizer": (owned + n_exp) * ob - saving}


# What `state_layout` sets to one value: what neither the state nor its buffers read (the activation
# choices; the cp mode's layouts and the overlaps of tp and ep share one state, a third of a search's
# distinct ones). The schedule it sets to the one that places the stages alike (`_placed_schedule`).
_STATE_UNREAD = {
    "micro_batch": 1,
    "sp": False,
    "checkpointing": "none",
    "cp_mode": "ring",
    "cp_ulysses": Layout.cp_ulysses,
    "tp_overlap": False,
    "ep_overlap": False,
}


def state_layout(layout: Layout) -> Layout:
    """What decides the model state and its buffers: the layout without its activation choices, its
    schedule as the stages it places on each rank, its cp mode and tp/ep overlaps (the caches below
    key on it, shared by every micro-batch / checkpointing / SP option, by the schedules that place
    stages alike and by the cp modes)."""
    schedule, virtual = _placed_schedule(layout)
    return layout.with_(**_STATE_UNREAD, pp_schedule=schedule, pp_virtual=virtual)


def _placed_schedule(layout: Layout) -> tuple[str, int]:
    """The schedule and virtual stages that place `layout`'s stages on its ranks alike (`state_layout`)."""
    if layout.pp > 1 and placement(layout.pp_schedule) != "1f1b":  # V-shaped: two stages a rank
        return "zbv", 1
    if layout.pp > 1 and layout.n_stages > layout.pp:  # looped, several stages a rank
        return "interleaved-1f1b", layout.n_stages // layout.pp
    return "1f1b", 1


# the fields `state_layout` keeps as they are
_STATE_KEPT = attrgetter(
    *(f.name for f in fields(Layout) if f.name not in {*_STATE_UNREAD, "pp_schedule", "pp_virtual"})
)


def _state_values(layout: Layout) -> tuple:
    """`state_layout(layout)`'s field values in short: equal for two layouts iff their state layouts are
    (the memos below key on it: building the state layout per look-up cost more than the look-up)."""
    return (_STATE_KEPT(layout), _placed_schedule(layout))


@layout_memo(maxsize=65536, values=_state_values)
def _state_ranks(key, layout: Layout, dtype: str, runtime: Runtime) -> tuple:
    """(`_rank_sums`, `_rank_states`) of `layout`'s `state_layout`."""
    state = state_layout(layout)
    return _rank_sums(key, state, dtype, runtime), _rank_states(key, state, dtype, runtime)


def state_floor(m: ModelConfig, layout: Layout, dtype: str, runtime: Runtime = FIVED) -> int:
    """The largest model-state bytes of any pipeline rank: a lower bound of the peak, to prune early."""
    return _floor(_state_ranks(model_key(m), layout, dtype, runtime)[0])


def _floor(sums: tuple) -> int:
    return max(total + static for total, static, _, _ in sums)


@dataclass
class MemoryEstimate:
    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    reserve: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers + self.reserve

    def gib(self) -> dict[str, float]:
        keys = ("params", "grads", "optimizer", "activations", "buffers", "reserve", "total")
        return {k: getattr(self, k) / 2**30 for k in keys}


def activation_bytes_per_microbatch(
    m: ModelConfig, layout: Layout, seq_len: int, dtype: str, chunks: Sequence[Chunk], runtime: Runtime = FIVED
) -> list[int]:
    """Bytes one micro-batch saves for backward, per chunk of the rank."""
    return [
        _activations(model_key(m), _activation_layout(layout), seq_len, dtype, tuple(layers), first, last, runtime)
        for layers, first, last in chunks
    ]


_ACTIVATION_FIELDS = (
    "tp",
    "cp",
    "ep",
    "etp",
    "sp",
    "micro_batch",
    "checkpointing",
    "cp_mode",
    "cp_ulysses",
    "document_mask",
)


@layout_memo(maxsize=65536, values=attrgetter(*_ACTIVATION_FIELDS, "pp", "pp_schedule", "pp_virtual", "pp_layers"))
def _layout_activations(key, L: Layout, seq_len: int, dtype: str, runtime: Runtime) -> list[int]:
    """`_rank_activations` of `L`'s activation layout and stages, keyed on the fields they read."""
    stages = (L.pp, placement(L.pp_schedule), L.n_stages, L.pp_layers)
    return _rank_activations(key, _activation_layout(L), *stages, seq_len, dtype, runtime)


@layout_memo(maxsize=65536, values=attrgetter(*_ACTIVATION_FIELDS))
def _layout_recompute(key, L: Layout, seq_len: int, dtype: str, runtime: Runtime) -> int:
    return _recompute_block(key, _activation_layout(L), seq_len, dtype, runtime)


def _activation_layout(layout: Layout) -> Layout:
    """What decides the activation bytes of a chunk: the sizes, micro-batch, SP, checkpointing."""
    return Layout(**{name: getattr(layout, name) for name in _ACTIVATION_FIELDS})


def _activations(
    key: tuple, layout: Layout, seq_len: int, dtype: str, layers: tuple, first: bool, last: bool, runtime: Runtime
) -> int:
    """The bytes a chunk of `layers` saves per micro-batch: every layer of a kind saves the same (both
    activation models read a layer's kind alone), so chunks whose layers' kinds agree, in order,
    share one entry (a 70B plan's chunks of n layers: one, not one per place in the model)."""
    return _chunk_activations(key, layout, seq_len, dtype, _same_kinds(key, tuple(layers)), first, last, runtime)


_FIRST_OF_KINDS: dict[tuple, tuple] = {}  # (model key, the layers' kinds in order) -> the first such chunk


@lru_cache(maxsize=65536)
def _same_kinds(key: tuple, layers: tuple) -> tuple:
    """The first chunk seen whose layers are of `layers`' kinds in order: (MoE, blockwise attention),
    what `activation_bytes` and `framework_activations` read of a layer."""
    m = model_of(key)
    kinds = (key, tuple((m.is_moe and i >= m.n_dense_layers, blockwise_layer(m, i)) for i in layers))
    if len(_FIRST_OF_KINDS) >= 65536:
        _FIRST_OF_KINDS.clear()
    return _FIRST_OF_KINDS.setdefault(kinds, layers)


@layout_memo(maxsize=262144)
def _chunk_activations(
    key: tuple, layout: Layout, seq_len: int, dtype: str, layers: tuple, first: bool, last: bool, runtime: Runtime
) -> int:
    m = model_of(key)
    if runtime.activations == "megatron":  # (fived's compiled blocks too: see runtimes.fived_runtime)
        return framework_activations(m, layout, seq_len, layers, first, last)
    from fived.layout.activation_model import activation_bytes

    L = layout
    parts = activation_bytes(
        m,
        micro_batch_seqs=L.micro_batch,
        seq_len=seq_len,
        tp=L.tp,
        sp=L.sp,
        cp=L.cp,
        ep=L.ep,
        dtype_bytes=ACTIVATION_BYTES[dtype],
        checkpointing=L.checkpointing,
        layers=layers,
        first=first,
        last=last,
        autocast=PRECISION_SPECS[dtype].autocast,
        ulysses=L.ulysses,
        document_mask=L.document_mask,
        folded=L.folded,
    )
    return sum(parts.values())


def memory_per_gpu(
    m: ModelConfig,
    layout: Layout,
    seq_len: int,
    global_batch: int,
    dtype: str,
    device_gib: float,
    runtime: Runtime = FIVED,
) -> MemoryEstimate:
    """Peak bytes on the most loaded GPU: the pipeline rank whose state + activations are largest."""
    return StateMemory(m, layout, seq_len, dtype, device_gib, runtime).of(layout, global_batch)


class StateMemory:
    """`memory_per_gpu` of the layouts that share `state`'s model state (`state_layout`: they differ in
    micro-batch size, sp and checkpointing alone, as a search's activation options of one state do),
    what they share looked up once (a 70B plan asks ~3x10^4 layouts of ~10^4 states)."""

    __slots__ = ("dtype", "key", "reserve", "runtime", "seq_len", "states", "sums")

    def __init__(
        self, m: ModelConfig, state: Layout, seq_len: int, dtype: str, device_gib: float, runtime: Runtime = FIVED
    ) -> None:
        self.key = model_key(m)
        self.sums, self.states = _state_ranks(self.key, state, dtype, runtime)
        self.seq_len, self.dtype, self.runtime = seq_len, dtype, runtime
        self.reserve = reserve_bytes(device_gib)

    def state_floor(self) -> int:
        """`state_floor` of the state."""
        return _floor(self.sums)

    def of(self, layout: Layout, global_batch: int) -> MemoryEstimate:
        """`memory_per_gpu` of `layout` (its state this one's)."""
        in_flight, acts, every, at_loss, accumulates = _option_parts(
            self.key, layout, self.seq_len, self.dtype, self.runtime, global_batch
        )
        # each rank's state + buffers + activations (the integers summed first, exactly): in-flight counts
        # are whole-rank micro-batches (alive stage-micro-batches / stages per rank); the busiest is the
        # first rank with the largest (one list and C's max: a 70B plan asks ~3x10^4 layouts of <= 64 ranks)
        totals = [
            total + static + (at_loss if last else every) + accumulated * accumulates + a * f
            for (total, static, accumulated, last), a, f in zip(self.sums, acts, in_flight)
        ]
        pp_rank = totals.index(max(totals))
        _, static, accumulated, holds_last = self.sums[pp_rank]
        state, activations = self.states[pp_rank][0], round(acts[pp_rank] * in_flight[pp_rank])
        buffers = static + (at_loss if holds_last else every) + accumulated * accumulates
        return MemoryEstimate(state["params"], state["grads"], state["optimizer"], activations, buffers, self.reserve)


@layout_memo(
    maxsize=65536, values=attrgetter(*_ACTIVATION_FIELDS, "pp", "pp_schedule", "pp_virtual", "pp_layers", "dp")
)
def _option_parts(key, L: Layout, seq_len: int, dtype: str, runtime: Runtime, global_batch: int) -> tuple:
    """What `StateMemory.of` adds to each rank's state for `L`'s activation option, whatever its state:
    (in-flight micro-batches per rank, one micro-batch's activation bytes per rank, the buffers every
    rank has, what the last stage has instead (its loss's gradients or them), whether gradients accumulate), keyed on the fields they read
    (one look-up a layout: ~3x10^4 a 70B plan, for ~7x10^3 options)."""
    micro = L.microbatches(global_batch)
    in_flight = pipeline_profile(L.pp_schedule, L.pp, L.pp_virtual, micro)[1] if L.pp > 1 else [1]
    e = ACTIVATION_BYTES[dtype]
    tokens = L.micro_batch * seq_len // L.cp  # one micro-batch on one rank
    acts = _layout_activations(key, L, seq_len, dtype, runtime)
    # checkpointing recomputes one block at a time in backward: its activations exist once more
    recompute = _layout_recompute(key, L, seq_len, dtype, runtime) if L.checkpointing != "none" else 0
    m = model_of(key)
    micro_buffers = 2 * tokens * m.dim * e if L.tp > 1 else 0  # one region's gathered input, partial output
    # the loss's backward on the last stage (freed before backward recomputes a block: the last stage
    # holds the larger of the two), and the logits a pipeline's stage keeps until that backward
    words = tokens * local_vocab(m, L.tp)
    loss = words * _loss_backward_bytes(runtime, L.tp, e) + (words * e if L.pp > 1 else 0)
    accumulates = micro > 1 or L.pp > 1  # FSDP2 accumulates unsharded gradients across micro-batches
    return in_flight, acts, recompute + micro_buffers, max(recompute, loss) + micro_buffers, accumulates


def _loss_backward_bytes(runtime: Runtime, tp: int, e: int) -> int:
    """Bytes per token and (local) vocabulary word the loss's backward holds beside what the loss saved
    (tests/test_memory_peak.py measures fived's): torch's cross-entropy (fived without tp) its
    `runtime.loss_gradients` float32 gradients (the log-probabilities' and the logits'); fived's
    vocab-parallel loss (tp > 1) one float32 gradient at a time, and its cast to a narrower compute
    dtype (the logits'); another framework's loss `loss_gradients` (one: assumed, as before)."""
    f32 = max(e, 4)
    if runtime.is_fived and tp > 1:
        return f32 + (e if e < f32 else 0)
    return runtime.loss_gradients * f32


@layout_memo(maxsize=65536)
def _rank_sums(key, layout: Layout, dtype: str, runtime: Runtime) -> tuple:
    """Per pipeline rank of `_rank_states`: (model-state bytes, static buffers, accumulated gradients,
    whether it holds the last stage): what `memory_per_gpu` adds for every activation option alike."""
    return tuple(
        (sum(state.values()), static, accumulated, any(last for _, _, last in chunks))
        for state, static, accumulated, chunks in _rank_states(key, layout, dtype, runtime)
    )


@layout_memo(maxsize=65536)
def _recompute_block(key, layout: Layout, seq_len: int, dtype: str, runtime: Runtime) -> int:
    m = model_of(key)
    full = layout.with_(checkpointing="none")
    kinds = {i for i in range(m.n_layers) if i in (0, m.n_layers - 1)}  # a dense and a MoE layer, if any
    return max(_activations(key, full, seq_len, dtype, (i,), False, False, runtime) for i in kinds)


@layout_memo(maxsize=65536)
def _rank_activations(key, layout: Layout, pp, schedule, n_stages, pp_layers, seq_len, dtype, runtime):
    """Per pipeline rank: bytes one micro-batch saves for backward over all the rank's chunks (summed
    once per kind of rank: `_activation_kinds`)."""
    kinds, of_rank = _activation_kinds(key, pp, schedule, n_stages, pp_layers)
    sums = [
        sum(
            _chunk_activations(key, layout, seq_len, dtype, layers, first, last, runtime)
            for layers, first, last in chunks
        )
        for chunks in kinds
    ]
    return [sums[kind] for kind in of_rank]


@lru_cache(maxsize=4096)
def _activation_kinds(key, pp: int, schedule: str, n_stages: int, pp_layers: str) -> tuple:
    """(each kind of pipeline rank's chunks, as `_chunk_activations` takes them: the first chunk of the
    same layer kinds (`_same_kinds`), first, last; per rank, its kind): ranks whose chunks agree in
    these save the same bytes (a 70B plan's 8 ranks: 3 kinds, the first, the middle and the last)."""
    index: dict[tuple, int] = {}
    kinds: list[tuple] = []
    of_rank = []
    for r in range(pp):
        chunks = tuple(
            (_same_kinds(key, tuple(layers)), first, last)
            for layers, first, last in rank_chunks_by_key(key, pp, schedule, n_stages, r, pp_layers)
        )
        if chunks not in index:
            index[chunks] = len(kinds)
            kinds.append(chunks)
        of_rank.append(index[chunks])
    return tuple(kinds), tuple(of_rank)


def reserve_bytes(device_gib: float) -> int:
    return int(RESERVE_GIB * 2**30 + RESERVE_FRACTION * device_gib * 2**30)


@layout_memo(maxsize=65536)
def _rank_states(key, layout: Layout, dtype: str, runtime: Runtime):
    """Per pipeline rank: (model-state bytes, transient buffers that do not depend on the micro-batch,
    ZeRO-3's unsharded gradient bytes while micro-batches accumulate, chunks)."""
    m = model_of(key)
    kinds, ranks = _rank_kinds(key, layout.pp, placement(layout.pp_schedule), layout.n_stages, layout.pp_layers)
    seen = []
    for chunks in kinds:  # ranks with the same kinds of layers hold the same state
        state = state_bytes(m, layout, dtype, chunks, runtime=runtime)
        seen.append((state,) + _static_buffers(m, layout, dtype, chunks, state, runtime))
    return [seen[kind] + (chunks,) for kind, chunks in ranks]


@lru_cache(maxsize=4096)
def _rank_kinds(key, pp: int, schedule: str, n_stages: int, pp_layers: str) -> tuple:
    """(the chunks of the first rank of each kind, per pipeline rank (its kind, its chunks)): a kind is
    the ranks whose chunks hold as many MoE layers and layers, and the embedding and head alike (what
    their state depends on; every state of a search with these stages asks it)."""
    m = model_of(key)
    index: dict[tuple, int] = {}
    firsts: list[list[Chunk]] = []
    ranks: list[tuple[int, list[Chunk]]] = []
    for r in range(pp):
        chunks = rank_chunks_by_key(key, pp, schedule, n_stages, r, pp_layers)
        kinds = tuple((moe_layer_count(m, layers), len(layers), first, last) for layers, first, last in chunks)
        if kinds not in index:
            index[kinds] = len(firsts)
            firsts.append(chunks)
        ranks.append((index[kinds], chunks))
    return tuple(firsts), tuple(ranks)


def _static_buffers(
    m: ModelConfig, layout: Layout, dtype: str, chunks, state: dict, runtime: Runtime
) -> tuple[int, int]:
    """(transient bytes, ZeRO-3's accumulated unsharded gradients) of one rank."""
    b = WEIGHT_BYTES[dtype]
    param_bytes, _, optimizer_bytes = state_element_bytes(dtype, layout.zero, runtime)
    params = state["params"] // param_bytes  # elements this rank holds
    shapes = rank_parameters(m, layout, chunks)
    dense = shapes.dense_elements
    unsharded = dense + shapes.expert_elements
    out = 0
    if PRECISION_SPECS[dtype].autocast and layout.zero < 3 and runtime.autocast_copies:  # autocast's bf16 weight copies
        out += 2 * params
    every = reduces_every_microbatch(runtime, layout)
    if layout.zero == 2 and runtime.is_fived and every:
        out += _every_microbatch_buffers(m, layout, chunks, b, state["grads"] // b - (unsharded - dense))
    elif layout.zero == 2 and runtime.is_fived:
        out += dense * b  # the flat gradient buffer (not the experts) exists while backward runs
    if layout.masters_apart(dtype) and runtime.is_fived:  # the masters' float32 gradients
        out += (state["optimizer"] + muon_saving(m, layout, dtype, chunks, runtime=runtime)) // optimizer_bytes * 4
    out += muon_buffers(m, layout, dtype, chunks, runtime)
    if layout.zero == 0 and layout.pp == 1 and layout.dp > 1:
        out += DDP_BUCKET_BYTES
    out += _reduction_pieces(layout, b, dense, unsharded - dense, every) if runtime.is_fived else 0
    out += mtp_embedding_copy(m, layout, chunks, b)
    if layout.zero < 3:
        return out, 0
    # gathered weights in the compute dtype: the whole stage under pipelines (kept); otherwise the
    # root (embedding, final norm, head: gathered for the whole step) and two blocks (in use, prefetched)
    gathered = runtime.gather_bytes or ACTIVATION_BYTES[dtype]  # (the compute dtype)
    ends = shapes.ends_elements
    per_layer = (unsharded - ends) / max(1, sum(len(c[0]) for c in chunks))
    out += int(unsharded if layout.pp > 1 else ends + 2 * per_layer) * gathered
    return out, unsharded * (runtime.grad_bytes or b)


def mtp_embedding_copy(m: ModelConfig, layout: Layout, chunks, b: int) -> int:
    """Multi-token prediction on a last stage without the embedding: its copy of the (tp-local)
    embedding and the copy's gradient, in the weights' dtype (fived.parallel.mtp_embedding)."""
    holds_last = any(last for _, _, last in chunks) and not any(first for _, first, _ in chunks)
    return 2 * local_vocab(m, layout.tp) * m.dim * b if m.mtp_depth and holds_last else 0


def _every_microbatch_buffers(m: ModelConfig, layout: Layout, chunks, b: int, owned: int) -> int:
    """ZeRO-2 reducing every micro-batch (fived.parallel.zero_microbatch), no whole gradient buffer:
    the gradients of the largest bucket and the one after it as autograd fills them, CAST_PIECES_IN_FLIGHT
    largest buckets packed in the reduction dtype with their reduced pieces, and in bf16 runs reducing
    in float32 the shard's float32 sum of the micro-batches."""
    shards = layout.shards
    cut = flat_cut(flat_numels(m, layout, chunks), shards, layout.bucket_elements(b))
    largest = max(bucket.piece for bucket in cut) * shards
    rb = 4 if b == 2 and layout.reduce_dtype == "float32" else b
    return 2 * largest * b + CAST_PIECES_IN_FLIGHT * rb * (largest + largest // shards) + (owned * rb if rb != b else 0)


def _reduction_pieces(layout: Layout, b: int, dense: int, experts: int, every_micro: bool = False) -> int:
    """Transient bytes of fived's gradient reductions in pieces of REDUCE_CHUNK_ELEMENTS: bf16 flat
    gradients cast to float32 a piece at a time (with the reduced slice of a sharded stage; with
    overlapped reductions CAST_PIECES_IN_FLIGHT of them at once; not ZeRO-2 reducing every micro-batch,
    which packs whole buckets: `_every_microbatch_buffers`), and routed experts' gradients (ep > 1,
    summed over edp) packed, then cast, a piece at a time (overlapped, `fived.parallel.expert_grads`:
    cast pieces only, CAST_PIECES_IN_FLIGHT at once; uncast, in place)."""
    cast = 4 if b == 2 and layout.reduce_dtype == "float32" else 0
    flat_reduced = layout.flat_buffer
    flat_reduced = flat_reduced and not (every_micro and layout.zero == 2)
    out = 0
    if flat_reduced and cast:
        piece = min(dense, REDUCE_CHUNK_ELEMENTS)
        in_flight = CAST_PIECES_IN_FLIGHT if layout.overlap_grad_reduce else 1
        out += in_flight * cast * (piece + (piece // layout.shards if layout.zero else 0))
    if layout.zero < 3 and layout.ep > 1 and layout.edp > 1 and experts:
        piece = min(experts, REDUCE_CHUNK_ELEMENTS)
        out += piece * (CAST_PIECES_IN_FLIGHT * cast if layout.overlap_grad_reduce else b + cast)
    return out
