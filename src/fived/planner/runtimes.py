"""What a training runtime does with a layout: which communication it overlaps, in which dtypes it
communicates and keeps the model state, how it stores activations, and which kernels it has.

`FIVED` is this project's runtime as built, before a layout's switches: in bf16 runs bf16 weights and
gradients with fp32 master weights and Adam state in the optimizer (train.dtype=bfloat16;
bfloat16-autocast: fp32 weights with a bf16 copy of each weight per forward), gradients reduced in
parallel.reduce_dtype (float32 by default), eager PyTorch kernels (unfused RMSNorm, RoPE, SwiGLU),
SDPA (flash on GPU) and a ring of fused attention blocks with context parallelism, experts in a loop
(their CPU path), no FP8.
What fived overlaps is the layout's to say (`for_layout`):
- always: ZeRO-0's bucketed all-reduce and FSDP2's (ZeRO-3) reduce-scatter during the last backward
  (pp=1), FSDP2's prefetched all-gathers, the context-parallel ring's send/recv under each block;
- parallel.tp_overlap: the tp/sp regions' all-gather / reduce-scatter (all-reduce without sp) in
  chunks under the GEMMs forward, the input gradient's reduction under the weight-gradient GEMMs in
  backward (priced as hiding Megatron-Core's fitted share; fived's own share never measured on a GPU);
- parallel.overlap_grad_reduce: ZeRO-1/2's bucketed reduce-scatter during the last backward (with
  parallel.zero2_reduce_every_microbatch: ZeRO-2's during every micro-batch's backward), and the
  dp reduction of each pipeline stage from that stage's last backward (parallel.overlap_param_gather:
  ZeRO-1/2's bucketed all-gather under the next forward); outside ZeRO-3 also the routed experts'
  edp all-reduce, one MoE layer at a time as its expert gradients are final (Megatron-Core's
  expert-data-parallel buckets; without the switch one call after backward, priced exposed);
- parallel.ep_overlap: the expert all-to-all of one chunk under the other chunk's expert GEMMs.
`fived_runtime` adds what a run's `train.compile` (fused element-wise kernels, activations as
Korthikanti et al. count them) and `train.fp8` (torchao float8 GEMMs; weights, gradients and
communication stay in the compute dtype) change; `PLANNED_RUNTIMES["fived"]` is what `fived plan`
recommends on GPUs: compiled blocks, a rank's experts in one grouped GEMM (CUDA bf16), every overlap
switch that applies (`with_overlap`).

The published runs the planner is calibrated on ran other runtimes; `framework_runtime` describes
each from what its row states (framework, precision, ZeRO/FSDP wording, overlap flags), with these
documented defaults:
- Megatron-LM 2021/2022: bf16/fp16 weights, fp32 main gradients, fp32 master weights and Adam in
  the (distributed) optimizer, gradients reduced in fp32 after the backward, no tp overlap, fused
  kernels (apex), activations as Korthikanti et al. count them, the masked score matrix computed whole
  (no flash attention).
- Megatron-Core (2023+, Transformer Engine): the same state, fused kernels and flash attention;
  --overlap-grad-reduce / --overlap-param-gather / --tp-comm-overlap as the row says; grouped GEMM
  experts with --moe-grouped-gemm (else its default, SequentialMLP: a loop over a rank's experts);
  causal attention in a fused kernel (flash attention, Transformer Engine); FP8 GEMMs when the row's
  precision says FP8.
- PyTorch FSDP (FSDP1/FSDP2, torchtitan-style or HF): fp32 sharded parameters gathered in bf16
  (float8 all-gather with FP8), reductions overlapped, eager kernels unless compiled.
- Context parallelism, in every runtime that has it (Megatron-Core, torch's context_parallel as
  torchtitan runs it, DeepSpeed-Ulysses, InternEvo, ...): fused attention per block (`flash_ring`);
  no published runtime runs a ring of plain matmuls with the score matrix in memory.
- DeepSpeed ZeRO, InternEvo, PaddlePaddle and other ZeRO-style runtimes: bf16 weights and gradients,
  fp32 master and Adam sharded by stage, ZeRO-2 reducing every micro-batch's gradients; reductions
  overlapped (Paddle's sharding stages: not, before PaddleNLP added it in 2024); fused kernels unless
  the model is Hugging Face's or the row's norm is unfused (use_fused_rms_norm=False).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING

from fived.planner.layout_cache import kept_hash, state_without_kept_hash

if TYPE_CHECKING:
    from fived.config import TrainConfig


@dataclass(frozen=True)
class Runtime:
    name: str = "fived"
    # what it overlaps
    tp_overlap: bool = False  # tensor-parallel communication hidden behind GEMMs, as much as Megatron-Core's
    #   --tp-comm-overlap hides (a calibrated share: fived.planner.constants)
    grad_overlap: bool = True  # ZeRO-0 (DDP) / ZeRO-3 (FSDP) reduce during the last backward (pp=1)
    zero12_overlap: bool = False  # ZeRO-1/2 reduce-scatter overlapped with backward
    pipeline_grad_overlap: bool = False  # the dp reduction overlapped under pipeline schedules
    # ZeRO-2 reduce-scatters every micro-batch's gradients into the partitioned ones (DeepSpeed, Paddle's
    # sharding stage 2, Megatron-FSDP; fived with parallel.zero2_reduce_every_microbatch), not the step's once;
    # their routed experts' gradients with them (fived's: on the last micro-batch only, fived.parallel.expert_grads)
    reduce_per_microbatch: bool = False
    # communication dtypes, bytes (0: fived's rule — see fived.planner.communication)
    reduce_bytes: int = 0  # gradient reduction
    gather_bytes: int = 0  # ZeRO-1/2 parameter all-gather (ZeRO-3 gathers in the compute dtype)
    residual_bytes: int = 0  # residual stream: tp region inputs, their gradients, pipeline sends
    # model state, bytes per parameter (0: fived's rule, fived.planner.memory.state_element_bytes)
    param_bytes: int = 0  # weights as the model holds them
    grad_bytes: int = 0  # gradients as accumulated
    master_bytes: int = 0  # a separate fp32 master copy, sharded like the optimizer state
    autocast_copies: bool = True  # fived (bfloat16-autocast): bf16 copies of the weights live through the forward
    activations: str = "fived"  # fived: fived.layout.activation_model; megatron: Korthikanti et al. (flash)
    # kernels
    fused: bool = False  # fused norm / RoPE / activation kernels (Transformer Engine, apex, compile)
    python_norm: bool = False  # unfused: RMSNorm written out in Python ops (Hugging Face's LlamaRMSNorm,
    #   Paddle's without use_fused_rms_norm), not one kernel
    fp8: bool = False  # FP8 GEMMs (Transformer Engine, torchao float8)
    ep_overlap: bool = False  # expert all-to-all of one chunk of tokens under another's expert GEMMs
    # one grouped GEMM for a rank's experts (fived: on CUDA in bf16 only; priced as its CPU loop)
    grouped_experts: bool = False
    flash_ring: bool = False  # context-parallel blocks with a fused attention kernel (fived: yes)
    # causal attention in a fused kernel that skips the blocks above the diagonal (FlashAttention, cuDNN /
    # Transformer Engine fused attention, SDPA's flash kernel): half the QK^T and AV FLOPs the papers count
    # (fived.layout.flops.flops_per_token) are computed. Megatron-LM 2021/2022 materialise the score matrix and
    # mask it (Korthikanti et al.'s selective recomputation exists for it): the whole count
    causal_skip: bool = True
    # routed experts' gradients (outside ZeRO-3) reduced over edp during backward like the dense ones
    # (Megatron-Core's expert-data-parallel buckets); fived keeps them apart from its flat buffer and
    # reduces them per MoE layer during the last backward with parallel.overlap_grad_reduce
    # (fived.parallel.expert_grads), else in one call after it (`for_layout` sets it from the switch)
    expert_grad_overlap: bool = True
    # [tokens, vocab] float32 gradients alive at once in the loss's backward, beside what it saved: fived's
    # (torch's cross_entropy) the log-probabilities' and the logits' (tests/test_memory_peak.py; fived's
    # vocab-parallel loss under tp: `memory._loss_backward_bytes`); another framework's fused or
    # vocab-parallel loss is assumed to hold one, as the planner always had
    loss_gradients: int = 1

    @property
    def is_fived(self) -> bool:
        return self.name == "fived"

    __hash__ = kept_hash
    __getstate__ = state_without_kept_hash


FIVED = Runtime(flash_ring=True, expert_grad_overlap=False, loss_gradients=2)


def fived_runtime(fp8: str = "none", *, compiled: bool = False) -> Runtime:
    """fived's runtime for a run's `train.fp8` and `train.compile`: FP8 GEMMs (torchao's float8 linears;
    weights still gathered and reduced in the compute dtype) priced at the FP8 rate where compiled, at
    the compute dtype's uncompiled (`timing._compute`); compiled blocks price their element-wise work as
    fused kernels, and their saved activations by Korthikanti et al.'s count, which bounds what a
    compiled block keeps (inductor's partitioner recomputes the element-wise ops in backward; measured
    in tests/test_activations.py)."""
    if not compiled:
        return replace(FIVED, fp8=fp8 != "none")
    return replace(FIVED, fp8=fp8 != "none", fused=True, activations="megatron")


def compiles_fused(train: TrainConfig) -> bool:
    """Whether a run's blocks compile to fused kernels: `train.compile` with inductor (`aot_eager`
    traces and generates no code: its kernels, and torchao's float8 casts, run as eager ones)."""
    return train.compile and train.compile_backend == "inductor"


