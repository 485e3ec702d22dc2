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
- tp: per layer and micro-batch, without SP 2 all-reduces of the regions' outputs forward (4 with
  full checkpointing) and 2 of their inputs' gradients backward; with SP each becomes an
  all-gather + reduce-scatter pair (+ the backward re-gather of inputs outside bf16). Dtypes as
  the runtime moves them (see step_time). `Runtime.tp_overlap` of it is hidden (fived: none).
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

from collections import defaultdict
from dataclasses import asdict, dataclass
from functools import lru_cache

from fived.config import ModelConfig
from fived.metrics import flops_per_token
from fived.planner.hardware import Hardware
from fived.mesh import Layout
from fived.parallel.schedule_sim import pipeline_profile
from fived.planner.memory import ACTIVATION_BYTES, WEIGHT_BYTES, model_key, parameter_shapes, placement, rank_chunks_by_key

GRAD_BYTES = WEIGHT_BYTES  # the residual stream and its gradients: float32 in bf16 runs, like the weights
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
    reduce_bytes: int = 0  # gradient reduction dtype; 0: fived's (float32, float64 in float64 runs)
    gather_bytes: int = 0  # ZeRO-1/2 parameter all-gather dtype; 0: the weights' (float32 / float64)


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
    comm_bytes: dict = None  # bytes per mesh dimension this rank moves in one step (ledger convention)

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
        out = {k: v for k, v in asdict(self).items() if k not in ("tokens", "world", "model_flops", "peak_flops",
                                                                   "comm_bytes")}
        return {**out, "total": self.total, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "mfu": self.mfu}


