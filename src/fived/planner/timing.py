"""Step time per GPU for a layout: compute at achievable efficiency, the communication of every mesh
dimension on the link its group actually uses, the overlap the runtime allows, and the pipeline bubble.

    step = (compute + tp + cp_exposed + ep + pp_p2p) / (1 - bubble) + dp_exposed + optimizer + overhead

- compute: the busiest pipeline rank's model FLOPs (6 x matmul parameters + attention, per token;
  + one more layer forward with full checkpointing) as three kinds of work:
    GEMMs at peak x `efficiency` (constants fitted on the published runs: `fived.planner.constants`): the
      share of peak large transformer GEMMs reach, lowered for narrow per-GPU matrices (hidden/tp) by
      width / (width + width_half) and for short ones by rows / (rows + rows_half): rows are a
      micro-batch's tokens, and for routed experts the tokens each expert receives (top_k/E of
      them, times ep: expert parallelism gathers an expert's tokens from ep ranks). FP8 GEMMs (a
      runtime with FP8 on a GPU with FP8 tensor cores; fived's only compiled) take 1/fp8_speedup of the
      time (fitted).
      Experts run as a loop (fived; Megatron-Core without --moe-grouped-gemm) pay a kernel launch per
      expert GEMM (the hardware's launch_s).
    attention (QK^T, AV): at the GEMM efficiency with a fused kernel, which with the causal mask computes
      half the blocks the FLOP count has (`Runtime.causal_skip`: flash attention, Transformer Engine,
      SDPA; not Megatron-LM 2021/2022, which masks a whole score matrix); a context-parallel ring of plain
      matmuls (a runtime without flash_ring) streams the fp32 score matrix RING_SCORE_PASSES times.
    memory-bound element-wise work (norms, RoPE, activation, residual adds, casts) at HBM speed:
      ELEMENTWISE_BYTES per token and layer, eager (fived) or fused (Transformer Engine, compile),
      the residual stream's repeated on every tp rank without sequence parallelism,
      and fived's autocast weight copies (AUTOCAST_BYTES per parameter and micro-batch).
- communication: the collectives of `fived.planner.communication` (the bytes `--report` checks
  against the ledger), each on the link its group uses: tp innermost on the mesh, then cp, then
  dp, pp outermost, so a group of ranks `stride` apart spanning `size` ranks stays in one node iff
  stride*size <= gpus per node. Inside a node at NVLink speed, across nodes at the GPU's network
  share, each times link_efficiency, plus the hardware's latency per call. Ring collectives
  move 2(n-1)/n (all-reduce) or (n-1)/n (all-gather, reduce-scatter, all-to-all) of the bytes.
- overlap (`Runtime`): `tp_overlap` of tp hidden, at most the GEMMs' time (what it hides under); the
  ring behind the attention it overlaps with (Ulysses' all-to-alls, cp_mode ulysses/hybrid: exposed);
  the dp reduction behind the last micro-batch's backward and ZeRO-3's prefetched gathers behind
  the step's compute, where the runtime overlaps them.
- pipeline bubble: from the schedule simulator (`fived.layout.schedule_sim.pipeline_profile`);
  ranks sharing cores (CPU) fill each other's idle time.
- optimizer: AdamW streams 28 bytes per owned parameter (read p, g, m, v; write p, m, v, fp32); Muon
  (train.optimizer=muon) streams its own per element of its matrices (`fived.layout.muon_load.stream_bytes`)
  and adds its exchange's all-to-alls (`fived.planner.communication`, part "optimizer": bytes without
  the rank's own share, priced as the n/(n-1) times them an all-to-all passes) and each bucket's
  busiest owner's Newton-Schulz GEMMs.
- overhead: host work the device does not hide (CPU ranks: per layer and micro-batch, per step; a GPU's
  profile: the host time beyond the device's work, all of it for MoE layers).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import lru_cache
from operator import attrgetter

from fived.config import ModelConfig
from fived.layout.flops import attention_flops_per_token, attention_keys, flops_per_token, kernel_attention_keys
from fived.layout.layout import PRECISION_SPECS, Layout
from fived.layout.muon_load import stream_bytes
from fived.layout.muon_plan import ns_flops, stage_plan
from fived.layout.schedule_sim import pipeline_profile
from fived.layout.stages import model_key, placement, rank_chunks_by_key
from fived.planner.communication import model_parallel_runtime, owned_parameters
from fived.planner.constants import CALIBRATION, Constants
from fived.planner.hardware import Cluster, Hardware  # (Cluster: read from here too)
from fived.planner.links import (
    data_parallel_priced,
    data_parallel_seconds,
    model_parallel_priced,
    model_parallel_seconds,
)
from fived.planner.memory import MOMENT_BYTES
from fived.planner.profile import RANKS_KEYS
from fived.planner.runtimes import FIVED, Runtime, for_layout, reduces_every_microbatch

# The fitted constants (GEMM efficiency per GPU generation and its shape dependence, link
# efficiency, tp overlap, FP8 speed-up, experts' efficiency) are data: `fived.planner.constants`
# (the calibration file the fitter writes), passed to `step_time` or, by default, the shipped one.
# B200 and MI300X have no published runs in it and take the Hopper figure: uncalibrated. CPU ranks
# take their hardware entry's `gemm_efficiency` (fitted by benchmarks/bench_planner_cpu.py).
HBM_EFFICIENCY = 0.8  # share of HBM bandwidth element-wise kernels stream at (assumed)
# Element-wise bytes per token and layer, forward + backward, (per hidden unit on the residual stream,
# per hidden unit inside attention, per ffn unit), counted from the kernels each runtime runs (not
# fitted: the GEMM efficiency absorbs what the counts miss). The residual stream's work (norms, their
# casts, residual adds) is repeated on every tp rank unless sequence parallelism splits it; the
# attention's (RoPE, layout copies) and the ffn's are split over tp:
#   eager (fived's model; Hugging Face's alike): fp32 residual stream; F.rms_norm x2 (fwd 8h, bwd 16h
#   each); autocast's bf16 copy of a norm's output per consuming linear, 5 of them (fwd 6h, bwd ~14h
#   each, the fp32 gradients summed); residual adds (fwd 10h, bwd 6h, x2)          ~ 180 (stream)
#   RoPE on q and k in fp32 (rotate-half: ~38 B/element forward, twice that backward, on h + h/4);
#   SDPA's layout copies (~12h)                                                  ~ 160 (attention)
#   SiLU and product on the ffn width in bf16 (fwd 10f, bwd 18f)                 ~ 30 (ffn)
#   fused (Transformer Engine, apex, torch.compile): norms inside the linears (~24h) and bf16 residual
#   adds (~20h); fused RoPE (~6h); fused SwiGLU (16f)                            ~ (44, 6, 16)
ELEMENTWISE_BYTES = {"eager": (180.0, 160.0, 30.0), "fused": (44.0, 6.0, 16.0)}
# An RMSNorm written out in Python ops (cast to fp32, pow, mean, rsqrt, multiply, cast back, times the
# weight: ~36 bytes per element forward, ~72 backward) instead of one kernel (~24): per norm, 2 a layer
PYTHON_NORM_EXTRA_BYTES = 108.0 - 24.0
# Routed tokens' permutation per top_k slot and hidden unit, bf16: gather into expert order and the
# weighted scatter back, forward (r+w 4 + 4 bytes) and backward (4 + ~6) — the dispatcher's memory traffic
DISPATCH_BYTES = 18
AUTOCAST_BYTES = 16  # per parameter and micro-batch (fived): fp32 -> bf16 copy in forward (r 4, w 2),
#   its bf16 gradient cast and accumulated into the fp32 one in backward (r 2 + 4, w 4)
RING_SCORE_PASSES = 29  # fp32 score-matrix reads+writes per ring block, forward 11 + backward 18 (context.py)


@dataclass
class StepTime:
    compute: float
    bubble: float  # seconds the busiest rank idles in the pipeline
    tp: float
    cp: float
    ep: float
    pp: float
    dp: float
    optimizer: float
    tokens: int  # per step, all GPUs
    world: int
    model_flops: float  # per step, all GPUs (MFU numerator)
    peak_flops: float  # per GPU
    comm_bytes: dict | None = None  # bytes per logical group this rank moves in one step (priced collectives)
    overhead: float = 0.0  # host work the device does not hide
    # the part of `overhead` spent per layer and micro-batch, inside the layers' forward and backward
    # (a measured step breakdown counts it as compute: fived.training.breakdown)
    layer_host: float = 0.0

    @property
    def total(self) -> float:
        return (
            self.compute
            + self.bubble
            + self.tp
            + self.cp
            + self.ep
            + self.pp
            + self.dp
            + self.optimizer
            + self.overhead
        )

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens / self.total / self.world

    @property
    def mfu(self) -> float:
        return self.model_flops / self.total / self.world / self.peak_flops

    def to_dict(self) -> dict:
        # (the fields read directly: asdict deep-copies comm_bytes, which the dict leaves out)
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _NOT_IN_DICT}
        return {**out, "total": self.total, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "mfu": self.mfu}


_NOT_IN_DICT = frozenset(("tokens", "world", "model_flops", "peak_flops", "comm_bytes", "layer_host"))


def efficiency(width: float, rows: float, hw: Hardware, c: Constants, depth: float = float("inf")) -> float:
    """Share of peak a GEMM reaches with `rows` tokens, a per-GPU narrow side `width` (hidden/tp) and a
    full side `depth` (the hidden: the other dimension of every transformer GEMM), each factor
    x / (x + its half-point). (CPU ranks: the share of the host's matmul rate, whatever the shape; with a
    machine profile: the rate measured at this shape, as a share of the hardware's peak.)"""
    if hw.profile:
        return hw.profile.gemm(rows, width, depth) * hw.core_share / (hw.peak_tflops * 1e12)
    if hw.gemm_efficiency:
        return hw.gemm_efficiency
    return (
        c.gemm_efficiency(hw.calibration)
        * width
        / (width + c.width_half)
        * rows
        / (rows + c.rows_half)
        * depth
        / (depth + c.depth_half)
    )


def expert_share(m: ModelConfig, seq_len: int, *, per_token: float | None = None) -> float:
    """Share of the model FLOPs spent in routed experts (`per_token`: flops_per_token, if known)."""
    if not m.is_moe:
        return 0.0
    n_moe = m.n_layers - m.n_dense_layers
    return 6 * 3 * m.dim * m.expert_dim * m.top_k * n_moe / (per_token or flops_per_token(m, seq_len))


def attention_share(m: ModelConfig, seq_len: int, *, per_token: float | None = None) -> float:
    return _attention_flops(model_key(m), seq_len) / (per_token or flops_per_token(m, seq_len))


def step_time(
    model: ModelConfig,
    layout: Layout,
    cluster: Cluster,
    seq_len: int,
    global_batch: int,
    dtype: str = "bfloat16",
    runtime: Runtime = FIVED,
    *,
    constants: Constants | None = None,
) -> StepTime:
    """The step of `layout` in `runtime`, priced with `constants` (default: the shipped calibration's)."""
    hw, L, m = cluster.hardware, layout, model
    c = constants or CALIBRATION.constants
    runtime, base = for_layout(runtime, L), runtime
    if constants is None:  # (not with a fit's constants, which record the fields a figure read: see below)
        busiest = busiest_compute(m, L, cluster, seq_len, global_batch, dtype, base, c)
    else:
        busiest = _busiest_compute(m, L, cluster, seq_len, global_batch, dtype, runtime, c)
    micro, tokens, model_flops, compute = busiest.micro, busiest.tokens, busiest.model_flops, busiest.compute
    pp_rank, chunks, layers_here, recompute = busiest.pp_rank, busiest.chunks, busiest.layers, busiest.recompute

    # the model-parallel collectives' seconds (shared by layouts differing only in their data
    # parallelism), then the data-parallel ones added in the same order `step_collectives` lists them
    # (not with a fit's constants, which record the fields a figure read: no memo may hide a read)
    key, memoised = model_key(m), constants is None
    if memoised:
        mp = model_parallel_seconds(
            key, L, cluster, seq_len, global_batch, dtype, model_parallel_runtime(runtime), c, pp_rank
        )
    else:
        mp = model_parallel_priced(key, L, cluster, seq_len, global_batch, dtype, runtime, c, pp_rank)
    time, moved = defaultdict(float, mp[0]), defaultdict(float, mp[1])
    reductions = data_parallel_seconds if memoised and L.optimizer != "muon" else data_parallel_priced
    priced, host = reductions(key, L, cluster, global_batch, dtype, runtime, c, pp_rank)
    for part, seconds, group, nbytes in priced:
        time[part] += seconds
        moved[group] += nbytes
    hides = _hides(hw)
    tp, cp, ep, pp, bubble = _model_parallel_exposed(m, L, hw, runtime, c, busiest, time, seq_len)
    experts = time["dp_expert"] if runtime.expert_grad_overlap else 0.0
    overlap = (runtime.grad_overlap and L.zero in (0, 3)) or (runtime.zero12_overlap and L.zero in (1, 2))
    if L.pp > 1:  # (FSDP2 under a schedule reduce-scatters during each stage's last backward, always)
        overlap = runtime.pipeline_grad_overlap or (runtime.grad_overlap and L.zero == 3)
    if overlap and hides:
        dp = exposed_reduction(
            time["dp"],
            experts,
            time["dp_gather"],
            compute,
            micro,
            every_microbatch=reduces_every_microbatch(runtime, L),
            experts_last_only=runtime.is_fived,
        )
    else:
        dp = time["dp"] + experts + time["dp_gather"]
    if not runtime.expert_grad_overlap:  # (reduced after backward: nothing to hide under)
        dp += time["dp_expert"]
    optimizer = 28 * owned_parameters(m, L, chunks) / (hw.hbm_gbps * 1e9) + time["optimizer"]
    if L.optimizer == "muon" and runtime.is_fived:  # (its elements at its own bytes, not AdamW's 28)
        optimizer += muon_stream_s(m, L, dtype, chunks, hw) + orthogonalization_s(m, L, dtype, chunks, hw, c)
    layer_host = hw.layer_overhead_s * layers_here * micro * (1 + recompute)
    if hw.profile and m.is_moe:  # a MoE layer's own host time (router, dispatch), measured apart from a dense one's
        moe_here = layers_here * (m.n_layers - m.n_dense_layers) / m.n_layers
        moe_layer = hw.profile.moe_layer_overhead_s / hw.core_share
        layer_host += (moe_layer - hw.layer_overhead_s) * moe_here * micro * (1 + recompute)
    overhead = layer_host + hw.step_overhead_s + host
    if hw.profile and hw.profile.dimension_s and L.world > 1:  # what the calibration's ranks add beyond what is
        # priced (measured; one rank alone meets no other: its host time is the profile's, measured on one)
        overhead += _ranks_unpriced(hw, m, layers_here * micro * (1 + recompute))
    if hw.profile and hw.profile.on_gpu and not m.is_moe:  # launches are asynchronous: the host runs ahead of
        # the device's work (not past a MoE layer: fived reads its experts' token counts on the host each layer)
        overhead = max(0.0, overhead - (compute + tp + cp + ep + pp))
        layer_host = min(layer_host, overhead)
    return StepTime(
        compute,
        bubble,
        tp,
        cp,
        ep,
        pp,
        dp,
        optimizer,
        tokens,
        L.world,
        model_flops,
        hw.peak_tflops * 1e12,
        dict(moved),
        overhead,
        layer_host,
    )


def _hides(hw: Hardware) -> bool:
    """Whether communication can hide under compute. CPU ranks (gloo): a collective is the CPU's own
    work (copies, sums, the socket loop) on cores the ranks' compute already fills; it hides under
    nothing. Devices compute while their links move data."""
    return not (hw.profile and not hw.profile.on_gpu)


def _model_parallel_exposed(
    m: ModelConfig,
    L: Layout,
    hw: Hardware,
    runtime: Runtime,
    c: Constants,
    busiest: BusiestCompute,
    time: dict,
    seq_len: int,
) -> tuple[float, float, float, float, float]:
    """(tp, cp, ep, pp, bubble) seconds of `step_time`: the model-parallel collectives' seconds in `time`
    (by part; a defaultdict) left exposed beside `busiest`'s compute in `runtime` (after `for_layout`),
    and the pipeline bubble on them. Each grows with the seconds in `time`: priced on the
    model-parallel collectives alone, they are a lower bound of the step's (`step_floor`)."""
    compute, attention, micro = busiest.compute, busiest.attention, busiest.micro
    hides = _hides(hw)
    # overlapped tp communication hides under the region's GEMMs, never more than they last
    tp_hidden = c.tp_overlap if runtime.tp_overlap and hides else 0.0
    tp = time["tp"] - min(time["tp"] * tp_hidden, compute - attention)
    # the ring hides behind the attention blocks; Ulysses' all-to-alls stand between the projections and them
    cp = (max(0.0, time["cp"] - attention) if hides else time["cp"]) + time["cp_a2a"]
    ep, pp = time["ep"], time["pp"]
    if runtime.ep_overlap and hides:  # two chunks: a dispatch and a combine stay exposed, the rest under the experts
        ep = max(ep / 2, ep - compute * expert_share(m, seq_len, per_token=busiest.per_token))
    if hw.profile and hw.profile.dimension_s:  # what fived adds for a dimension (measured)
        passes = busiest.layers * micro * (1 + busiest.recompute)
        tp, cp, ep = _unpriced_dimensions(hw, m, L, passes, (tp, cp, ep))
    bubble = 0.0
    if L.pp > 1:
        frac = pipeline_profile(L.pp_schedule, L.pp, L.pp_virtual, micro)[0]
        # a rank idles frac of the step; ranks sharing cores run in each other's idle time: the step is
        # the busiest rank's work, or its critical path at a whole core if that is longer
        bubble = (compute + tp + cp + ep + pp) * max(0.0, hw.core_share / (1 - frac) - 1)
        if hw.profile and hw.profile.dimension_s:  # what fived adds per micro-batch for pp (measured, its waits
            pp += hw.profile.dimension_s.get("pp", 0.0) * micro / hw.core_share  # included: not in the bubble)
    return tp, cp, ep, pp, bubble


def _unpriced_dimensions(hw: Hardware, m: ModelConfig, L: Layout, layer_passes: float, times: tuple) -> tuple:
    """(tp, cp, ep) seconds with what a machine profile measured fived's layers adding per layer and
    micro-batch for each dimension in use beyond its priced collectives (ep: MoE layers only), at the
    ranks' share of a core (`layer_passes`: the busiest rank's layers x micro-batches x recomputation)."""
    assert hw.profile is not None
    extra, (tp, cp, ep) = hw.profile.dimension_s, times
    passes_at_share = layer_passes / hw.core_share
    if L.tp > 1:
        tp += extra.get("tp", 0.0) * passes_at_share
    if L.cp > 1:
        cp += extra.get("cp", 0.0) * passes_at_share
    if L.ep > 1 and m.is_moe:
        ep += extra.get("ep", 0.0) * passes_at_share * (m.n_layers - m.n_dense_layers) / m.n_layers
    return tp, cp, ep


def _ranks_unpriced(hw: Hardware, m: ModelConfig, layer_passes: float) -> float:
    """What a machine profile measured its ranks adding beyond what the model prices for them (its
    data-parallel bases, all ranks at once: `fived.tools.calibrate_ranks.unpriced_dimensions`), per layer and
    micro-batch (`layer_passes`: the busiest rank's layers x micro-batches x recomputation, MoE ones in
    the model's proportion) and per step, a MoE model's beyond a dense one's; at the ranks' share of a
    core."""
    assert hw.profile is not None
    ranks_layer, ranks_step, moe_layer, moe_step = (hw.profile.dimension_s.get(k, 0.0) for k in RANKS_KEYS)
    seconds = ranks_step + ranks_layer * layer_passes
    if m.is_moe:
        seconds += moe_step + moe_layer * layer_passes * (m.n_layers - m.n_dense_layers) / m.n_layers
    return seconds / hw.core_share


@dataclass(frozen=True)
class BusiestCompute:
    """The busiest pipeline rank's compute, the first term of `step_time` (every other term is >= 0, so
    it is a lower bound of the step: the search prunes by it)."""

    micro: int
    tokens: int
    per_token: float
    model_flops: float
    pp_rank: int
    chunks: list
    layers: int
    recompute: float  # the extra forward share full checkpointing adds
    compute: float
    attention: float


def compute_seconds(
    model: ModelConfig,
    layout: Layout,
    cluster: Cluster,
    seq_len: int,
    global_batch: int,
    dtype: str = "bfloat16",
    runtime: Runtime = FIVED,
    *,
    constants: Constants | None = None,
) -> float:
    """`step_time(...).compute`, without pricing the rest: a lower bound of `step_time(...).total`."""
    if constants is not None:  # (a fit's constants record what they are asked: no memo)
        return _busiest_compute(
            model, layout, cluster, seq_len, global_batch, dtype, for_layout(runtime, layout), constants
        ).compute
    c = CALIBRATION.constants
    return busiest_compute(model, layout, cluster, seq_len, global_batch, dtype, runtime, c).compute


def attention_seconds(
    model: ModelConfig,
    layout: Layout,
    cluster: Cluster,
    seq_len: int,
    global_batch: int,
    dtype: str = "bfloat16",
    runtime: Runtime = FIVED,
) -> float:
    """The busiest rank's attention kernels' seconds in `step_time(...).compute` (the kernels the
    runtime calls: what benchmarks/bench_window_cp.py compares with a measurement)."""
    c = CALIBRATION.constants
    return _busiest_compute(
        model, layout, cluster, seq_len, global_batch, dtype, for_layout(runtime, layout), c
    ).attention


def step_floor(
    model: ModelConfig,
    layout: Layout,
    cluster: Cluster,
    seq_len: int,
    global_batch: int,
    dtype: str = "bfloat16",
    runtime: Runtime = FIVED,
    *,
    collectives: bool = False,
) -> float:
    """A lower bound of `step_time(...).total`: the compute and the pipeline bubble on it, as
    `step_time` prices them (`_model_parallel_exposed`), without the data-parallel collectives,
    optimizer and host terms (each >= 0). It reads only `compute_key`; with `collectives`, also the
    model-parallel collectives left exposed beside the compute (and the bubble on them; the
    data-parallel collectives would only add to these parts, each of which grows with them): a
    tighter bound that reads `model_parallel_values` too (the switches `for_layout` sets are there)."""
    c, L = CALIBRATION.constants, layout
    busiest = busiest_compute(model, L, cluster, seq_len, global_batch, dtype, runtime, c)
    runtime = for_layout(runtime, L)
    time: dict = defaultdict(float)
    if collectives:
        key, mp_runtime = model_key(model), model_parallel_runtime(runtime)
        time.update(
            model_parallel_seconds(key, L, cluster, seq_len, global_batch, dtype, mp_runtime, c, busiest.pp_rank)[0]
        )
    tp, cp, ep, pp, bubble = _model_parallel_exposed(model, L, cluster.hardware, runtime, c, busiest, time, seq_len)
    return busiest.compute + tp + cp + ep + pp + bubble


# The layout fields `compute_seconds` and `step_floor` (without collectives) read (`_busiest_compute`,
# `_compute`): layouts alike in them compute alike (the search prices each distinct compute once). The
# runtime switches that `for_layout` sets from a layout (overlaps, the ZeRO-2 reduction's timing) are not
# read there. (An attrgetter: its tuple is built in C, ~2x10^4 times a 70B plan.)
compute_key: Callable[[Layout], tuple] = attrgetter(
    "dp",
    "tp",
    "pp",
    "cp",
    "cp_mode",
    "cp_ulysses",
    "ep",
    "etp",
    "sp",
    "pp_schedule",
    "pp_virtual",
    "pp_layers",
    "micro_batch",
    "checkpointing",
)


_BUSIEST: dict[tuple, tuple] = {}


def busiest_compute(
    m: ModelConfig,
    L: Layout,
    cluster: Cluster,
    seq_len: int,
    global_batch: int,
    dtype: str,
    runtime: Runtime,
    c: Constants,
) -> BusiestCompute:
    """`_busiest_compute` of `L` in `runtime` (before `for_layout`: it reads none of the switches that
    sets), once per model, `compute_key` and pricing inputs: a search's layouts that differ in ZeRO,
    HSDP or overlaps share it. The cluster and constants are keyed by identity and kept in the entry
    (alive, so no other object takes their id while it is there)."""
    k = (model_key(m), compute_key(L), id(cluster), seq_len, global_batch, dtype, runtime, id(c))
    found = _BUSIEST.get(k)
    if found is None:
        if len(_BUSIEST) >= 65536:
            _BUSIEST.clear()
        result = _busiest_compute(m, L, cluster, seq_len, global_batch, dtype, for_layout(runtime, L), c)
        found = _BUSIEST[k] = (cluster, c, result)
    return found[2]


def _busiest_compute(
    m: ModelConfig,
    L: Layout,
    cluster: Cluster,
    seq_len: int,
    global_batch: int,
    dtype: str,
    runtime: Runtime,
    c: Constants,
) -> BusiestCompute:
    micro = L.microbatches(global_batch)
    tokens = global_batch * seq_len
    key = model_key(m)
    per_token = _flops_per_token(key, seq_len)
    model_flops = per_token * tokens
    share, pp_rank, layer_fraction = _busiest_rank(key, L.pp, placement(L.pp_schedule), L.n_stages, L.pp_layers)
    chunks = rank_chunks_by_key(key, L.pp, placement(L.pp_schedule), L.n_stages, pp_rank, L.pp_layers)
    layers_here = sum(len(layers) for layers, _, _ in chunks)
    recompute = layer_fraction / 3 if L.checkpointing == "full" else 0.0
    flops_gpu = model_flops * (1 + recompute) * share / L.stage_ranks
    compute, attention = _compute(
        m,
        L,
        cluster.hardware,
        runtime,
        dtype,
        seq_len,
        micro,
        layers_here,
        flops_gpu,
        1 + recompute,
        c,
        per_token=per_token,
    )
    return BusiestCompute(
        micro, tokens, per_token, model_flops, pp_rank, chunks, layers_here, recompute, compute, attention
    )


def exposed_reduction(
    dense: float,
    experts: float,
    gathers: float,
    compute: float,
    micro: int,
    *,
    every_microbatch: bool,
    experts_last_only: bool,
) -> float:
    """The overlapped data-parallel communication left exposed (backward: 2/3 of compute, a micro-batch's
    share each). A reduction after the last micro-batch hides under that micro-batch's backward; one per
    micro-batch (ZeRO-2 reducing every micro-batch) under each micro-batch's own. Routed experts' gradients
    reduced apart (fived.parallel.expert_grads) go on the last micro-batch only, sharing its backward with
    that micro-batch's dense reduction; a runtime reducing them in its buckets reduces them alike. The
    parameter gathers hide under all compute."""
    window = compute * 2 / 3 / micro
    exposed = max(0.0, gathers - compute)
    if not every_microbatch:
        return exposed + max(0.0, dense + experts - window)
    per = dense / micro
    if not experts_last_only:
        return exposed + micro * max(0.0, per + experts / micro - window)
    return exposed + (micro - 1) * max(0.0, per - window) + max(0.0, per + experts - window)


def muon_stream_s(m: ModelConfig, L: Layout, dtype: str, chunks, hw: Hardware) -> float:
    """What Muon's elements on the stage's first rank take beyond the AdamW bytes `step_time` charged
    them: `fived.layout.muon_load.stream_bytes` each, at HBM speed."""
    elements = stage_plan(m, L, dtype, chunks).stored_elements(0)
    per_element = stream_bytes(MOMENT_BYTES[dtype], PRECISION_SPECS[dtype].compute_bytes)
    return (per_element - 28) * elements / (hw.hbm_gbps * 1e9)


def orthogonalization_s(m: ModelConfig, L: Layout, dtype: str, chunks, hw: Hardware, c: Constants) -> float:
    """Muon's Newton-Schulz iterations on the busiest owner of each bucket of the stage (the scatter
    waits for it): its whole matrices' GEMMs (train.muon_ns_steps) at the efficiency of their width."""
    plan = stage_plan(m, L, dtype, chunks)
    steps, peak = L.muon_ns_steps, hw.peak_tflops * 1e12
    total = 0.0
    for first, last in plan.buckets:  # one after another, each as long as its busiest owner
        seconds: dict[int, float] = {}
        for u in plan.units[first:last]:
            side = min(u.rows, u.cols)
            time = ns_flops(u.rows, u.cols, steps) / (peak * efficiency(side, side, hw, c, max(u.rows, u.cols)))
            seconds[u.owner] = seconds.get(u.owner, 0.0) + time
        total += max(seconds.values())
    return total


def _compute(
    m: ModelConfig,
    L: Layout,
    hw: Hardware,
    runtime: Runtime,
    dtype: str,
    seq_len: int,
    micro: int,
    layers: int,
    flops_gpu: float,
    recompute: float,
    c: Constants,
    *,
    per_token: float,
) -> tuple[float, float]:
    """(seconds of the rank's compute, seconds of its attention blocks) for one step."""
    peak = hw.peak_tflops * 1e12
    # (fived's FP8 linears are torchao's, whose casts fuse only under compile: eager, fived's trainer measured
    # 0.49x bf16's tokens/s on one H200, docs/gpu.md; its GEMMs then priced at the compute dtype's rate, a bound)
    fp8 = runtime.fp8 and hw.fp8_tflops > 0 and (runtime.fused or not runtime.is_fived)
    tokens_mb = L.micro_batch * seq_len / L.cp
    dense_eff = efficiency(m.dim / L.tp, tokens_mb, hw, c, m.dim)
    routed = expert_share(m, seq_len, per_token=per_token)
    attn = attention_share(m, seq_len, per_token=per_token)
    expert_rows = tokens_mb * m.top_k * L.ep / max(m.n_experts, 1) * L.tp / L.expert_tp
    # an expert GEMM's narrow side: the hidden or the expert's width (fine-grained experts), over etp
    expert_width = min(m.dim, m.expert_dim) / L.expert_tp
    expert_eff = efficiency(expert_width, expert_rows, hw, c, m.dim) if routed else 1.0
    expert_eff *= 1.0 if hw.profile or not routed else c.expert_efficiency  # (a profile measured the shapes)
    gemm = flops_gpu * ((1 - routed - attn) / dense_eff + routed / expert_eff) / peak
    if fp8:
        gemm /= c.fp8_speedup
    kernel = attn  # (the model's attention FLOPs as the kernels compute them: fived's windowed tiles, more)
    if runtime.is_fived and m.sliding_window:
        kernel *= _kernel_attention_scale(model_key(m), seq_len, L.cp, L.ulysses)
    if runtime.causal_skip and not hw.gemm_efficiency and not hw.profile:  # a fused causal kernel computes half
        kernel /= 2  # the blocks (GPUs; a CPU entry's efficiency was fitted on whole steps, attention priced
        # whole; a profile's measured rate counts the whole score matrix: its skipped blocks are in the rate)
    attention = flops_gpu * kernel / dense_eff / peak
    if hw.profile:  # measured fused causal attention at the rank's sequence (its skipped blocks in the rate)
        attention = flops_gpu * kernel / (hw.profile.attention(seq_len / L.cp, m.head_dim) * hw.core_share)
    local_tokens = micro * tokens_mb * recompute  # tokens this rank computes, times recomputation
    stream, inside, per_ffn = ELEMENTWISE_BYTES["fused" if runtime.fused else "eager"]
    stream += 2 * PYTHON_NORM_EXTRA_BYTES if runtime.python_norm else 0.0
    ffn = m.expert_dim * m.top_k if m.is_moe else m.ffn_dim
    stream_split = L.tp if L.sp else 1  # without SP every tp rank runs the residual stream's work whole
    elementwise = layers * local_tokens * (stream * m.dim / stream_split + (inside * m.dim + per_ffn * ffn) / L.tp)
    moe_layers = layers * (m.n_layers - m.n_dense_layers) / m.n_layers if m.is_moe else 0
    elementwise += moe_layers * local_tokens * m.top_k * DISPATCH_BYTES * m.dim / stream_split
    if L.cp > 1 and not runtime.flash_ring:  # a ring of matmuls: the fp32 score matrix of every block
        heads = m.n_heads / L.tp
        elementwise += layers * micro * recompute * RING_SCORE_PASSES * 4 * heads * tokens_mb * seq_len * L.micro_batch
    # the weights this rank computes with, cast every micro-batch (bf16 weights with masters: none)
    if runtime.autocast_copies and not PRECISION_SPECS[dtype].master:
        layer_params = (4 * m.dim * m.dim + 3 * m.dim * ffn) / L.tp
        elementwise += layers * micro * recompute * AUTOCAST_BYTES * layer_params
    memory_bound = elementwise / (hw.hbm_gbps * 1e9 * HBM_EFFICIENCY)
    if hw.profile:  # at the bandwidth measured for tensors of a micro-batch's activations
        tensor = tokens_mb * m.dim * PRECISION_SPECS[dtype].compute_bytes
        memory_bound = elementwise / (hw.profile.stream_bytes_per_s(tensor) * hw.core_share)
    launches = 0.0
    if m.is_moe and not runtime.grouped_experts:  # a loop over the rank's experts: 3 GEMMs x (fwd, 2 bwd)
        launches = moe_layers * micro * recompute * 9 * (m.n_experts // L.ep) * hw.launch_s
    return gemm + attention + memory_bound + launches, attention


@lru_cache(maxsize=1024)
def _flops_per_token(key: tuple, seq_len: int) -> float:
    return flops_per_token(ModelConfig(**dict(key)), seq_len)


@lru_cache(maxsize=1024)
def _attention_flops(key: tuple, seq_len: int) -> float:
    """`attention_flops_per_token` (a sum over the layers: asked once per layout priced)."""
    return attention_flops_per_token(ModelConfig(**dict(key)), seq_len)


@lru_cache(maxsize=1024)
def _kernel_attention_scale(key: tuple, seq_len: int, cp: int, ulysses: int) -> float:
    """fived's kernels' attention keys over the model's (`fived.layout.flops.kernel_attention_keys`)."""
    cfg = ModelConfig(**dict(key))
    return kernel_attention_keys(cfg, seq_len, cp, ulysses) / attention_keys(cfg, seq_len)


@lru_cache(maxsize=65536)
def _busiest_rank(key: tuple, pp: int, schedule: str, n_stages: int, pp_layers: str):
    """(its share of the model's cost, its pipeline rank, the layers' share of the cost) for the
    pipeline rank with the most work (the output head counts on the last stage)."""
    from fived.layout.stages import layer_costs

    costs, head = layer_costs(ModelConfig(**dict(key)))
    ranks = [rank_chunks_by_key(key, pp, schedule, n_stages, r, pp_layers) for r in range(pp)]
    shares = [sum(sum(costs[i] for i in layers) + (head if last else 0) for layers, _, last in ch) for ch in ranks]
    busiest = max(range(pp), key=lambda r: shares[r])
    total = sum(costs) + head
    return shares[busiest] / total, busiest, sum(costs) / total
