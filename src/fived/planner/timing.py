"""Step time per GPU for a layout: compute at achievable efficiency, the communication of every mesh
dimension on the link its group actually uses, the overlap the runtime allows, and the pipeline bubble.

    step = (compute + tp + cp_exposed + ep + pp_p2p) / (1 - bubble) + dp_exposed + optimizer

- compute: model FLOPs of the busiest pipeline rank (6 x matmul parameters + attention, per token;
  + one more layer forward with full checkpointing) / (peak x efficiency). `efficiency` is fitted on
  the published runs (`fived.planner.calibration`): the share of peak large transformer GEMMs reach,
  lowered for narrow per-GPU matrices (hidden/tp) by `width / (width + WIDTH_HALF)` and for short
  ones by `rows / (rows + ROWS_HALF)`: rows are a micro-batch's tokens, and for routed experts the
  tokens each expert receives (top_k/E of them, times ep: expert parallelism gathers an expert's
  tokens from ep ranks — what makes it faster than running every expert everywhere).
- Links: tp is innermost on the mesh, then cp, then dp, pp outermost (as the runtime's mesh), so a
  group of ranks `stride` apart spanning `size` ranks stays in one node iff stride*size <= gpus per
  node. Inside a node it moves at NVLink speed, across nodes at the GPU's network share, each times
  LINK_EFFICIENCY, plus LATENCY_S per collective.
- Ring collectives (bytes = the full tensor): all-reduce 2(n-1)/n, all-gather and reduce-scatter
  (n-1)/n, all-to-all (n-1)/n of the bytes, over the link bandwidth.
- tp: per layer and micro-batch, without SP 2 all-reduces of activations forward (4 with full
  checkpointing) and 2 of gradients backward; with SP each becomes an all-gather + reduce-scatter
  pair, plus 2 all-gathers re-gathering the regions' inputs in backward. Gradients travel in the
  float32 residual stream (4 bytes in bf16 runs). `Runtime.tp_overlap` of it is hidden (fived: none).
- cp: per layer and micro-batch the ring passes k,v chunks cp-1 times forward (twice with full
  checkpointing) and k,v + their gradients backward; hidden behind the attention blocks it
  overlaps with, the rest exposed.
- ep: per MoE layer and micro-batch, dispatch + combine forward (again when recomputed) and
  backward of top_k x tokens x hidden (backward in the gradient dtype).
- pp: each micro-batch crosses every stage boundary forward and backward (activation send/recv).
- dp: gradients reduced once per step over dp*cp (ZeRO-0 all-reduce; ZeRO-1/2 reduce-scatter +
  parameter all-gather over the dp_shard*cp shard group; ZeRO-3 reduce-scatter + bf16 gathers,
  two per micro-batch, or one per step under pipelines, experts likewise over edp; HSDP adds an
  all-reduce of the shard over replicas); expert gradients all-reduced over edp for ZeRO-0/1/2.
  Where the runtime overlaps, the reduction hides behind the last micro-batch's backward and
  ZeRO-3's prefetched gathers behind the step's compute.
- optimizer: AdamW streams 28 bytes per owned parameter (read p, g, m, v; write p, m, v, fp32).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

from fived.config import ModelConfig
from fived.mesh import SINGLE_STAGE
from fived.metrics import flops_per_token
from fived.planner.hardware import Hardware
from fived.planner.layout import Layout
from fived.planner.memory import ACTIVATION_BYTES, WEIGHT_BYTES, _rank_chunks, model_key, parameter_shapes, placement

GRAD_BYTES = {"bfloat16": 4, "float32": 4, "float64": 8}  # backward activations: the fp32 residual stream
LINK_EFFICIENCY = 0.8  # share of a link's bandwidth ring collectives reach (fitted; NCCL tests report 0.75-0.9)
# Per collective call, assumed (not fitted: the published runs move large messages): NCCL's
# small-message latency is ~10 us inside a node and ~20-30 us across InfiniBand.
LATENCY_S = {"nvlink": 10e-6, "network": 25e-6}
# Fitted on tests/data/published_runs.csv by fived.planner.calibration.fit (see there). B200 and
# MI300X have no published runs in it and use the Hopper figure: uncalibrated.
EFFICIENCY = {"ampere": 0.825, "hopper": 0.725}  # share of dense BF16 peak for wide GEMMs (fitted)
WIDTH_HALF = 256.0  # per-GPU hidden width (dim/tp) at which GEMM efficiency halves (fitted)
ROWS_HALF = 128.0  # tokens per GEMM (micro-batch, or routed to one expert) at which it halves (fitted)


@dataclass(frozen=True)
class Runtime:
    """What a training runtime overlaps and in which dtypes it communicates. FIVED is this project's
    runtime as built; the calibration describes the published runs' frameworks with the same fields."""

    tp_overlap: float = 0.0  # share of tensor-parallel communication hidden behind GEMMs
    grad_overlap: bool = True  # ZeRO-0 (DDP) / ZeRO-3 (FSDP2) reduce during the last backward (pp=1)
    zero12_overlap: bool = False  # ZeRO-1/2 reduce-scatter overlapped with backward
    pipeline_grad_overlap: bool = False  # the dp reduction overlapped under pipeline schedules
    reduce_bytes: int = 4  # gradient reduction dtype (fived: float32)
    gather_bytes: int = 4  # ZeRO-1/2 parameter all-gather dtype (fived: the float32 weights)


