"""Typed configuration: one dataclass per section, presets, TOML files and command-line overrides.

Precedence, lowest first: dataclass defaults < model preset < TOML file < command line.
The dataclass defaults below are the single source of truth; presets only list what they change.
Every field carries a one-line description (`option`), which `fived train --help`, the README's
field table and the comments of a run's config.toml all show (`fived.config_docs`); a field's
allowed values are its annotation's (a `Literal` for each choice).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import sys
import typing
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from fived.errors import ConfigError  # (the one-line error; defined torch-free beside the others)

# The choice fields' values (the layout's and the checks' names for them are these: fived.layout.layout)
PPSchedule = Literal["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev"]
Precision = Literal["float32", "bfloat16", "bfloat16-autocast", "float64"]
ReduceDtype = Literal["float32", "bfloat16"]
Checkpointing = Literal["none", "full", "selective"]
Fp8Recipe = Literal["none", "tensorwise", "rowwise"]
CompileBackend = Literal["inductor", "aot_eager", "eager"]
LrSchedule = Literal["cosine", "wsd", "constant", "linear"]
Optimizer = Literal["adamw", "muon"]
CpMode = Literal["ring", "ulysses", "hybrid"]
CpBalance = Literal["work", "halves"]
MuonScale = Literal["rms", "spectral", "none"]
Device = Literal["auto", "cpu", "cuda"]
OnSpike = Literal["stop", "rollback"]
TrackerName = Literal["none", "wandb", "mlflow"]
RopeScaling = Literal["none", "llama3", "yarn", "linear"]
FfnActivation = Literal["silu", "gelu-tanh"]
RouterScore = Literal["softmax", "sigmoid"]
ExpertKind = Literal["swiglu", "gpt-oss"]
ZeroStage = Literal[0, 1, 2, 3]


def option(default: Any, doc: str, *, key: str | None = None) -> Any:
    """A config field: its default and its one-line description. `key`: its name in TOML files and
    flags where the attribute name cannot be it (a Python keyword)."""
    return field(default=default, metadata={"doc": doc, **({"key": key} if key else {})})


@dataclass(frozen=True)
class ModelConfig:
    name: str = option("tiny", "the preset the model's shape starts from (the fields below override it)")
    vocab_size: int = option(256, "tokens in the vocabulary (rows of the embedding and the output head)")
    dim: int = option(64, "hidden size of the residual stream")
    n_layers: int = option(4, "transformer blocks")
    n_heads: int = option(4, "attention (query) heads")
    n_kv_heads: int = option(2, "key/value heads (grouped-query attention; n_heads: multi-head attention)")
    ffn_dim: int = option(128, "hidden size of the dense SwiGLU feed-forward")
    rope_theta: float = option(10000.0, "base of the rotary position embedding's frequencies")
    # Llama 3.1's rotary scaling: long wavelengths divided by rope_factor, a smooth ramp between
    # rope_original_max_len/rope_low_freq_factor and .../rope_high_freq_factor
    rope_scaling: RopeScaling = option(
        "none", "rotary scaling of long wavelengths (llama3: Llama 3.1's; yarn: DeepSeek-V3's; linear: Gemma 3's)"
    )
    rope_factor: float = option(8.0, "rotary scaling's factor (llama3, yarn: long wavelengths'; linear: every one)")
    rope_low_freq_factor: float = option(
        1.0, "llama3 scaling: wavelengths above rope_original_max_len / this are scaled"
    )
    rope_high_freq_factor: float = option(
        4.0, "llama3 scaling: wavelengths below rope_original_max_len / this are kept"
    )
    rope_original_max_len: int = option(
        8192, "llama3 and yarn scaling: the context length the model was first trained at"
    )
    # YaRN (as DeepSeek-V3 and transformers' "yarn" rope): frequencies between the beta_fast and
    # beta_slow rotations over rope_original_max_len ramp from kept to divided by rope_factor; the
    # mscales set the cos/sin gain and the softmax scale's correction (fived.model.rope)
    rope_beta_fast: float = option(32.0, "yarn scaling: frequencies above this many rotations are kept")
    rope_beta_slow: float = option(1.0, "yarn scaling: frequencies below this many rotations are divided")
    rope_truncate: bool = option(True, "yarn scaling: round the ramp's ends outwards (GPT-OSS: false)")
    rope_mscale: float = option(0.0, "yarn scaling: mscale (0: absent; cos/sin gain 0.1 ln(factor) + 1)")
    rope_mscale_all_dim: float = option(
        0.0, "yarn scaling: mscale_all_dim (> 0: softmax scale times (0.1 x this x ln(factor) + 1)^2)"
    )
    head_size: int = option(0, "features per attention head; 0: dim // n_heads (Qwen3 sets its own)")
    qk_norm: bool = option(False, "RMSNorm over each query and key head before the rotation (Qwen3)")
    norm_eps: float = option(1e-5, "RMSNorm's epsilon")
    # Multi-head latent attention (DeepSeek-V2/V3, fived.model.latent_attention): keys and values are
    # up-projected per head from a shared latent of kv_lora_rank, plus one rotary key all heads share
    kv_lora_rank: int = option(0, "> 0: multi-head latent attention, keys and values from a latent of this rank")
    q_lora_rank: int = option(0, "latent attention: rank of the query's low-rank projection; 0: one plain projection")
    qk_nope_head_dim: int = option(128, "latent attention: features per query/key head without rotation")
    qk_rope_head_dim: int = option(64, "latent attention: rotated features per head (the shared key's too)")
    v_head_dim: int = option(128, "latent attention: features per value head")
    # Local attention (Mistral, Gemma 3, GPT-OSS): a windowed layer's query sees its own and the
    # sliding_window - 1 tokens before it; window_pattern says which layers, cycled over the stack
    # (w: windowed, g: global; "w": every layer, "wg": GPT-OSS's alternation, "wwwwwg": Gemma 3's)
    sliding_window: int = option(0, "keys a windowed layer's query sees (itself included); 0: no windows")
    window_pattern: str = option("w", "layers' kinds cycled over the stack: w windowed, g global (e.g. wg)")
    attention_sinks: bool = option(False, "a learned logit per head joins every softmax with no value (GPT-OSS)")
    attention_bias: bool = option(False, "biases on the query, key, value and output projections (GPT-OSS)")
    # Gemma 3 (fived.hf.gemma3): its windowed layers rotate with their own base and no scaling, norms
    # scale by 1 + weight, the attention's and feed-forward's outputs are normed before the residual
    # add, the embedding is multiplied by sqrt(dim), GeGLU (tanh gelu) feed-forwards
    rope_local_theta: float = option(0.0, "rotary base of the windowed layers, unscaled; 0: the global layers' rotary")
    norm_offset: bool = option(False, "RMSNorm scales by 1 + weight (weights start at 0: Gemma)")
    post_norms: bool = option(
        False, "RMSNorm on the attention's and feed-forward's outputs too, before the residual add"
    )
    embed_scale: bool = option(False, "the embedding's output is multiplied by sqrt(dim) (Gemma)")
    ffn_activation: FfnActivation = option("silu", "the dense feed-forward's gate: silu (SwiGLU) or gelu-tanh (GeGLU)")
    attn_scale_dim: float = option(0.0, "scores are q.k / sqrt(this); 0: head_dim (Gemma 3's query_pre_attn_scalar)")
    final_softcap: float = option(0.0, "logits become cap x tanh(logits / cap) (final_logit_softcapping); 0: none")
    tie_embeddings: bool = option(False, "the output head shares the input embedding's weights")
    init_std: float = option(0.02, "standard deviation of the initial weights")
    n_experts: int = option(0, "routed experts per mixture-of-experts layer; 0: a dense model")
    top_k: int = option(2, "experts each token is routed to")
    moe_ffn_dim: int = option(0, "hidden size of one routed expert; 0: ffn_dim")
    n_shared_experts: int = option(0, "experts every token goes through (hidden size moe_ffn_dim each)")
    n_dense_layers: int = option(0, "the first n layers keep a dense feed-forward (DeepSeek style)")
    route_norm: bool = option(True, "renormalise the top-k routing weights to sum to 1")
    # DeepSeek-V3: sigmoid scores (normalised over the experts for the balancing statistics), experts
    # chosen within the topk_expert_groups groups whose two best scores sum highest
    router_score: RouterScore = option("softmax", "the router's scores: softmax over experts, or each's sigmoid")
    n_expert_groups: int = option(1, "group-limited routing: the routed experts form this many equal groups")
    topk_expert_groups: int = option(1, "group-limited routing: a token's experts come from this many groups")
    routed_scaling: float = option(1.0, "the routed experts' output is multiplied by this (DeepSeek-V3: 2.5)")
    # GPT-OSS (fived.model.gpt_oss_experts): a router with a bias; experts with biases and a clamped
    # SwiGLU, gate * sigmoid(swiglu_alpha * gate) * (up + 1), gate <= swiglu_limit, |up| <= swiglu_limit
    expert_kind: ExpertKind = option("swiglu", "routed experts: swiglu, or gpt-oss (biases, clamped SwiGLU)")
    swiglu_alpha: float = option(1.702, "gpt-oss experts: the sigmoid's gain on the gate")
    swiglu_limit: float = option(7.0, "gpt-oss experts: the gate's upper clamp and the up projection's +-clamp")
    capacity_factor: float = option(
        0.0, "0: dropless; > 0: an expert drops tokens beyond this x tokens x top_k / n_experts"
    )
    aux_loss_coef: float = option(0.01, "weight of the load-balancing loss (per-sequence statistics)")
    router_bias_rate: float = option(
        0.0, "> 0: aux-loss-free balancing (DeepSeek-V3): each expert's bias steps by this"
    )
    # DeepSeek-V3's multi-token prediction (fived.model.mtp): D sequential modules on the last stage
    mtp_depth: int = option(0, "multi-token prediction modules (module k predicts token t+k+1); 0: off")
    mtp_loss_weight: float = option(0.3, "multi-token prediction: lambda x the depths' mean cross-entropy is added")

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def rope_dim(self) -> int:
        """Rotated features per head (latent attention rotates only part of each head)."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    def layer_window(self, layer_id: int) -> int:
        """Keys a query of layer `layer_id` sees at most (itself included); 0: all before it."""
        pattern = self.window_pattern or "w"
        return self.sliding_window if pattern[layer_id % len(pattern)] == "w" else 0

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def expert_dim(self) -> int:
        return self.moe_ffn_dim or self.ffn_dim