def train_runtime(train: TrainConfig, *, gpu: bool) -> Runtime:
    """The runtime a `fived train` run of `train` runs, to price it with: its `fp8`, its blocks' kernels
    fused where they compile (`compiles_fused`), and on a GPU in bf16 a rank's experts in one grouped
    GEMM (`fived.model.grouped_gemm.uses_grouped_mm`; a CPU rank loops over them)."""
    runtime = fived_runtime(train.fp8, compiled=compiles_fused(train))
    return replace(runtime, grouped_experts=gpu and train.dtype == "bfloat16")


def for_layout(runtime: Runtime, layout) -> Runtime:
    """What `runtime` overlaps on `layout`: fived overlaps what the layout's switches turn on
    (parallel.tp_overlap, overlap_grad_reduce — ZeRO-1/2, the dp reduction under pipelines and the
    experts' edp reduction —, ep_overlap); another runtime's row states its own."""
    if not runtime.is_fived:
        return runtime
    return _fived_switches(
        runtime, layout.tp_overlap, layout.overlap_grad_reduce, layout.zero2_reduce_every_microbatch, layout.ep_overlap
    )


@lru_cache(maxsize=256)
def _fived_switches(runtime: Runtime, tp_overlap: bool, grad_reduce: bool, every_micro: bool, ep: bool) -> Runtime:
    # fived's tp overlap (the same chunked all-gather/reduce-scatter under the GEMMs, the same bulk
    # overlap in backward) is priced as hiding Megatron-Core's calibrated share: never measured on a GPU
    return replace(
        runtime,
        tp_overlap=tp_overlap,
        zero12_overlap=grad_reduce,
        pipeline_grad_overlap=grad_reduce,
        reduce_per_microbatch=every_micro,
        expert_grad_overlap=grad_reduce,
        ep_overlap=ep,
    )


