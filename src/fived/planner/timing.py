"""Step time per GPU for a layout: compute at achievable efficiency, the communication of every mesh
dimension on the link its group actually uses, the overlap the runtime allows, and the pipeline bubble.

    step = (compute + tp + cp_exposed + ep + pp_p2p) / (1 - bubble) + dp_exposed + optimizer

- compute: model FLOPs of the busiest pipeline rank (6 x matmul parameters + attention, per token;
  + one more layer forward with full checkpointing) / (peak x efficiency). `efficiency` is fitted on
  the published runs (`fived.planner.calibration`): the share of peak large transformer GEMMs reach,
  lowered for narrow per-GPU matrices (hidden/tp) by `width / (width + WIDTH_HALF)`.
- Links: tp is innermost on the mesh, then cp, then dp, pp outermost (as the runtime's mesh), so a
  group of ranks `stride` apart spanning `size` ranks stays in one node iff stride*size <= gpus per
  node. Inside a node it moves at NVLink speed, across nodes at the GPU's network share, each times
  LINK_EFFICIENCY, plus LATENCY_S per collective.
- Ring collectives (bytes = the full tensor): all-reduce 2(n-1)/n, all-gather and reduce-scatter
  (n-1)/n, all-to-all (n-1)/n of the bytes, over the link bandwidth.
- tp: per layer and micro-batch, without SP 4 all-reduces of the activations (6 with full
  checkpointing); with SP 6 all-gathers + 4 reduce-scatters (+2+2 with full checkpointing).
  `Runtime.tp_overlap` of it is hidden (fived: none).
- cp: per layer and micro-batch the ring passes k,v chunks cp-1 times forward and k,v + their
  gradients backward; hidden behind the attention blocks it overlaps with, the rest exposed.
- ep: per MoE layer and micro-batch, dispatch + combine forward and backward (4 all-to-alls, 6 with
  full checkpointing) of top_k x tokens x hidden.
- pp: each micro-batch crosses every stage boundary forward and backward (activation send/recv).
- dp: gradients reduced once per step over dp*cp (ZeRO-0 all-reduce; ZeRO-1/2 reduce-scatter +
  parameter all-gather; ZeRO-3 reduce-scatter + two gathers per micro-batch, or one per step when
  kept gathered; HSDP adds an all-reduce of the shard over replicas); expert gradients over edp.
  The runtime hides the reduction behind the last micro-batch's backward where it overlaps.
- optimizer: AdamW streams 28 bytes per owned parameter (read p, g, m, v; write p, m, v, fp32).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

from fived.config import ModelConfig
from fived.metrics import flops_per_token
from fived.planner.hardware import Hardware
from fived.planner.layout import Layout
from fived.planner.memory import ACTIVATION_BYTES, _rank_chunks, model_key, parameter_shapes, placement

LINK_EFFICIENCY = 0.9  # share of a link's bandwidth ring collectives reach (fitted; NCCL tests report 0.75-0.9)
LATENCY_S = {"nvlink": 10e-6, "network": 25e-6}  # per collective call
# Fitted on ../shared/calibration/published_runs.csv by fived.planner.calibration.fit (see there).
EFFICIENCY = {"ampere": 0.75, "hopper": 0.85}  # share of dense BF16 peak for wide GEMMs (fitted)
WIDTH_HALF = 256.0  # per-GPU hidden width (dim/tp) at which GEMM efficiency halves (fitted)


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
    """(bytes/s, latency) for a group of `size` ranks `stride` apart on the mesh."""
    hw = cluster.hardware
    if stride * size <= cluster.gpus_per_node:
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
    if microbatches <= cap:
        return _analyse(schedule, pp, virtual, microbatches)
    bubble, flight = _analyse(schedule, pp, virtual, cap)
    _, before = _analyse(schedule, pp, virtual, cap - pp)
    idle = bubble / (1 - bubble) * 3 * cap
    grow = [(a - b) / pp for a, b in zip(flight, before)]
    return idle / (idle + 3 * microbatches), tuple(f + g * (microbatches - cap) for f, g in zip(flight, grow))


def efficiency(model: ModelConfig, layout: Layout, hw: Hardware) -> float:
    width = model.dim / layout.tp
    return EFFICIENCY[hw.calibration] * width / (width + WIDTH_HALF)


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
    compute = flops_gpu / (peak * efficiency(m, L, hw))

    # tensor parallelism: per layer and micro-batch on this rank
    act = L.micro_batch * seq_len / L.cp * m.dim * e
    tp_link = _link(cluster, 1, L.tp)
    full = L.checkpointing == "full"
    if L.sp:
        per = (6 + 2 * full) * _ring("all_gather", act, L.tp, tp_link) + (4 + 2 * full) * _ring("reduce_scatter", act, L.tp, tp_link)
    else:
        per = (4 + 2 * full) * _ring("all_reduce", act, L.tp, tp_link)
    tp = per * layers_here * micro * (1 - runtime.tp_overlap)

    # context parallelism: ring passes of k,v (forward) and k,v + grads (backward), hidden by attention
    cp = 0.0
    if L.cp > 1:
        kv_local = (m.n_kv_heads // L.tp if m.n_kv_heads % L.tp == 0 else 1) * m.head_dim
        chunk = 2 * L.micro_batch * seq_len / L.cp * kv_local * e
        link = _link(cluster, L.tp, L.cp)
        ring = 3 * (L.cp - 1) * (chunk / link[0] + link[1])
        attention = 12 * m.n_layers * m.n_heads * m.head_dim * seq_len / m.n_layers  # per token, one layer
        attention_time = attention * L.micro_batch * seq_len / L.cp / L.tp / (peak * efficiency(m, L, hw))
        cp = max(0.0, ring - attention_time) * layers_here * micro

    # expert parallelism: all-to-all of the routed tokens, per MoE layer and micro-batch
    ep = 0.0
    if L.ep > 1:
        moe_here = sum(1 for layers, _, _ in chunks for i in layers if i >= m.n_dense_layers)
        routed = L.micro_batch * seq_len / L.cp * m.top_k * m.dim * e
        ep = (4 + 2 * full) * _ring("all_to_all", routed, L.ep, _link(cluster, L.tp, L.ep)) * moe_here * micro

    # pipeline: activations across each stage boundary, forward and backward, per micro-batch
    pp, bubble = 0.0, 0.0
    if L.pp > 1:
        boundary = L.micro_batch * seq_len / L.cp / (L.tp if L.sp else 1) * m.dim * e
        link = _link(cluster, L.tp * L.cp * L.dp, L.pp)
        pp = 2 * micro * len(chunks) * (boundary / link[0] + link[1])
        frac = pipeline_profile(L.pp_schedule, L.pp, L.pp_virtual, micro)[0]
        bubble = (compute + tp + cp + ep + pp) * frac / (1 - frac)

    dp, optimizer = _data_parallel(m, L, cluster, runtime, chunks, compute, micro)
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
                   compute: float, micro: int) -> tuple[float, float]:
    n = n_exp = 0
    for c in chunks:
        dense, expert = parameter_shapes(m, L.tp, L.ep, *c)
        n += sum(r * c * k for (r, c), k in dense)
        n_exp += sum(r * c * k for (r, c), k in expert)
    group = L.dp * L.cp
    shards = L.dp_shard * L.cp
    link = _link(cluster, L.tp, group)
    r, g = runtime.reduce_bytes, runtime.gather_bytes
    owned = n / shards if L.zero else n
    if L.zero == 0:
        comm = _ring("all_reduce", n * r, group, link)
    elif L.zero in (1, 2):
        comm = _ring("reduce_scatter", n * r, shards, link) + _ring("all_gather", n * g, shards, link)
    else:
        gathers = 1 if L.pp > 1 else 2 * micro
        comm = _ring("reduce_scatter", n * r, shards, link) + gathers * _ring("all_gather", n * 2, shards, link)
    if L.dp_replicate > 1:
        comm += _ring("all_reduce", n / shards * r, L.dp_replicate, _link(cluster, L.tp * shards, L.dp_replicate))
    edp = group // L.ep
    if n_exp and edp > 1:
        comm += _ring("all_reduce" if L.zero < 3 else "reduce_scatter", n_exp * r, edp, _link(cluster, L.tp * L.ep, edp))
    overlap = (runtime.grad_overlap and L.zero in (0, 3)) or (runtime.zero12_overlap and L.zero in (1, 2))
    if L.pp > 1:
        overlap = runtime.pipeline_grad_overlap
    if overlap:  # hidden behind the last micro-batch's backward (ZeRO-3's gathers behind compute)
        comm = max(0.0, comm - compute * (2 / 3 if L.zero < 3 else 1.0) / (1 if L.zero == 3 else micro))
    optimizer = 28 * (owned + n_exp / (edp if L.zero == 3 else 1)) / (cluster.hardware.hbm_gbps * 1e9)
    return comm, optimizer