@dataclass
class ParallelConfig:
    dp: int = option(-1, "data-parallel ranks; -1: whatever the world size leaves after tp x pp x cp")
    tp: int = option(1, "tensor-parallel ranks (attention heads and feed-forward columns split)")
    pp: int = option(1, "pipeline-parallel stages")
    cp: int = option(1, "context-parallel ranks (each sequence split; load-balanced ring attention)")
    ep: int = option(1, "expert-parallel ranks (the routed experts split over dp x cp, or dp x cp x tp with etp 1)")
    zero: ZeroStage = option(0, "0: DDP; 1: optimizer state sharded; 2: + gradients; 3: + parameters (FSDP2)")
    dp_replicate: int = option(1, "HSDP: ZeRO shards span dp / dp_replicate ranks, replicated across the groups")
    reduce_dtype: ReduceDtype = option("float32", "dtype of the gradient reduction in bfloat16 runs")
    zero3_keep_gathered: bool = option(False, "ZeRO-3: keep the gathered weights across micro-batches")
    sp: bool = option(False, "sequence parallelism over the tp ranks (needs tp > 1)")
    pp_schedule: PPSchedule = option("1f1b", "the pipeline schedule")
    pp_virtual: int = option(1, "stages per rank of interleaved-1f1b and zero-bubble (zbv, dualpipev: 2)")
    pp_layers: str = option("", 'layers per stage, e.g. "3,1"; "": balanced by cost')
    # Overlap (as Megatron-Core's --tp-comm-overlap, --overlap-grad-reduce, --overlap-param-gather):
    # tp/sp regions' all-gather / reduce-scatter (all-reduce without sp) run in chunks under the GEMMs
    # in forward, and the input gradient's reduction under the weight-gradient GEMM in backward
    tp_overlap: bool = option(False, "tp/sp collectives in chunks under the GEMMs (Megatron-Core's tp-comm-overlap)")
    # gradients reduced in buckets as soon as their last micro-batch's backward is done (ZeRO-1/2, and
    # the dp reduction of each pipeline stage); ZeRO-0 without pp and ZeRO-3 (FSDP2) always overlap
    overlap_grad_reduce: bool = option(False, "reduce gradients in buckets as soon as their backward is done")
    overlap_param_gather: bool = option(False, "ZeRO-1/2: all-gather parameters in buckets under the next forward")
    # ZeRO-2 as DeepSpeed / Megatron-FSDP's optim_grads: each bucket reduce-scattered into the shard as
    # soon as a micro-batch's backward completes it (fived.parallel.zero_microbatch), not after the last
    zero2_reduce_every_microbatch: bool = option(
        False, "ZeRO-2 with overlap_grad_reduce: reduce-scatter every micro-batch's gradients into the shard"
    )
    # ZeRO-0's all-reduces, and ZeRO-1/2's flat buffer with overlap (each bucket sharded on its own, as
    # Megatron-Core's distributed optimizer)
    bucket_mb: float = option(25.0, "MiB of gradients per reduction bucket")
    ep_overlap: bool = option(False, "expert all-to-all of one chunk of tokens under the expert GEMMs of another")
    # MoE parallel folding (Megatron-Core's expert_tensor_parallel_size=1): the routed experts whole on
    # each rank and ep over dp x cp x tp, each tp rank routing its own sequence shard (needs sp)
    etp: int = option(0, "experts' tp: 0 split like the attention; 1 folded (whole, ep over dp x cp x tp)")
    # Context parallelism (fived.parallel.context): ring (K/V travel around the cp ranks), ulysses
    # (all-to-all: each rank attends the whole sequence for cp-th of the heads) or hybrid (Ulysses
    # inside groups of cp_ulysses consecutive cp ranks, a ring across the groups)
    cp_mode: CpMode = option("ring", "how context parallelism attends: a ring of K/V, Ulysses' all-to-all, or both")
    cp_ulysses: int = option(2, "hybrid context parallelism: ranks per Ulysses group (must divide cp)")
    # "work": chosen per sequence from its documents so that attention work is even (fived.data.documents);
    # "halves": chunks i and 2cp-1-i, even for one causal sequence only; without document masking: halves
    cp_balance: CpBalance = option("work", "with data.document_mask: which sequence chunks a cp rank holds")