def _link(cluster: Cluster, stride: int, size: int) -> tuple[float, float]:
    """(bytes/s, latency) for a group of `size` ranks `stride` apart on the mesh: NVLink when the
    group's span stays inside one node (and nodes hold whole spans), else the network."""
    hw = cluster.hardware
    if size == 1 or in_node(cluster.gpus_per_node, stride, size):
        return hw.nvlink_gbps * 1e9 * LINK_EFFICIENCY, LATENCY_S["nvlink"]
    return hw.network_gbps * 1e9 * LINK_EFFICIENCY, LATENCY_S["network"]


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

    comm = Collectives(cluster)
    full = L.checkpointing == "full"
    fwd = 1 + full  # forward collectives happen again when a checkpointed block is recomputed
    first, last = any(c[1] for c in chunks), any(c[2] for c in chunks)

    # tensor parallelism, per micro-batch: 2 regions per layer. A region's input (a norm's output)
    # and every gradient flowing back into the residual stream are float32 in bf16 runs (autocast
    # computes matmuls in bf16: their outputs, and the gradients of those, are bf16). The embedding's
    # exit and the head's entry are one region boundary each (float32); the loss all-reduces 3
    # floats per token. Under SP, float32/float64 runs re-gather each region's input in backward;
    # bf16 runs do not (every linear keeps its own bf16 copy of the gathered input).
    wide = tokens_mb * m.dim * GRAD_BYTES[dtype]  # float32 (float64) tensors
    narrow = tokens_mb * m.dim * e  # matmul outputs and their gradients
    if L.tp > 1:
        calls = micro * (1 - runtime.tp_overlap)
        regions = 2 * layers_here
        if L.sp:
            regather = 0 if dtype == "bfloat16" else regions + last
            comm.add("tp", "all_gather", wide, L.tp, 1, calls * (fwd * regions + last + first + regather))
            comm.add("tp", "all_gather", narrow, L.tp, 1, calls * regions)  # exit gradients
            comm.add("tp", "reduce_scatter", narrow, L.tp, 1, calls * fwd * regions)  # exits
            comm.add("tp", "reduce_scatter", wide, L.tp, 1, calls * (regions + last + first))
        else:
            comm.add("tp", "all_reduce", narrow, L.tp, 1, calls * fwd * regions)
            comm.add("tp", "all_reduce", wide, L.tp, 1, calls * (regions + last + first))
        comm.add("tp", "all_reduce", tokens_mb * 4, L.tp, 1, calls * 3 * last)

    # context parallelism, per layer and micro-batch: k,v chunks pass cp-1 hops forward (again when
    # recomputed); backward k,v and the dK,dV accumulators pass cp-1 hops, then dK,dV a final one.
    # The ring hides behind the attention blocks it overlaps with; the rest is exposed.
    cp = 0.0
    if L.cp > 1:
        kv_local = (m.n_kv_heads // L.tp if m.n_kv_heads % L.tp == 0 else 1) * m.head_dim
        chunk = 2 * tokens_mb * kv_local * e
        hops = fwd * (L.cp - 1) + 2 * (L.cp - 1) + 1
        ring = comm.add("cp", "send", chunk, L.cp, L.tp, hops * layers_here * micro) / (layers_here * micro)
        # QK^T and AV, forward and backward: 12 * heads * head_dim * seq FLOPs per token and layer
        # (the MFU convention of metrics.flops_per_token, causal mask not discounted)
        attention_time = 12 * m.n_heads * m.head_dim * seq_len * tokens_mb / L.tp / (peak * dense_eff)
        cp = max(0.0, ring - attention_time) * layers_here * micro

    # expert parallelism, per MoE layer and micro-batch: dispatch + combine of the routed tokens,
    # forward (again when recomputed) and backward (in the gradient dtype)
    if L.ep > 1:
        moe_here = sum(1 for layers, _, _ in chunks for i in layers if m.is_moe and i >= m.n_dense_layers)
        slots = tokens_mb * m.top_k * m.dim
        comm.add("ep", "all_to_all", slots * e, L.ep, L.tp, 2 * fwd * moe_here * micro)
        comm.add("ep", "all_to_all", slots * GRAD_BYTES[dtype], L.ep, L.tp, 2 * moe_here * micro)

    # pipeline: activations across each stage boundary, forward and backward, per micro-batch
    bubble = 0.0
    if L.pp > 1:
        boundary = tokens_mb / (L.tp if L.sp else 1) * m.dim * e
        comm.add("pp", "send", boundary, 2, L.tp * L.cp * L.dp, 2 * micro * len(chunks))
    _data_parallel(m, L, comm, runtime, chunks, micro, dtype)
    dp = comm.time["dp"]
    overlap = (runtime.grad_overlap and L.zero in (0, 3)) or (runtime.zero12_overlap and L.zero in (1, 2))
    if L.pp > 1:
        overlap = runtime.pipeline_grad_overlap
    if overlap:  # the reduction behind the last micro-batch's backward, the gathers behind all compute
        dp = max(0.0, dp - compute * 2 / 3 / micro) + max(0.0, comm.time["dp_gather"] - compute)
    else:
        dp += comm.time["dp_gather"]
    tp, ep, pp = comm.time["tp"], comm.time["ep"], comm.time["pp"]
    if L.pp > 1:
        frac = pipeline_profile(L.pp_schedule, L.pp, L.pp_virtual, micro)[0]
        bubble = (compute + tp + cp + ep + pp) * frac / (1 - frac)
    optimizer = 28 * comm.owned / (cluster.hardware.hbm_gbps * 1e9)
    return StepTime(compute, bubble, tp, cp, ep, pp, dp, optimizer, tokens, L.world, model_flops, peak,
                    dict(comm.bytes))


class Collectives:
    """Seconds and bytes of the collectives of one step on the busiest rank, by mesh dimension.
    Bytes follow the ledger's convention: the full tensor of each call (a reduce-scatter's input,
    an all-gather's output, a send's tensor)."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.time: dict[str, float] = defaultdict(float)
        self.bytes: dict[str, float] = defaultdict(float)
        self.owned = 0.0  # parameters this rank's optimizer steps

    def add(self, dim: str, kind: str, nbytes: float, size: int, stride: int, calls: float) -> float:
        """`calls` collectives of `nbytes` over a group of `size` ranks `stride` apart; their seconds."""
        if size <= 1 or calls <= 0 or nbytes <= 0:
            return 0.0
        bandwidth, latency = _link(self.cluster, stride, size)
        factor = 1.0 if kind == "send" else _RING[kind](size)
        seconds = calls * (factor * nbytes / bandwidth + latency)
        self.time[dim] += seconds
        self.bytes[dim.replace("_gather", "")] += calls * nbytes
        return seconds


_RING = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
         "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n}


@lru_cache(maxsize=65536)
def _busiest_rank(key: tuple, pp: int, schedule: str, n_stages: int):
    """(its share of the model's cost, its chunks, the layers' share of the cost) for the pipeline
    rank with the most work (the output head counts on the last stage)."""
    from fived.parallel.pipeline import layer_costs

    costs, head = layer_costs(ModelConfig(**dict(key)))
    ranks = [rank_chunks_by_key(key, pp, schedule, n_stages, r) for r in range(pp)]
    shares = [sum(sum(costs[i] for i in layers) + (head if last else 0) for layers, _, last in ch) for ch in ranks]
    busiest = max(range(pp), key=lambda r: shares[r])
    total = sum(costs) + head
    return shares[busiest] / total, ranks[busiest], sum(costs) / total


def _data_parallel(m: ModelConfig, L: Layout, comm: Collectives, runtime: Runtime, chunks, micro: int,
                   dtype: str) -> None:
    """The gradient reduction ("dp") and ZeRO-3's prefetched parameter gathers ("dp_gather") of one
    step, and the parameters this rank's optimizer owns."""
    n = n_exp = 0
    for c in chunks:
        dense, expert = parameter_shapes(m, L.tp, L.ep, *c)
        n += sum(r * c * k for (r, c), k in dense)
        n_exp += sum(r * c * k for (r, c), k in expert)
    group, shards = L.dp * L.cp, L.dp_shard * L.cp  # gradients reduced over dp*cp, sharded over dp_shard*cp
    r = runtime.reduce_bytes or (8 if dtype == "float64" else 4)
    g = runtime.gather_bytes or WEIGHT_BYTES[dtype]
    edp = group // L.ep
    if L.zero == 0:
        comm.add("dp", "all_reduce", n * r, group, L.tp, 1)
    elif L.zero in (1, 2):
        comm.add("dp", "reduce_scatter", n * r, shards, L.tp, 1)
        comm.add("dp", "all_gather", n * g, shards, L.tp, 1)
    else:  # FSDP2 gathers in the compute dtype: per micro-batch everything for forward and the blocks
        # again for backward (the root — embedding, final norm, head — stays gathered), or once
        # for the step under pipelines (kept gathered)
        root = sum(rows * cols * k for _, first, last in chunks
                   for (rows, cols), k in parameter_shapes(m, L.tp, L.ep, (), first, last)[0])
        gathered = 2 if dtype == "bfloat16" else WEIGHT_BYTES[dtype]
        times = 1 if L.pp > 1 else micro
        comm.add("dp", "reduce_scatter", n * r, shards, L.tp, 1)
        comm.add("dp_gather", "all_gather", (n if L.pp > 1 else 2 * n - root) * gathered, shards, L.tp, times)
        comm.add("dp", "reduce_scatter", n_exp * r, edp, L.tp * L.ep, 1)
        comm.add("dp_gather", "all_gather", n_exp * gathered, edp, L.tp * L.ep, times * (1 if L.pp > 1 else 2))
    if L.dp_replicate > 1:
        comm.add("dp", "all_reduce", n / shards * r, L.dp_replicate, L.tp * shards, 1)
    if L.zero < 3:
        comm.add("dp", "all_reduce", n_exp * r, edp, L.tp * L.ep, 1)
    comm.owned = (n / shards if L.zero else n) + n_exp / (edp if L.zero == 3 else 1)