def reduces_every_microbatch(runtime: Runtime, layout) -> bool:
    """Whether ZeRO-2 reduce-scatters each micro-batch's gradients: the runtime's way, or for fived
    the layout's switch (read here too when `runtime` did not go through `for_layout`)."""
    every = runtime.reduce_per_microbatch or (runtime.is_fived and layout.zero2_reduce_every_microbatch)
    return layout.zero == 2 and every


OVERLAP_SWITCHES = ("tp_overlap", "overlap_grad_reduce", "overlap_param_gather", "ep_overlap")  # (what it sets)


def with_overlap(layout, *, fp8: bool = False):
    """`layout` with every overlap switch fived has that applies to it turned on (the planner's
    recommendation, as Megatron-Core's recipes turn theirs on): tp overlap (not with FP8 linears,
    which it cannot run yet), the bucketed ZeRO-1/2 reductions and gathers, each pipeline stage's dp
    reduction (ZeRO-0 under pp too; ZeRO-0 alone and ZeRO-3 overlap without a switch), the routed
    experts' edp reduction (ZeRO-0/1/2, edp > 1), the expert all-to-all in chunks."""
    experts_apart = layout.zero < 3 and layout.ep > 1 and layout.edp > 1
    return layout.with_(
        tp_overlap=layout.tp > 1 and not fp8,
        overlap_grad_reduce=(layout.dp_cp > 1 and layout.flat_buffer) or experts_apart,
        overlap_param_gather=layout.zero in (1, 2) and layout.shards > 1,
        ep_overlap=layout.ep > 1,
    )