@dataclass
class TrainConfig:
    steps: int = option(200, "optimizer steps the run trains to (a resumed run may extend it)")
    seq_len: int = option(64, "tokens per sequence")
    global_batch: int = option(16, "sequences per optimizer step, whatever the layout")
    microbatches: int = option(1, "gradient-accumulation micro-batches per data-parallel rank (pipelines: >= pp)")
    lr: float = option(3e-3, "peak learning rate, reached at the end of the warmup")
    # The lr of a step depends on that step and these fields only (fived.optim.adamw.lr_multiplier); the
    # checkpoint's config holds decay_steps resolved, so extending a run never moves a planned step's lr.
    lr_schedule: LrSchedule = option("cosine", "the learning rate after warmup (wsd: warmup, stable, decay)")
    decay_steps: int = option(0, "the step the lr's decay ends at; 0: train.steps, kept when a resumed run is extended")
    decay_fraction: float = option(0.2, "wsd: the last fraction of decay_steps, where the lr decays (linearly)")
    min_lr_ratio: float = option(0.1, "the lr at the end of the decay, as a fraction of lr")
    warmup_steps: int = option(20, "steps of linear warmup to lr")
    weight_decay: float = option(0.1, "AdamW's decoupled weight decay (matrices only)")
    beta1: float = option(0.9, "AdamW's beta1")
    beta2: float = option(0.95, "AdamW's beta2")
    eps: float = option(1e-8, "AdamW's epsilon")
    grad_clip: float = option(1.0, "clip the global gradient norm to this; 0: no clipping")
    # Muon (orthogonalised momentum, fived.optim.muon) for the hidden weight matrices (attention, feed-forward,
    # shared and routed experts, each expert's matrix on its own), AdamW (lr, betas, eps, weight_decay
    # above) for the embedding, head, norms and router; one schedule for both (train.muon_lr: Muon's own lr)
    optimizer: Optimizer = option("adamw", "the hidden weight matrices' optimizer (muon: AdamW for the rest)")
    muon_lr: float = option(0.0, "the Muon matrices' learning rate, under the same schedule; 0: train.lr")
    muon_momentum: float = option(0.95, "Muon's momentum")
    muon_nesterov: bool = option(True, "Muon: Nesterov momentum")
    muon_ns_steps: int = option(5, "Muon: Newton-Schulz iterations")
    # X <- a X + (b A + c A^2) X with A = X X^T: one "a,b,c" for every iteration (Keller Jordan's
    # quintic), or one per iteration separated by ";"
    muon_ns_coefficients: str = option(
        "3.4445,-4.7750,2.0315", "Muon: the Newton-Schulz step's a,b,c (or one per step, ';')"
    )
    # the update of a fan_out x fan_in matrix times: rms 0.2*sqrt(max(fan_out, fan_in)) (Moonlight: AdamW's
    # update RMS, so AdamW's lr and weight decay carry over) | spectral sqrt(max(1, fan_out/fan_in)) (Keller
    # Jordan's Muon) | none
    muon_scale: MuonScale = option("rms", "Muon: its update's scale (rms: AdamW's, so its lr and decay carry over)")
    # each bucket is gathered, orthogonalised, scattered and applied before the next (whole matrices, in
    # model order, in the Newton-Schulz dtype, per rank of the pipeline stage), so the step's transient
    # memory is one bucket's, not the stage's
    muon_bucket_mb: float = option(256.0, "Muon: MiB per rank of the matrices its step orthogonalises at once")
    # bfloat16: bf16 weights and gradients, float32 master weights and Adam state in the optimizer;
    # bfloat16-autocast: float32 weights, bf16 matmuls under autocast
    dtype: Precision = option("float32", "precision (bfloat16: float32 masters; -autocast: float32 weights)")
    activation_checkpointing: Checkpointing = option(
        "none", "recompute activations in backward (selective: the cheap element-wise ones)"
    )
    fp8: Fp8Recipe = option("none", "FP8 linears (torchao float8 training; emulated on CPU)")
    compile: bool = option(False, "torch.compile each transformer block (see fived.parallel.compile)")
    compile_backend: CompileBackend = option(
        "inductor", "torch.compile's backend (aot_eager: traced, no code generated)"
    )
    seed: int = option(0, "seed of the initial weights and the data order")
    # a Hugging Face model directory (its config.json gives the model, its tokenizer.json the
    # tokenizer) or a fived run/checkpoint (weights only, a fresh optimizer)
    init_from: str = option("", "start from these weights: a Hugging Face model directory or a fived run")
    log_every: int = option(10, "steps between updates of the progress bar's figures")
    output_dir: str = option("runs/default", "the run directory (a used one: a new one beside it, -1, -2, ...)")
    trace: str = option("", "write every rank's executed pipeline actions to this Chrome/Perfetto trace")
    # fived.training.step_timer: compute, each mesh dimension's exposed and overlapped communication, bubble,
    # optimizer, data; in metrics.jsonl, run.json, `fived diagnose`
    breakdown: bool = option(True, "measure where each step's time goes")
    # traces in <output_dir>/profile/ (one per rank and a merged one with fived's spans)
    profile: str = option("", '"START:END": record steps START..END (1-based) with torch.profiler')
    tensorboard: bool = option(False, "also write TensorBoard scalars (pip install tensorboard)")
    # fived.training.tracker: one tracked run per launch chain (its id in <output_dir>/tracker.json); the
    # library's own settings (WANDB_MODE, WANDB_PROJECT, MLFLOW_TRACKING_URI, ...) are honoured
    tracker: TrackerName = option(
        "none", "log the config, layout, metrics.jsonl records and summary to W&B or MLflow (rank 0)"
    )
    # Validation: the loss over a fixed set of validation batches (the same every time, whatever the
    # layout), logged as val_loss and val_ppl
    eval_every: int = option(0, "the validation loss every N steps and at the last step; 0: off")
    eval_batches: int = option(8, "global batches per evaluation; 0: every whole batch the validation data holds")
    peak_tflops: float = option(0.0, "per device, for MFU; 0: the GPU's data sheet, or the CPU's measured rate")
    device: Device = option("auto", "where ranks run (auto: cuda if available, else cpu)")
    # Faults (see fived.training.faults): the launcher restarts every rank from the newest checkpoint after a
    # failure; on SIGTERM ranks save at the next step boundary.
    collective_timeout_s: float = option(600.0, "a collective not done in this time fails the run, naming it")
    max_restarts: int = option(0, "restarts of every rank from the newest checkpoint after a failure")
    preempt_grace_s: float = option(60.0, "on SIGTERM, the seconds ranks get to save at the next step boundary")
    # Divergence guard (see fived.training.divergence): "stop" ends the run at that step without saving it;
    # "rollback" reloads the newest healthy checkpoint and skips the data up to the spike.
    spike_factor: float = option(5.0, "a loss above this x the recent median is a spike; 0: no spike check")
    spike_window: int = option(20, "steps whose median loss a spike is measured against")
    on_spike: OnSpike = option("stop", "on a non-finite or spiking loss or gradient norm")
    max_rollbacks: int = option(3, "rollbacks per launch before the run stops")