FIVED = Runtime()


@dataclass(frozen=True)
class Cluster:
    hardware: Hardware
    gpus: int
    gpus_per_node: int


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

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.tp + self.cp + self.ep + self.pp + self.dp + self.optimizer

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens / self.total / self.world

    @property
    def mfu(self) -> float:
        return self.model_flops / self.total / self.world / self.peak_flops

    def to_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("tokens", "world", "model_flops", "peak_flops")}
        return {**out, "total": self.total, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "mfu": self.mfu}


def _link(cluster: Cluster, stride: int, size: int) -> tuple[float, float]:
    """(bytes/s, latency) for a group of `size` ranks `stride` apart on the mesh: NVLink when the
    group's span stays inside one node (and nodes hold whole spans), else the network."""
    hw = cluster.hardware
    if size == 1 or in_node(cluster.gpus_per_node, stride, size):
        return hw.nvlink_gbps * 1e9 * LINK_EFFICIENCY, LATENCY_S["nvlink"]
    return hw.network_gbps * 1e9 * LINK_EFFICIENCY, LATENCY_S["network"]


def _ring(kind: str, nbytes: float, n: int, link: tuple[float, float]) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
              "all_to_all": (n - 1) / n}[kind]
    return factor * nbytes / link[0] + link[1]


EXACT_ROUNDS = 3  # micro-batches per pipeline rank simulated exactly; beyond, the idle time is constant


@lru_cache(maxsize=65536)
def pipeline_profile(schedule: str, pp: int, virtual: int, microbatches: int) -> tuple[float, tuple[float, ...]]:
    """(bubble fraction, in-flight micro-batches per rank) from the schedule simulator. Past
    EXACT_ROUNDS*pp micro-batches the fill and drain idle time no longer changes (steady state), so
    the simulation at that size is extrapolated: bubble = idle / (idle + 3m) with unit costs F=1,
    B=2; in-flight counts stay put (or grow with m, as GPipe's, if they grew over the last pp).
    tests/test_planner.py checks the extrapolation against the full simulation."""
    from fived.parallel.schedule_sim import _analyse

    cap = EXACT_ROUNDS * pp
    if microbatches <= cap or (microbatches % pp and schedule not in SINGLE_STAGE):
        # (looped multi-stage schedules settle into a different steady state when m is not a
        # multiple of pp: simulated in full)
        return _analyse(schedule, pp, virtual, microbatches)
    bubble, flight = _analyse(schedule, pp, virtual, cap)
    _, before = _analyse(schedule, pp, virtual, cap - pp)
    idle = bubble / (1 - bubble) * 3 * cap
    grow = [(a - b) / pp for a, b in zip(flight, before)]
    return idle / (idle + 3 * microbatches), tuple(f + g * (microbatches - cap) for f, g in zip(flight, grow))


def in_node(gpus_per_node: int, stride: int, size: int) -> bool:
    """A mesh group of `size` ranks `stride` apart lies inside one node."""
    span = stride * size
    return span <= gpus_per_node and gpus_per_node % span == 0


def efficiency(width: float, rows: float, hw: Hardware) -> float:
    """Share of peak a GEMM with `rows` tokens and a per-GPU hidden `width` reaches."""
    return EFFICIENCY[hw.calibration] * width / (width + WIDTH_HALF) * rows / (rows + ROWS_HALF)


