"""Typed configuration: one dataclass per section, presets, TOML files and command-line overrides.

Precedence, lowest first: dataclass defaults < model preset < TOML file < command line.
The dataclass defaults below are the single source of truth; presets only list what they change.
"""
from __future__ import annotations

import dataclasses
import difflib
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration that cannot run. Its message is one line: field, value, rule, alternative."""

    def __init__(self, field_name: str, value: Any, rule: str, hint: str = ""):
        self.field, self.value, self.rule, self.hint = field_name, value, rule, hint
        msg = f"{field_name}={value}: {rule}"
        super().__init__(f"{msg}; {hint}" if hint else msg)


@dataclass
class ModelConfig:
    name: str = "tiny"
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 128  # SwiGLU hidden size of the dense feed-forward
    rope_theta: float = 10000.0
    # Llama 3.1's rotary scaling ("llama3": long wavelengths divided by rope_factor, a smooth ramp
    # between rope_original_max_len/rope_low_freq_factor and .../rope_high_freq_factor); "none": plain
    rope_scaling: str = "none"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    head_size: int = 0  # features per attention head; 0 = dim // n_heads (Qwen3 sets its own)
    qk_norm: bool = False  # RMSNorm over each query and key head before the rotation (Qwen3)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    # Mixture of experts: n_experts = 0 means a dense model.
    n_experts: int = 0
    top_k: int = 2
    moe_ffn_dim: int = 0  # hidden size of one routed expert; 0 means ffn_dim
    n_shared_experts: int = 0  # dense experts every token goes through (hidden moe_ffn_dim each)
    n_dense_layers: int = 0  # the first n layers keep a dense feed-forward (DeepSeek style)
    route_norm: bool = True  # renormalise the top-k routing weights to sum to 1
    capacity_factor: float = 0.0  # 0 = dropless; >0 drops per expert beyond cf*tokens*k/E
    aux_loss_coef: float = 0.01  # load-balancing loss weight (per-sequence statistics)
    router_bias_rate: float = 0.0  # >0: aux-loss-free balancing (DeepSeek-V3): per-expert bias step

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def expert_dim(self) -> int:
        return self.moe_ffn_dim or self.ffn_dim


@dataclass
class ParallelConfig:
    dp: int = -1  # -1: whatever the world size leaves after tp*pp*cp
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0  # 0 DDP, 1 optimizer state sharded, 2 + gradients, 3 + parameters (FSDP2)
    dp_replicate: int = 1  # HSDP: ZeRO shards over dp/dp_replicate ranks, replicated across groups
    reduce_dtype: str = "float32"  # gradient reduction dtype in bfloat16 runs (float32 | bfloat16)
    zero3_keep_gathered: bool = False  # ZeRO-3: keep gathered weights across micro-batches
    sp: bool = False
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved-1f1b | zero-bubble | zbv | dualpipev
    pp_virtual: int = 1  # stages per rank for interleaved-1f1b / zero-bubble (zbv, dualpipev: 2)
    pp_layers: str = ""  # explicit layers per stage, e.g. "3,1" (default: balanced by cost)
    # Overlap (as Megatron-Core's --tp-comm-overlap, --overlap-grad-reduce, --overlap-param-gather):
    # tp/sp regions' all-gather / reduce-scatter (all-reduce without sp) run in chunks under the GEMMs
    # in forward, and the input gradient's reduction under the weight-gradient GEMM in backward
    tp_overlap: bool = False
    # gradients reduced in buckets as soon as their last micro-batch's backward is done (ZeRO-1/2, and
    # the dp reduction of each pipeline stage); ZeRO-0 without pp and ZeRO-3 (FSDP2) always overlap
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False  # ZeRO-1/2: parameters all-gathered in buckets under the next forward
    # gradient buckets, MiB of gradients: ZeRO-0's all-reduces, and ZeRO-1/2's flat buffer with overlap
    # (each bucket sharded on its own, as Megatron-Core's distributed optimizer)
    bucket_mb: float = 25.0
    ep_overlap: bool = False  # expert all-to-all of one chunk of tokens under the expert GEMMs of another
    # Context parallelism (fived.parallel.context): ring (K/V travel around the cp ranks), ulysses
    # (all-to-all: each rank attends the whole sequence for cp-th of the heads) or hybrid (Ulysses
    # inside groups of cp_ulysses consecutive cp ranks, a ring across the groups)
    cp_mode: str = "ring"
    cp_ulysses: int = 2  # hybrid: ranks per Ulysses group (must divide cp)
    # Which sequence chunks a cp rank holds with data.document_mask: "work" (chosen per sequence from
    # its documents so that attention work is even, fived.documents) or "halves" (chunks i and
    # 2cp-1-i, even for one causal sequence only); without document masking always halves
    cp_balance: str = "work"


@dataclass
class TrainConfig:
    steps: int = 200
    seq_len: int = 64
    global_batch: int = 16  # sequences per optimizer step, whatever the layout
    microbatches: int = 1  # gradient-accumulation micro-batches per data-parallel rank
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping
    # adamw | muon: Muon (orthogonalised momentum, fived.muon) for the hidden weight matrices (attention,
    # feed-forward, shared and routed experts, each expert's matrix on its own), AdamW (lr, betas, eps,
    # weight_decay above) for the embedding, head, norms and router; one schedule for both
    optimizer: str = "adamw"
    muon_lr: float = 0.0  # the Muon matrices' learning rate, under the same schedule; 0: train.lr
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5  # Newton-Schulz iterations
    # X <- a X + (b A + c A^2) X with A = X X^T: one "a,b,c" for every iteration (Keller Jordan's quintic),
    # or one per iteration separated by ";"
    muon_ns_coefficients: str = "3.4445,-4.7750,2.0315"
    # the update of a fan_out x fan_in matrix times: rms 0.2*sqrt(max(fan_out, fan_in)) (Moonlight: AdamW's
    # update RMS, so AdamW's lr and weight decay carry over) | spectral sqrt(max(1, fan_out/fan_in)) (Keller
    # Jordan's Muon) | none
    muon_scale: str = "rms"
    # Muon's step works through its matrices in buckets (model order) of about this many MiB of whole
    # matrices, in the Newton-Schulz dtype, per rank of the pipeline stage (so every rank can own some):
    # each bucket is gathered, orthogonalised, scattered and applied before the next, so the step's
    # transient memory is one bucket's, not the stage's
    muon_bucket_mb: float = 256.0
    # float32 | bfloat16 (bf16 weights and gradients, float32 master weights and Adam state in the
    # optimizer) | bfloat16-autocast (float32 weights, bf16 matmuls under autocast) | float64
    dtype: str = "float32"
    activation_checkpointing: str = "none"  # none | full | selective
    # FP8 linears (torchao float8 training; emulated on CPU): none | tensorwise | rowwise
    fp8: str = "none"
    compile: bool = False  # torch.compile each transformer block (see fived.parallel.compile)
    compile_backend: str = "inductor"  # inductor | aot_eager (cheap: traced, no code generation) | eager
    seed: int = 0
    # start from these weights: a Hugging Face model directory (its config.json gives the model, its
    # tokenizer.json the tokenizer) or a fived run/checkpoint (weights only, a fresh optimizer)
    init_from: str = ""
    log_every: int = 10
    output_dir: str = "runs/default"
    trace: str = ""  # write the executed pipeline actions of every rank as a Chrome/Perfetto trace
    # Measure where each step's time goes (fived.step_timer: compute, each mesh dimension's exposed and
    # overlapped communication, bubble, optimizer, data); in metrics.jsonl, run.json, `fived diagnose`
    breakdown: bool = True
    # "START:END": record steps START..END (1-based, inclusive) with torch.profiler on every rank;
    # traces in <output_dir>/profile/ (one per rank and a merged one with fived's spans)
    profile: str = ""
    tensorboard: bool = False
    # Validation: the loss over a fixed set of validation batches (the same every time, whatever the
    # layout), every eval_every steps and at the last step; logged as val_loss and val_ppl. 0 = off.
    eval_every: int = 0
    eval_batches: int = 8  # global batches per evaluation; 0 = every whole batch the validation data holds
    peak_tflops: float = 0.0  # per device, for MFU; 0 = look up the GPU or measure the CPU
    device: str = "auto"  # auto (cuda if available, else cpu) | cpu | cuda
    # Faults (see fived.faults): a collective that does not complete in this time fails the run,
    # naming it; the launcher then restarts every rank from the newest checkpoint, at most
    # max_restarts times; on SIGTERM ranks save at the next step boundary within preempt_grace_s.
    collective_timeout_s: float = 600.0
    max_restarts: int = 0
    preempt_grace_s: float = 60.0
    # Divergence guard (see fived.divergence): a non-finite loss or gradient norm, or a loss above
    # spike_factor x the median loss of the last spike_window steps (0 = no spike check), ends the
    # run at that step without saving it ("stop"), or ("rollback") reloads the newest healthy
    # checkpoint and skips the data between it and the spike, at most max_rollbacks times a launch.
    spike_factor: float = 5.0
    spike_window: int = 20
    on_spike: str = "stop"  # stop | rollback
    max_rollbacks: int = 3


@dataclass
class DataConfig:
    path: str = ""  # "" = the bundled corpus; a .bin token file from `fived prepare-data`; or a text file
    tokenizer: str = "byte"  # "byte" or a path to a Hugging Face tokenizer.json
    # Validation tokens (a .bin or a text file); "" = the split `prepare-data --val-fraction` wrote
    # beside data.path. Needed when train.eval_every > 0.
    val_path: str = ""
    # Attention only within documents (block-diagonal causal over the documents a packed sequence
    # holds; each document ends with the end-of-document token) and rotary positions restarting at
    # each document's first token
    document_mask: bool = False


@dataclass
class CheckpointConfig:
    """Checkpoints in <output_dir>/checkpoints/step-<N>/ (see fived.checkpoint)."""

    every: int = 0  # save every N steps; 0 = no periodic saves
    keep: int = 3  # keep the newest K complete checkpoints; 0 = keep all
    # save in the background: training waits only while this rank's shards are copied
    # (`async` in TOML and on the command line; a Python keyword, hence the attribute name)
    async_: bool = field(default=False, metadata={"key": "async"})
    final: bool = True  # save once more when the run ends


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict:
        """{section: {key: value}}, with the keys a TOML file or a flag uses."""
        return {section: {key_of(f): getattr(getattr(self, section), f.name) for f in fields(cls)}
                for section, cls in SECTION_TYPES.items()}


SECTION_TYPES = {"model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig, "data": DataConfig,
                 "checkpoint": CheckpointConfig}


def key_of(f: dataclasses.Field) -> str:
    """A field's name in TOML files and flags (its attribute name unless that is a Python keyword)."""
    return f.metadata.get("key", f.name)