_MEGATRON = Runtime(
    name="megatron",
    causal_skip=False,
    grad_overlap=False,
    reduce_bytes=4,
    gather_bytes=2,
    residual_bytes=2,
    param_bytes=2,
    grad_bytes=4,
    master_bytes=4,
    autocast_copies=False,
    activations="megatron",
    fused=True,
)
_FSDP = Runtime(
    name="fsdp",
    flash_ring=True,
    grad_overlap=True,
    reduce_bytes=4,
    gather_bytes=2,
    residual_bytes=2,
    param_bytes=4,
    grad_bytes=4,
    autocast_copies=False,
    activations="megatron",
    fused=False,
)

# `fived plan --runtime`: fived's, or (to compare) a published framework's
PLANNED_RUNTIMES = {
    # on GPUs: blocks compiled (train.compile), a rank's experts in one grouped GEMM (CUDA, bf16)
    "fived": replace(fived_runtime(compiled=True), grouped_experts=True),
    "fived-eager": replace(fived_runtime(), grouped_experts=True),
    "fived-fp8": replace(fived_runtime("rowwise", compiled=True), grouped_experts=True),
    # (ZeRO-2 there is Megatron-FSDP's optim_grads: gradients sharded, so each micro-batch's are reduce-
    # scattered into the shard, as FSDP's; its distributed optimizer proper is ZeRO-1)
    "megatron-core": replace(
        _MEGATRON,
        name="megatron-core",
        causal_skip=True,
        tp_overlap=True,
        grad_overlap=True,
        zero12_overlap=True,
        pipeline_grad_overlap=True,
        grouped_experts=True,
        flash_ring=True,
        reduce_per_microbatch=True,
    ),
}
PLANNED_RUNTIMES["megatron-core-fp8"] = replace(PLANNED_RUNTIMES["megatron-core"], fp8=True)
PLANNED_RUNTIMES["fsdp"] = replace(_FSDP, fused=True)  # torch.compile'd, as torchtitan-style runs
PLANNED_RUNTIMES["fsdp-fp8"] = replace(_FSDP, fused=True, fp8=True, gather_bytes=1)


def planned_runtime(name: str, hardware) -> Runtime:
    """`PLANNED_RUNTIMES[name]` on ranks of `hardware` (a `fived.planner.hardware.Hardware`). On CPU ranks
    (a CPU machine profile's) fived's runtimes are what `fived train` runs there by default: blocks
    uncompiled (train.compile is off by default, and inductor spends tens of seconds compiling a CPU run's
    blocks: 21.8 s for a 3-step tiny run) and a rank's experts in a loop; so the plan's price and its
    `run it` command (no `--train.compile true`) agree with the run a CPU user starts."""
    runtime = PLANNED_RUNTIMES[name]
    on_cpu = hardware.profile is not None and not hardware.profile.on_gpu
    if not (on_cpu and runtime.is_fived):
        return runtime
    return fived_runtime("rowwise" if runtime.fp8 else "none")


# Row fields read to describe its runtime: wording -> ZeRO stage (None: not said)
ZERO_WORDS = (
    ("zero-3", 3),
    ("zero3", 3),
    ("zero_3", 3),
    ("zero stage 3", 3),
    ("full_shard", 3),
    ("hybrid_shard", 3),
    ("hsdp", 3),
    ("fsdp", 3),
    ("shard_grad_op", 2),
    ("zero-2", 2),
    ("zero2", 2),
    ("zero stage 2", 2),
    ("distributed optimizer", 1),
    ("distributed-optimizer", 1),
    ("distrib", 1),
    ("zero-1", 1),
    ("zero1", 1),
    ("zero stage 1", 1),
    ("ddp", 0),
    ("none", 0),
    ("no_shard", 0),
)


def zero_stage(text: str) -> int | None:
    """The ZeRO stage a row's wording names ('FSDP', 'FULL_SHARD', 'SHARD_GRAD_OP', 'ZeRO-3-like',
    'distributed optimizer', 'DDP'...), or None when it names none."""
    t = (text or "").lower()
    for word, stage in ZERO_WORDS:
        if word in t:
            return stage
    m = re.search(r"zero\D{0,3}([0-3])", t)
    return int(m.group(1)) if m else None


def is_fp8(precision: str) -> bool:
    return bool(re.search(r"fp8|float8|e4m3|hybrid", (precision or "").lower()))