@dataclass
class DataConfig:
    path: str = option("", 'training tokens: "": the bundled corpus; a .bin from fived prepare-data; a text file')
    tokenizer: str = option("byte", '"byte" or the path of a Hugging Face tokenizer.json')
    # Megatron-LM's weight-path list; sample n's source is a function of n alone (fived.data.blend)
    blend: str = option("", 'weighted sources instead of data.path: "0.7 web.bin 0.3 code.bin" (weights normalised)')
    # Needed when train.eval_every > 0.
    val_path: str = option("", 'validation tokens (.bin or text); "": the split prepare-data --val-fraction wrote')
    valid_blend: str = option("", "validation sources as a weighted blend, like data.blend (instead of data.val_path)")
    # block-diagonal causal attention over the documents a packed sequence holds (each ends with the
    # end-of-document token), rotary positions restarting at each document's first token
    document_mask: bool = option(False, "attention only within documents, positions restarting at each")


@dataclass
class CheckpointConfig:
    """Checkpoints in <output_dir>/checkpoints/step-<N>/ (see fived.checkpoint.checkpointer)."""

    every: int = option(0, "save every N steps; 0: no periodic saves")
    keep: int = option(3, "keep the newest K complete checkpoints; 0: keep all")
    # (`async` in TOML and on the command line; a Python keyword, hence the attribute name)
    async_: bool = option(False, "save in the background: training waits only while shards are copied", key="async")
    final: bool = option(True, "save once more when the run ends")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict:
        """{section: {key: value}}, with the keys a TOML file or a flag uses."""
        return {
            section: {key_of(f): getattr(getattr(self, section), f.name) for f in fields(cls)}
            for section, cls in SECTION_TYPES.items()
        }