def _fields_by_key(section: str) -> dict[str, dataclasses.Field]:
    return {key_of(f): f for f in fields(SECTION_TYPES[section])}

_TINY = dict(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128)
# Real shapes follow the published model cards; they are built on the meta device for planning.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(_TINY),
    "tiny-moe": dict(_TINY, n_experts=8, top_k=2, moe_ffn_dim=64, n_shared_experts=1),
    "llama3-8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                      ffn_dim=14336, rope_theta=500000.0),
    "llama3-70b": dict(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                       ffn_dim=28672, rope_theta=500000.0),
    "llama3-405b": dict(vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                        ffn_dim=53248, rope_theta=500000.0),
    "mixtral-8x7b": dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                         ffn_dim=14336, rope_theta=1e6, n_experts=8, top_k=2),
    # DeepSeek-V3's expert layout (256 routed experts, top-8, one shared, 3 dense layers) on our
    # grouped-query attention instead of multi-head latent attention.
    "deepseek-v3-like": dict(vocab_size=129280, dim=7168, n_layers=61, n_heads=128, n_kv_heads=128,
                             ffn_dim=18432, n_experts=256, top_k=8, moe_ffn_dim=2048,
                             n_shared_experts=1, n_dense_layers=3, rope_theta=10000.0),
}