def expert_share(m: ModelConfig, seq_len: int) -> float:
    """Share of the model FLOPs spent in routed experts (their GEMMs see only the tokens routed
    to them: top_k/E of a micro-batch per expert, times ep when expert parallelism gathers them)."""
    if not m.is_moe:
        return 0.0
    n_moe = m.n_layers - m.n_dense_layers
    return 6 * 3 * m.dim * m.expert_dim * m.top_k * n_moe / flops_per_token(m, seq_len)


def step_time(model: ModelConfig, layout: Layout, cluster: Cluster, seq_len: int, global_batch: int,
              dtype: str = "bfloat16", runtime: Runtime = FIVED) -> StepTime:
    hw, L, m = cluster.hardware, layout, model
    e = ACTIVATION_BYTES[dtype]
    micro = L.microbatches(global_batch)
    tokens = global_batch * seq_len
    per_token = flops_per_token(m, seq_len)
    model_flops = per_token * tokens
    share, chunks, layer_fraction = _busiest_rank(model_key(m), L.pp, placement(L.pp_schedule), L.n_stages)
    layers_here = sum(len(layers) for layers, _, _ in chunks)
    recompute = layer_fraction / 3 if L.checkpointing == "full" else 0.0
    flops_gpu = model_flops * (1 + recompute) * share / (L.dp * L.cp * L.tp)
    peak = hw.peak_tflops * 1e12
    tokens_mb = L.micro_batch * seq_len / L.cp
    dense_eff = efficiency(m.dim / L.tp, tokens_mb, hw)
    routed = expert_share(m, seq_len)
    expert_eff = efficiency(m.dim / L.tp, tokens_mb * m.top_k * L.ep / max(m.n_experts, 1), hw) if routed else 1.0
    compute = flops_gpu * ((1 - routed) / dense_eff + routed / expert_eff) / peak

    # tensor parallelism: per layer and micro-batch on this rank. Forward collectives move
    # activations (e bytes), backward ones gradients of the residual stream (float32 in bf16 runs).
    act, grad = tokens_mb * m.dim * e, tokens_mb * m.dim * GRAD_BYTES[dtype]
    tp_link = _link(cluster, 1, L.tp)
    full = L.checkpointing == "full"
    fwd = 2 * (1 + full)  # region entries/exits forward (again when the block is recomputed)
    if L.sp:  # forward AG + RS per region; backward RS + AG of gradients, AG re-gathering each input
        per = fwd * (_ring("all_gather", act, L.tp, tp_link) + _ring("reduce_scatter", act, L.tp, tp_link)) \
            + 2 * (_ring("reduce_scatter", grad, L.tp, tp_link) + _ring("all_gather", grad, L.tp, tp_link)) \
            + 2 * _ring("all_gather", act, L.tp, tp_link)
    else:
        per = fwd * _ring("all_reduce", act, L.tp, tp_link) + 2 * _ring("all_reduce", grad, L.tp, tp_link)
    tp = per * layers_here * micro * (1 - runtime.tp_overlap)

    # context parallelism: ring passes of k,v (forward) and k,v + grads (backward), hidden by attention
    cp = 0.0
    if L.cp > 1:
        kv_local = (m.n_kv_heads // L.tp if m.n_kv_heads % L.tp == 0 else 1) * m.head_dim
        chunk = 2 * L.micro_batch * seq_len / L.cp * kv_local * e
        link = _link(cluster, L.tp, L.cp)
        # k,v forward (again when recomputed), k,v + their gradients backward
        ring = (1 + full + 2) * (L.cp - 1) * (chunk / link[0] + link[1])
        # QK^T and AV, forward and backward: 12 * heads * head_dim * seq FLOPs per token and layer
        # (the MFU convention of metrics.flops_per_token, causal mask not discounted)
        attention = 12 * m.n_heads * m.head_dim * seq_len
        attention_time = attention * tokens_mb / L.tp / (peak * dense_eff)
        cp = max(0.0, ring - attention_time) * layers_here * micro

    # expert parallelism: all-to-all of the routed tokens, per MoE layer and micro-batch
    ep = 0.0
    if L.ep > 1:
        moe_here = sum(1 for layers, _, _ in chunks for i in layers if i >= m.n_dense_layers)
        routed = tokens_mb * m.top_k * m.dim
        link = _link(cluster, L.tp, L.ep)
        ep = (fwd * _ring("all_to_all", routed * e, L.ep, link) + 2 * _ring("all_to_all", routed * GRAD_BYTES[dtype], L.ep, link)) \
            * moe_here * micro

    # pipeline: activations across each stage boundary, forward and backward, per micro-batch
    pp, bubble = 0.0, 0.0
    if L.pp > 1:
        boundary = L.micro_batch * seq_len / L.cp / (L.tp if L.sp else 1) * m.dim * e
        link = _link(cluster, L.tp * L.cp * L.dp, L.pp)
        pp = 2 * micro * len(chunks) * (boundary / link[0] + link[1])
        frac = pipeline_profile(L.pp_schedule, L.pp, L.pp_virtual, micro)[0]
        bubble = (compute + tp + cp + ep + pp) * frac / (1 - frac)

    dp, optimizer = _data_parallel(m, L, cluster, runtime, chunks, compute, micro, dtype)
    return StepTime(compute, bubble, tp, cp, ep, pp, dp, optimizer, tokens, L.world, model_flops, peak)


@lru_cache(maxsize=65536)
def _busiest_rank(key: tuple, pp: int, schedule: str, n_stages: int):
    """(its share of the model's cost, its chunks, the layers' share of the cost) for the pipeline
    rank with the most work (the output head counts on the last stage)."""
    from fived.parallel.pipeline import layer_costs

    costs, head = layer_costs(ModelConfig(**dict(key)))
    ranks = [_rank_chunks(key, pp, schedule, n_stages, r) for r in range(pp)]
    shares = [sum(sum(costs[i] for i in layers) + (head if last else 0) for layers, _, last in ch) for ch in ranks]
    busiest = max(range(pp), key=lambda r: shares[r])
    total = sum(costs) + head
    return shares[busiest] / total, ranks[busiest], sum(costs) / total


def _data_parallel(m: ModelConfig, L: Layout, cluster: Cluster, runtime: Runtime, chunks,
                   compute: float, micro: int, dtype: str) -> tuple[float, float]:
    """(exposed seconds of the gradient reduction and parameter gathers, optimizer seconds)."""
    n = n_exp = 0
    for c in chunks:
        dense, expert = parameter_shapes(m, L.tp, L.ep, *c)
        n += sum(r * c * k for (r, c), k in dense)
        n_exp += sum(r * c * k for (r, c), k in expert)
    group, shards = L.dp * L.cp, L.dp_shard * L.cp  # gradients reduced over dp*cp, sharded over dp_shard*cp
    link, shard_link = _link(cluster, L.tp, group), _link(cluster, L.tp, shards)
    r, g = runtime.reduce_bytes, runtime.gather_bytes
    owned = n / shards if L.zero else n
    edp = group // L.ep
    expert_link = _link(cluster, L.tp * L.ep, edp)
    gathers = 0.0  # ZeRO-3's parameter all-gathers: prefetched, hidden behind compute
    if L.zero == 0:
        reduce = _ring("all_reduce", n * r, group, link)
    elif L.zero in (1, 2):
        reduce = _ring("reduce_scatter", n * r, shards, shard_link) + _ring("all_gather", n * g, shards, shard_link)
    else:  # FSDP2 gathers in the compute dtype: per micro-batch forward + backward, once under pipelines
        times = 1 if L.pp > 1 else 2 * micro
        pe = 2 if dtype == "bfloat16" else WEIGHT_BYTES[dtype]
        reduce = _ring("reduce_scatter", n * r, shards, shard_link)
        gathers = times * _ring("all_gather", n * pe, shards, shard_link)
        if n_exp:
            reduce += _ring("reduce_scatter", n_exp * r, edp, expert_link)
            gathers += times * _ring("all_gather", n_exp * pe, edp, expert_link)
    if L.dp_replicate > 1:
        reduce += _ring("all_reduce", n / shards * r, L.dp_replicate, _link(cluster, L.tp * shards, L.dp_replicate))
    if n_exp and L.zero < 3:
        reduce += _ring("all_reduce", n_exp * r, edp, expert_link)
    overlap = (runtime.grad_overlap and L.zero in (0, 3)) or (runtime.zero12_overlap and L.zero in (1, 2))
    if L.pp > 1:
        overlap = runtime.pipeline_grad_overlap
    if overlap:  # the reduction behind the last micro-batch's backward, the gathers behind all compute
        reduce = max(0.0, reduce - compute * 2 / 3 / micro)
        gathers = max(0.0, gathers - compute)
    optimizer = 28 * (owned + n_exp / (edp if L.zero == 3 else 1)) / (cluster.hardware.hbm_gbps * 1e9)
    return reduce + gathers, optimizer