SECTION_TYPES = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
}


def key_of(f: dataclasses.Field) -> str:
    """A field's name in TOML files and flags (its attribute name unless that is a Python keyword)."""
    return f.metadata.get("key", f.name)


def _fields_by_key(section: str) -> dict[str, dataclasses.Field]:
    return {key_of(f): f for f in fields(SECTION_TYPES[section])}


@functools.cache
def field_type(section: str, key: str) -> Any:
    """The annotation of `section.key`, resolved (str, int, float, bool or a Literal of choices)."""
    return _section_hints(section)[_fields_by_key(section)[key].name]


@functools.cache
def _section_hints(section: str) -> dict[str, Any]:
    """A section's resolved annotations, once (resolving them all is the cost; every command's parser
    asks each field's)."""
    return typing.get_type_hints(SECTION_TYPES[section])


def choices(section: str, key: str) -> tuple | None:
    """The values a choice field allows (its Literal's), or None for a free field."""
    kind = field_type(section, key)
    return typing.get_args(kind) if typing.get_origin(kind) is Literal else None


_TINY = dict(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128)
_DEEPSEEK_V3 = dict(
    vocab_size=129280,
    dim=7168,
    n_layers=61,
    n_heads=128,
    n_kv_heads=128,
    ffn_dim=18432,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    rope_theta=10000.0,
    rope_scaling="yarn",
    rope_factor=40.0,
    rope_original_max_len=4096,
    rope_beta_fast=32.0,
    rope_beta_slow=1.0,
    rope_mscale=1.0,
    rope_mscale_all_dim=1.0,
    norm_eps=1e-6,
    n_experts=256,
    top_k=8,
    moe_ffn_dim=2048,
    n_shared_experts=1,
    n_dense_layers=3,
    router_score="sigmoid",
    n_expert_groups=8,
    topk_expert_groups=4,
    routed_scaling=2.5,
    mtp_depth=1,
)
# GPT-OSS-120B's shapes (its config.json): 128 experts top-4, alternating windowed (128) and global
# layers, per-head attention sinks and biases on every attention projection, YaRN x32 over 4096.
_GPT_OSS = dict(
    vocab_size=201088,
    dim=2880,
    n_layers=36,
    n_heads=64,
    n_kv_heads=8,
    head_size=64,
    ffn_dim=2880,
    rope_theta=150000.0,
    rope_scaling="yarn",
    rope_factor=32.0,
    rope_original_max_len=4096,
    sliding_window=128,
    window_pattern="wg",
    attention_sinks=True,
    attention_bias=True,
    n_experts=128,
    top_k=4,
    expert_kind="gpt-oss",
    rope_truncate=False,
)
# Gemma 3 27B's language model (the text_config of its config.json, transformers' Gemma3TextConfig
# defaults for what it leaves out): five windowed (1024) layers to one global, q/k norms, norms
# scaling by 1 + weight and post-norms, the embedding times sqrt(dim), GeGLU, linear rope x8 on the
# global layers (base 1e6), base 1e4 unscaled on the windowed ones, scores over sqrt(168), tied head.
_GEMMA3 = dict(
    vocab_size=262208,
    dim=5376,
    n_layers=62,
    n_heads=32,
    n_kv_heads=16,
    head_size=128,
    ffn_dim=21504,
    rope_theta=1e6,
    rope_scaling="linear",
    rope_factor=8.0,
    rope_local_theta=1e4,
    sliding_window=1024,
    window_pattern="wwwwwg",
    qk_norm=True,
    norm_eps=1e-6,
    norm_offset=True,
    post_norms=True,
    embed_scale=True,
    ffn_activation="gelu-tanh",
    attn_scale_dim=168.0,
    tie_embeddings=True,
)
# Real shapes follow the published model cards; they are built on the meta device for planning.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(_TINY),
    "tiny-moe": dict(_TINY, n_experts=8, top_k=2, moe_ffn_dim=64, n_shared_experts=1),
    "gpt-oss-120b": dict(_GPT_OSS),
    # GPT-OSS at CPU size: windows of 8 on layers 0 and 2, sinks, biases, YaRN, 4 experts top-2
    "tiny-gpt-oss": dict(
        _GPT_OSS,
        vocab_size=256,
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_size=16,
        ffn_dim=64,
        rope_theta=10000.0,
        rope_original_max_len=16,
        rope_factor=4.0,
        sliding_window=8,
        n_experts=4,
        top_k=2,
    ),
    "gemma-3-27b": dict(_GEMMA3),
    # Gemma 3 at CPU size: windows of 8 on five layers of six, head_size != dim / n_heads, scores over
    # sqrt(16) not sqrt(head_size); final soft-capping on (Gemma 3's checkpoints set none) so that the
    # verifies cover it
    "tiny-gemma3": dict(
        _GEMMA3,
        vocab_size=256,
        dim=64,
        n_layers=6,
        n_heads=4,
        n_kv_heads=2,
        head_size=32,
        ffn_dim=128,
        sliding_window=8,
        attn_scale_dim=16.0,
        final_softcap=30.0,
    ),
    "llama3-8b": dict(
        vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, rope_theta=500000.0
    ),
    "llama3-70b": dict(
        vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, rope_theta=500000.0
    ),
    "llama3-405b": dict(
        vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248, rope_theta=500000.0
    ),
    "mixtral-8x7b": dict(
        vocab_size=32000,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        rope_theta=1e6,
        n_experts=8,
        top_k=2,
    ),
    # DeepSeek-V3's expert layout (256 routed experts, top-8, one shared, 3 dense layers) on our
    # grouped-query attention instead of multi-head latent attention.
    "deepseek-v3-like": dict(
        vocab_size=129280,
        dim=7168,
        n_layers=61,
        n_heads=128,
        n_kv_heads=128,
        ffn_dim=18432,
        n_experts=256,
        top_k=8,
        moe_ffn_dim=2048,
        n_shared_experts=1,
        n_dense_layers=3,
        rope_theta=10000.0,
    ),
    # DeepSeek-V3 (671B) as its config.json gives it: multi-head latent attention, YaRN, sigmoid
    # group-limited routing over 256 experts in 8 groups, 3 dense layers
    "deepseek-v3": dict(_DEEPSEEK_V3),
    # every DeepSeek-V3 feature on at CPU size (q low-rank, v_head_dim != qk head dim, YaRN with both
    # mscales, 2 of 4 expert groups, a dense layer)
    "tiny-deepseek-v3": dict(
        _DEEPSEEK_V3,
        vocab_size=256,
        dim=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=4,
        ffn_dim=128,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=12,
        qk_rope_head_dim=8,
        v_head_dim=10,
        rope_factor=4.0,
        rope_original_max_len=16,
        rope_mscale=1.0,
        rope_mscale_all_dim=0.5,
        n_experts=8,
        top_k=2,
        moe_ffn_dim=32,
        n_dense_layers=1,
        n_expert_groups=4,
        topk_expert_groups=2,
        norm_eps=1e-6,
    ),
}