def did_you_mean(name: str, options) -> str:
    """The hint of a ConfigError for a name that is not one of `options`."""
    match = difflib.get_close_matches(name, list(options), n=1)
    return f"did you mean '{match[0]}'?" if match else "valid: " + ", ".join(sorted(options))


def coerce(section: str, key: str, value: Any) -> Any:
    """Convert a TOML or command-line value to the field's declared type, or raise ConfigError."""
    types = {k: f.type for k, f in _fields_by_key(section).items()}
    if key not in types:
        raise ConfigError(f"{section}.{key}", value, "unknown field", did_you_mean(key, types))
    kind = types[key] if isinstance(types[key], str) else types[key].__name__
    try:
        if kind == "bool":
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind == "int":
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        return {"float": float, "str": str}[kind](value)
    except (ValueError, TypeError):
        example = {"bool": "true or false", "int": "2", "float": "0.5", "str": "a word"}[kind]
        what = {"bool": "true or false", "int": "a whole number", "float": "a number", "str": "a string"}[kind]
        raise ConfigError(f"{section}.{key}", value, f"must be {what}", f"e.g. {example}") from None


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
    merged: dict[str, dict[str, Any]] = {}
    for section, values in file_values.items():
        if section not in SECTION_TYPES or not isinstance(values, dict):
            raise ConfigError(section, "...", "unknown section", did_you_mean(section, SECTION_TYPES))
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
    setattr(getattr(cfg, section), _fields_by_key(section)[key].name, value)


def config_from_dict(values: dict[str, dict[str, Any]]) -> Config:
    """The inverse of Config.to_dict (e.g. a checkpoint's resolved config): every field is given."""
    cfg = Config()
    for section, section_values in values.items():
        for key, value in section_values.items():
            set_field(cfg, section, key, value)
    return cfg


def config_fields() -> list[tuple[str, str, Any, str]]:
    """(section, field, default, type name) for every field: the command line is generated from this."""
    out = []
    for section, cls in SECTION_TYPES.items():
        for f in fields(cls):
            kind = f.type if isinstance(f.type, str) else f.type.__name__
            out.append((section, key_of(f), f.default, kind))
    return out