def framework_runtime(framework: str, notes: str = "", precision: str = "") -> Runtime:
    """The runtime a published row ran, from its framework, notes and precision columns."""
    text = f"{framework} {notes}".lower()
    fp8 = is_fp8(precision)
    if "fsdp" in text or "torchtitan" in text or "pytorch" in text or "hf " in text:
        compiled = "compile" in text
        return replace(
            _FSDP,
            fused=compiled,
            fp8=fp8,
            gather_bytes=1 if fp8 else 2,
            reduce_bytes=2 if "reduce in bf16" in text else 4,
        )
    if "megatron-lm (2021)" in text or "megatron-lm (2022)" in text:
        return _MEGATRON
    if "megatron" in text or "nemo" in text or "flagscale" in text:
        overlap = "--tp-comm-overlap" in text
        return replace(
            _MEGATRON,
            name="megatron-core",
            causal_skip=True,  # flash attention (--use-flash-attn) or Transformer Engine's fused attention
            tp_overlap=overlap,
            grad_overlap="--overlap-grad-reduce" in text or overlap,
            zero12_overlap="--overlap-grad-reduce" in text or overlap,
            pipeline_grad_overlap="--overlap-grad-reduce" in text or overlap,
            # Megatron-Core runs a rank's experts as one grouped GEMM only with --moe-grouped-gemm; without
            # it, SequentialMLP: a loop over the local experts, a kernel launch per expert GEMM
            grouped_experts="--moe-grouped-gemm" in text,
            flash_ring=True,
            fp8=fp8,
        )
    # DeepSpeed ZeRO, InternEvo, PaddlePaddle and other ZeRO-style runtimes: bf16 weights and gradients,
    # fp32 master weights and Adam in the (sharded) optimizer, ZeRO-2 reducing every micro-batch,
    # overlapped reductions (Paddle's sharding: not before PaddleNLP's sharding overlap, 2024); fused
    # kernels unless the model is Hugging Face's or the row says its norm is unfused
    eager = "hugging face" in text or "transformers" in text or "fused_rms_norm=false" in text
    overlapped = "overlap_comm false" not in text and "paddle" not in text
    return replace(
        _FSDP,
        name="zero-style",
        param_bytes=2,
        grad_bytes=2,
        master_bytes=4,
        fused=not eager,
        python_norm=eager,
        zero12_overlap=overlapped,
        grad_overlap="overlap_comm false" not in text,
        fp8=fp8,
        reduce_per_microbatch=True,
    )


def framework_activations(m, layout, seq_len: int, layers, first: bool, last: bool) -> int:
    """Bytes one micro-batch saves for backward in a Megatron-style runtime (Korthikanti et al. 2022,
    sec. 4, with flash attention: no s^2 term), bf16, for a rank's `layers` (+ embedding, head).
    Per token of the B = micro_batch * seq_len / cp a rank computes on, t = tp (etp for experts):
      replicated: the two norms' and the two blocks' inputs, two dropout masks: 10h (/t with SP)
      split over t: q and the attention output 2h + 2h, k and v 4 kv_dim, the MLP's gate, up and
                    activation outputs 6f (GeLU MLPs of width F: 4F, the same for f = 2F/3)
      MoE layers: top_k slots of the permuted input 2h and the expert's 6 f_e / etp, the router's
                    fp32 logits 4E (folded, etp 1 under SP: of the B/t tokens a rank routes), shared
                    experts 6 f_s / t
      full checkpointing keeps the layer input 2h (/t with SP); selective = none (flash attention)
      head: bf16 logits and their fp32 softmax, 6 V / t"""
    L = layout
    tokens = L.micro_batch * seq_len // L.cp
    t, h = L.tp, m.dim
    split_sp = t if L.sp else 1
    kv_dim = m.n_kv_heads * m.head_dim
    total = 0.0
    for i in layers:
        if L.checkpointing == "full":
            total += 2 * h / split_sp
            continue
        moe = m.is_moe and i >= m.n_dense_layers
        if moe:  # (folded: each tp rank routes its own B/t tokens of the sequence shard)
            ffn = (m.top_k * (2 * h + 6 * m.expert_dim / L.expert_tp) + 4 * m.n_experts) / (t if L.folded else 1)
            ffn += 6 * m.expert_dim * m.n_shared_experts / t
        else:
            ffn = 6 * m.ffn_dim / t
        total += 10 * h / split_sp + (4 * h + 4 * kv_dim) / t + ffn
    if first:
        total += 2 * h / split_sp
    if last:
        total += 6 * m.vocab_size / t + 2 * h / split_sp
    return round(total * tokens)