def did_you_mean(name: str, options) -> str:
    """The hint of a ConfigError for a name that is not one of `options`."""
    match = difflib.get_close_matches(name, list(options), n=1)
    return f"did you mean '{match[0]}'?" if match else "valid: " + ", ".join(sorted(options))


def coerce(section: str, key: str, value: Any) -> Any:
    """Convert a TOML or command-line value to the field's declared type (one of its choices, for a
    choice field), or raise ConfigError."""
    by_key = _fields_by_key(section)
    if key not in by_key:
        raise ConfigError(f"{section}.{key}", value, "unknown field", did_you_mean(key, by_key))
    allowed = choices(section, key)
    kind = type(allowed[0]).__name__ if allowed else field_type(section, key).__name__
    try:
        converted = _convert(value, kind)
    except (ValueError, TypeError):
        what = {"bool": "true or false", "int": "a whole number", "float": "a number", "str": "a string"}[kind]
        raise ConfigError(f"{section}.{key}", value, f"must be {what}", _example(section, key, kind)) from None
    if allowed is not None and converted not in allowed:
        close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
        raise ConfigError(
            f"{section}.{key}",
            value,
            "must be one of " + ", ".join(str(a) for a in allowed),
            f"did you mean '{close[0]}'?" if close else _example(section, key, kind),
        )
    return converted


