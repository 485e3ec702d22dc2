"""What serving a model costs one GPU: memory (weights, KV cache, activations) and time (a prefill,
a decode step), for a serving layout. `fived.planner.serve` puts these under a workload.

Memory
- weights: the local shapes of the sharding spec (`fived.layout.spec`: tensor parallelism cuts heads,
  feed-forward and expert widths and the padded vocabulary, keeps a whole kv head per rank when
  tp > n_kv_heads; expert parallelism keeps E/ep experts) for the layers the pipeline rank holds
  (`fived.layout.stages.split_layers`: the cost-balanced split the runtime builds). In bf16 2 bytes
  each; with fp8 weights the linear layers and experts take 1 byte (embedding, head, norms, router
  stay bf16, as vLLM's FP8 checkpoints keep them).
- KV cache (`kv_cache_bytes`, the one formula `fived generate --report` measures against): per layer,
  keys and values of every position of every sequence the GPU holds (a windowed layer's last
  sliding_window positions only: a rolling cache), in the kv heads a tp rank holds (multi-head
  latent attention: the kv latent and the shared rope key, on every tp rank).
- activations of one forward (the prefill's tokens, or the decode batch): the widest layer's working
  set (its input, q/k/v, attention output, the feed-forward's gate/up/product) and the float32
  logits, plus the reserve of the training planner (CUDA context, NCCL, fragmentation).

Time (hardware rates from `fived.planner.hardware`, efficiency from `fived.planner.timing`)
- prefill (compute-bound): 2 FLOPs per matmul parameter and token on this GPU's share, plus causal
  attention (a windowed layer's query over its window's keys only), at the GEMM efficiency the
  training planner fitted on published runs (`timing.efficiency` for the per-GPU width and the
  prefill's rows), or the memory time of reading the weights if longer; plus each collective.
- decode step (memory-bandwidth-bound): the weights this GPU reads (dense layers whole; of the experts,
  those the batch's tokens route to, in expectation) and the KV cache its sequences attend over, at
  HBM speed x `timing.HBM_EFFICIENCY`, or the step's FLOPs if longer; plus each collective: two tp
  all-reduces per layer and the logits' gather, three expert all-to-alls per MoE layer (the counts,
  the dispatch, the combine), a pipeline send per stage boundary and the tokens back to the first,
  each on the link its group spans (NVLink inside a node, else the network), priced by the training
  planner's `links.group_link` and `links.collective_seconds`; plus the host's dispatch of each operator the forward calls from
  Python (`Hardware.dispatch_s`: 0 on GPUs, whose serving engines replay decode steps as CUDA graphs;
  fitted for CPU ranks, which run fived's eager model).
A forward's latency is its pipeline ranks one after another; each rank's share (its work and its send
onward, `ForwardTime.stages`) says how often a pipeline can start one (`fived.planner.serve` keeps pp
batches in flight, as vLLM does).
A serving engine's GPUs are numbered tp innermost, then pp, then the data-parallel replicas (as vLLM
places them): a tp group is tp consecutive GPUs, pipeline neighbours are tp apart, an ep group spans
ep replicas tp*pp apart.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache

from fived.config import ModelConfig
from fived.layout.spec import cached_positions, chunk_specs, kv_cache_width, kv_width, local_vocab
from fived.layout.stages import model_key, split_layers
from fived.planner.constants import CALIBRATION
from fived.planner.hardware import Hardware
from fived.planner.links import collective_seconds, group_link
from fived.planner.memory import reserve_bytes
from fived.planner.timing import HBM_EFFICIENCY, Cluster, efficiency

# Weight formats: bytes per weight of the linear layers and experts, and of everything else — the
# embedding, head, norms and router, the activations and the collectives' payloads (fp8 checkpoints
# keep those in bf16). bf16 and fp8 are what GPU serving engines run; float32 and float64 what
# `fived generate` runs on CPU ranks (benchmarks/bench_serve_cpu.py prices those).
WEIGHT_DTYPES = {"bf16": 2, "fp8": 1, "float32": 4, "float64": 8}
COMPUTE_BYTES = {"bf16": 2, "fp8": 2, "float32": 4, "float64": 8}
SERVING_WEIGHTS = ("bf16", "fp8")  # what `fived plan --serve` searches and accepts (GPU peaks are bf16/fp8)
KV_DTYPES = {"bf16": 2, "fp8": 1, "float32": 4, "float64": 8}
# Operators a forward of fived's eager model dispatches from Python (torch.profiler's top-level aten ops of
# a decode step, tests/test_serve.py counts them again): per dense layer, per MoE layer (routing, the
# grouped experts as one op, the shared expert), and the embedding or the final norm and head
DENSE_LAYER_OPS = 50
MOE_LAYER_OPS = 98
END_OPS = 12


@dataclass(frozen=True)
class ServeLayout:
    """How one serving engine spreads a model over GPUs: tp x pp GPUs per replica, `dp` replicas
    (data-parallel attention ranks); with `ep` > 1 groups of ep replicas hold the routed experts
    between them (E/ep each, like fived's ep over dp) and step together. `weights`: a WEIGHT_DTYPES
    format (bf16 or fp8 on GPUs), which also sets the activations' and collectives' element size."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    weights: str = "bf16"

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def element_bytes(self) -> int:
        """Bytes per element of the activations, the collectives and the weights kept unquantized."""
        return COMPUTE_BYTES[self.weights]

    def describe(self) -> str:
        parts = [f"tp{self.tp}"] + [f"pp{self.pp}"] * (self.pp > 1) + [f"dp{self.dp}"] * (self.dp > 1)
        return " ".join(parts + [f"ep{self.ep}"] * (self.ep > 1) + [self.weights])


def kv_cache_bytes(
    m: ModelConfig, *, tp: int, layers: Iterable[int], sequences: float, positions: float, element_bytes: int
) -> float:
    """Bytes of the key and value caches one GPU holds: for each of its `layers` (ids), what
    `sequences` sequences of `positions` positions cache on a tp rank (`fived.layout.spec`:
    `cached_positions` of them, a windowed layer's last window only; `kv_cache_width` per position,
    keys and values of its kv heads, or the latent and rope key). `fived generate --report` measures
    its caches against this."""
    cached = sum(cached_positions(m.layer_window(lid), positions) for lid in layers)
    return cached * sequences * kv_cache_width(m, tp) * element_bytes


def stage_layers(m: ModelConfig, pp: int) -> list[list[int]]:
    """The layers of each pipeline rank, as the runtime splits them (cost-balanced, head on the last)."""
    return split_layers(m, pp) if pp > 1 else [list(range(m.n_layers))]


@dataclass(frozen=True)
class StageWeights:
    """Elements of one pipeline rank's weights (its tp/ep share): linear layers, the rest, routed
    experts, the embedding (a lookup: neither multiplied nor read whole)."""

    linear: int  # attention, dense feed-forward, shared experts
    other: int  # head, norms, router (kept in bf16 with fp8 weights)
    embedding: int
    experts: int  # this rank's routed experts, all layers
    expert_layers: int  # MoE layers on this rank
    local_experts: int  # routed experts per MoE layer on this rank
    layers: int
    first: bool
    last: bool
    layer_ids: tuple[int, ...] = ()

    def bytes(self, weights: str) -> int:
        return (self.linear + self.experts) * WEIGHT_DTYPES[weights] + (self.other + self.embedding) * COMPUTE_BYTES[
            weights
        ]


def stage_weights(m: ModelConfig, layout: ServeLayout, pp_rank: int) -> StageWeights:
    """One pipeline rank's weight elements, from the sharding spec's local shapes."""
    return _stage_weights(model_key(m), layout.tp, layout.pp, layout.ep, pp_rank)


@lru_cache(maxsize=16384)
def _stage_weights(key: tuple, tp: int, pp: int, ep: int, pp_rank: int) -> StageWeights:
    m = ModelConfig(**dict(key))
    layout = ServeLayout(tp=tp, pp=pp, ep=ep)
    stages = stage_layers(m, layout.pp)
    layers = stages[pp_rank]
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    linear = other = experts = embedding = 0
    for spec in chunk_specs(m, layers, first, last, tp=layout.tp, ep=layout.ep):
        if spec.buffer:
            continue
        n = math.prod(spec.local_shape)
        if spec.expert:
            experts += n
        elif spec.part == "embedding":
            embedding += n
        elif (
            spec.part == "layer"
            and spec.name.endswith(".weight")
            and len(spec.shape) == 2
            and "router" not in spec.name
        ):
            linear += n
        else:
            other += n
    moe_layers = sum(1 for lid in layers if m.is_moe and lid >= m.n_dense_layers)
    local = m.n_experts // layout.ep if m.is_moe else 0
    return StageWeights(linear, other, embedding, experts, moe_layers, local, len(layers), first, last, tuple(layers))


def activation_bytes(m: ModelConfig, tp: int, tokens: int, last: bool, element_bytes: int) -> int:
    """The working set of one forward over `tokens` tokens on a GPU: the widest layer's input, q/k/v,
    attention output and feed-forward activations (gate, up, product) at once, and the float32 logits
    of every token on the last stage (the runtime computes them for the whole prompt)."""
    ffn = max(m.ffn_dim, m.expert_dim * (m.top_k + m.n_shared_experts) if m.is_moe else 0)
    width = 3 * m.dim + (2 * m.n_heads * m.head_dim) // tp + 2 * kv_width(m, tp) + 3 * ffn // tp
    logits = tokens * local_vocab(m, tp) * 4 if last else 0
    return tokens * width * element_bytes + logits


@dataclass
class GpuMemory:
    """Bytes on the most loaded GPU of a layout."""

    weights: int
    kv_cache: float  # (a mean number of sequences in flight holds a fractional cache)
    activations: int
    reserve: int

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache + self.activations + self.reserve

    def gib(self) -> dict[str, float]:
        return {k: getattr(self, k) / 2**30 for k in ("weights", "kv_cache", "activations", "reserve", "total")}


def rank_memory(
    m: ModelConfig,
    layout: ServeLayout,
    hw: Hardware,
    pp_rank: int,
    *,
    sequences: float,
    positions: int,
    forward_tokens: int,
    kv_bytes: int,
) -> GpuMemory:
    """Pipeline rank `pp_rank`'s memory with `sequences` sequences of `positions` positions cached per
    GPU and one forward of `forward_tokens` tokens in flight (one prompt: engines prefill in chunks)."""
    w = stage_weights(m, layout, pp_rank)
    return GpuMemory(
        w.bytes(layout.weights),
        kv_cache_bytes(
            m, tp=layout.tp, layers=w.layer_ids, sequences=sequences, positions=positions, element_bytes=kv_bytes
        ),
        activation_bytes(m, layout.tp, forward_tokens, w.last, layout.element_bytes),
        reserve_bytes(hw.memory_gib),
    )


def gpu_memory(m: ModelConfig, layout: ServeLayout, hw: Hardware, **workload) -> GpuMemory:
    """The busiest pipeline rank's memory (`rank_memory`'s keywords)."""
    return max((rank_memory(m, layout, hw, r, **workload) for r in range(layout.pp)), key=lambda mem: mem.total)


def sequences_that_fit(
    m: ModelConfig,
    layout: ServeLayout,
    hw: Hardware,
    capacity: int,
    *,
    positions: int,
    forward_tokens: int,
    kv_bytes: int,
) -> int:
    """Sequences of `positions` positions every GPU's KV cache holds beside its weights, one forward's
    activations and the reserve (0 if the weights alone do not fit)."""
    fits = []
    for r, w in enumerate(_all_stages(m, layout)):
        empty = rank_memory(
            m, layout, hw, r, sequences=0, positions=positions, forward_tokens=forward_tokens, kv_bytes=kv_bytes
        )
        per_sequence = kv_cache_bytes(
            m, tp=layout.tp, layers=w.layer_ids, sequences=1, positions=positions, element_bytes=kv_bytes
        )
        fits.append(max(0, int((capacity - empty.total) // per_sequence)))
    return min(fits)


def _all_stages(m: ModelConfig, layout: ServeLayout) -> list[StageWeights]:
    return [stage_weights(m, layout, r) for r in range(layout.pp)]


# --- time -------------------------------------------------------------------------------------------


@dataclass
class ForwardTime:
    """Seconds of one forward (a prefill or a decode step) through every pipeline rank, by part, and
    each pipeline rank's share (its own work and its send onward)."""

    compute: float  # GEMMs and attention at the fitted efficiency, or reading the weights and KV cache
    tp: float
    ep: float
    pp: float
    host: float  # dispatch the device does not hide (CPU ranks: per operator)
    calls: dict = field(default_factory=dict)  # collectives per part ("tp", "ep", "pp")
    stages: list = field(default_factory=list)  # seconds each pipeline rank spends on this forward
    gemm: float = 0.0  # of which `compute` is the longer, per rank, summed: the FLOPs at the fitted efficiency
    read: float = 0.0  # and reading the weights and KV cache at HBM speed

    @property
    def total(self) -> float:
        """The forward's latency: the pipeline ranks one after another."""
        return self.compute + self.tp + self.ep + self.pp + self.host

    @property
    def interval(self) -> float:
        """How long the busiest pipeline rank is occupied by this forward: with several forwards in
        flight (pipeline parallelism), one starts every `interval` (without pp, the latency)."""
        return max(self.stages, default=self.total)

    def add(self, part: str, calls: int, seconds_each: float, size: int) -> None:
        """`calls` collectives of a group of `size` ranks (none when the group is one rank)."""
        if size > 1 and calls:
            setattr(self, part, getattr(self, part) + calls * seconds_each)
            self.calls[part] = self.calls.get(part, 0) + calls


def forward_time(
    m: ModelConfig,
    layout: ServeLayout,
    cluster: Cluster,
    *,
    sequences: float,
    new_tokens: int,
    context: float,
    kv_bytes: int,
) -> ForwardTime:
    """One forward of `sequences` sequences per data-parallel rank, each bringing `new_tokens` tokens
    (the prompt at a prefill, 1 at a decode step) and attending over `context` positions: its latency
    (the pipeline ranks one after another) and each rank's share (`ForwardTime.interval`)."""
    hw, c = cluster.hardware, CALIBRATION.constants
    tokens = sequences * new_tokens
    e = layout.element_bytes
    tp_link = group_link(cluster, 1, layout.tp, c)
    ep_link = group_link(cluster, layout.tp * layout.pp, layout.ep, c)
    pp_link = group_link(cluster, layout.tp, 2, c)
    out = ForwardTime(0.0, 0.0, 0.0, 0.0, 0.0)
    for w in _all_stages(m, layout):
        before = out.total
        gemm, read = _stage_compute(m, layout, hw, w, tokens, sequences, new_tokens, context, kv_bytes)
        out.compute += max(gemm, read)
        out.gemm += gemm
        out.read += read
        regions = 2 * w.layers + (1 if w.first else 0)  # attention and MLP outputs, the vocab-parallel embedding
        out.add("tp", regions, collective_seconds("all_reduce", tokens * m.dim * e, tp_link, hw, c), layout.tp)
        slots = tokens * m.top_k * m.dim * e  # dispatch and combine, after the per-expert counts
        out.add(
            "ep", w.expert_layers, collective_seconds("all_to_all_single", 8 * m.n_experts, ep_link, hw, c), layout.ep
        )
        out.add("ep", 2 * w.expert_layers, collective_seconds("all_to_all_single", slots, ep_link, hw, c), layout.ep)
        if w.last:  # the vocab-parallel logits of each sequence's last position, gathered
            logits = sequences * local_vocab(m, layout.tp) * layout.tp * 4
            out.add("tp", 1, collective_seconds("all_gather_single", logits, tp_link, hw, c), layout.tp)
            out.add(
                "pp", 1, collective_seconds("send", sequences * 8, pp_link, hw, c), layout.pp
            )  # tokens to the first
        else:
            out.add("pp", 1, collective_seconds("send", tokens * m.dim * e, pp_link, hw, c), layout.pp)
        out.host += hw.dispatch_s * (
            DENSE_LAYER_OPS * (w.layers - w.expert_layers)
            + MOE_LAYER_OPS * w.expert_layers
            + END_OPS * (w.first + w.last)
        )
        out.stages.append(out.total - before)
    return out


def _stage_compute(
    m: ModelConfig,
    layout: ServeLayout,
    hw: Hardware,
    w: StageWeights,
    tokens: float,
    sequences: float,
    new_tokens: int,
    context: float,
    kv_bytes: int,
) -> tuple[float, float]:
    """(seconds of its FLOPs at the fitted efficiency, of its bytes read at HBM speed) of one stage's
    forward: it takes the longer."""
    touched = _experts_touched(m, w, tokens * layout.ep)
    # a routed expert's rank receives top_k/E of the ep group's tokens for each of its experts
    flops = 2 * tokens * (w.linear + w.other + w.experts * (m.top_k / max(m.n_experts, 1)) * layout.ep)
    heads = m.n_heads // layout.tp
    # causal attention: each new token attends over the positions before it (QK^T and AV)
    keys = sum(_mean_keys(m.layer_window(lid), context, new_tokens) for lid in w.layer_ids)
    flops += 4 * heads * m.head_dim * tokens * keys
    peak = hw.peak_tflops * 1e12
    if layout.weights == "fp8" and hw.fp8_tflops > 0:
        peak = hw.fp8_tflops * 1e12
    gemm = flops / (peak * efficiency(m.dim / layout.tp, tokens, hw, CALIBRATION.constants, m.dim))
    read = w.bytes(layout.weights) - w.experts * WEIGHT_DTYPES[layout.weights] * (1 - touched)
    read -= w.embedding * layout.element_bytes
    read += kv_cache_bytes(
        m, tp=layout.tp, layers=w.layer_ids, sequences=sequences, positions=context, element_bytes=kv_bytes
    )
    return gemm, read / (hw.hbm_gbps * 1e9 * HBM_EFFICIENCY)


def _mean_keys(window: int, context: float, new_tokens: int) -> float:
    """Keys a new token sees, averaged over the `new_tokens` last of `context` positions: key counts
    a + 1 .. context (a = context - new_tokens), each capped at a windowed layer's `window`."""
    if not window or window >= context:
        return context - (new_tokens - 1) / 2
    first = context - new_tokens + 1
    if window <= first:
        return float(window)
    return ((window * (window + 1) - first * (first - 1)) / 2 + (context - window) * window) / new_tokens


def _experts_touched(m: ModelConfig, w: StageWeights, tokens: float) -> float:
    """Expected share of a rank's routed experts a forward reads: each of the `tokens` tokens of its
    ep group picks top_k of E experts (uniform routing)."""
    if not w.expert_layers:
        return 1.0
    return 1.0 - (1.0 - m.top_k / m.n_experts) ** tokens