def _example(section: str, key: str, kind: str) -> str:
    """A valid value of a field as its flag: the field's default where it has one of its type."""
    default = _fields_by_key(section)[key].default
    if type(default).__name__ != kind or default == "":
        return "e.g. " + {"bool": "true or false", "int": "2", "float": "0.5", "str": "a word"}[kind]
    return f"e.g. --{section}.{key} {str(default).lower() if kind == 'bool' else default}"


def _convert(value: Any, kind: str) -> Any:
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("1", "true", "yes", "on"):
            return True
        if str(value).lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(value)
    if kind == "int":
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        return int(value)
    return {"float": float, "str": str}[kind](value)


def model_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError("model.name", name, "unknown preset", did_you_mean(name, PRESETS))
    return ModelConfig(name=name, **PRESETS[name])


def build_config(toml_path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Defaults, then the model preset, then the TOML file, then `overrides` ({"section.key": value})."""
    file_values: dict[str, dict[str, Any]] = {}
    if toml_path:
        path = Path(toml_path)
        if not path.is_file():
            raise ConfigError("--config", toml_path, "file not found", "give the path of a TOML file")
        with path.open("rb") as f:
            try:
                file_values = tomllib.load(f)
            except tomllib.TOMLDecodeError as e:
                raise ConfigError("--config", toml_path, f"not valid TOML ({e})") from None
            except UnicodeDecodeError as e:  # (a binary file)
                raise ConfigError(
                    "--config", toml_path, f"not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})"
                ) from None
    merged: dict[str, dict[str, Any]] = {}
    for section, values in file_values.items():
        if section not in SECTION_TYPES:
            raise ConfigError(section, "...", "unknown section", did_you_mean(section, SECTION_TYPES))
        if not isinstance(values, dict):  # (`train = 5` at the top: a key where a table belongs)
            raise ConfigError(
                f"{toml_path}: {section}", values, "is a section, not a value", f"write [{section}], then its keys"
            )
        merged.setdefault(section, {}).update(values)
    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        if section not in SECTION_TYPES:
            raise ConfigError(dotted, value, "unknown section", did_you_mean(section, SECTION_TYPES))
        merged.setdefault(section, {})[key] = value

    model_values = merged.get("model", {})
    cfg = Config(model=model_preset(str(model_values.get("name", ModelConfig.name))))
    for section, values in merged.items():
        for key, value in values.items():
            set_field(cfg, section, key, value)
    return cfg


def set_field(cfg: Config, section: str, key: str, value: Any) -> None:
    """Set `section.key` (a TOML/flag key) to `value`, converted to the field's type."""
    value = coerce(section, key, value)
    name = _fields_by_key(section)[key].name
    if section == "model":  # (frozen: hashed by the planner's caches; a new value, never an edit)
        cfg.model = replace(cfg.model, **{name: value})
    else:
        setattr(getattr(cfg, section), name, value)


def config_from_dict(values: dict[str, dict[str, Any]]) -> Config:
    """The inverse of Config.to_dict (e.g. a checkpoint's resolved config): every field is given."""
    cfg = Config()
    for section, section_values in values.items():
        for key, value in section_values.items():
            set_field(cfg, section, key, value)
    return cfg


def config_fields() -> list[FieldInfo]:
    """Every field of every section, in order: the command line and its help are generated from this."""
    out = []
    for section, cls in SECTION_TYPES.items():
        for f in fields(cls):
            key = key_of(f)
            allowed = choices(section, key)
            kind = "choice" if allowed else field_type(section, key).__name__
            out.append(FieldInfo(section, key, f.name, f.default, kind, allowed, f.metadata.get("doc", "")))
    return out


@dataclass(frozen=True)
class FieldInfo:
    """What `--help`, the README's field table and a commented config.toml say about one field."""

    section: str
    key: str  # in TOML files and flags
    attr: str  # the dataclass attribute (`async_` for the key `async`)
    default: Any
    kind: str  # bool | int | float | str | choice
    choices: tuple | None
    doc: str  # one line ("" only for a field someone forgot to describe: tests/test_config_docs.py fails)
