"""Gemma 3's text model (transformers' `Gemma3ForCausalLM`, model_type gemma3_text) as a fived
ModelConfig, and back.

Everything it computes has a field: windowed and global layers (`layer_types`, or the older
`sliding_window_pattern`: model.window_pattern), the window, a rotary base of their own for the
windowed layers (model.rope_local_theta, unscaled) and plain or linear-scaled rotary on the global
ones, q/k norms, norms scaling by 1 + weight, post-norms on the attention and feed-forward outputs,
the embedding times sqrt(dim), GeGLU (tanh gelu), scores over sqrt(query_pre_attn_scalar), the final
logits' soft-capping, the tied head. Refused in one line: attention soft-capping (Gemma 2's; fived's
attention kernels have none), bidirectional attention, attention biases, other rotary types.
"""

from __future__ import annotations

from dataclasses import replace

from fived.config import ConfigError, ModelConfig
from fived.hf.gpt_oss import hf_shape, window_pattern
from fived.hf.unsupported import Unsupported

ACTIVATION = "gelu_pytorch_tanh"
FULL, SLIDING = "full_attention", "sliding_attention"


def _rope(hf: dict) -> tuple[dict, dict]:
    """(global, windowed) rotary parameters: transformers 5 writes one dict per layer type in
    `rope_parameters`; older files rope_theta, rope_scaling (global) and rope_local_base_freq."""
    params = hf.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        return dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
    full = dict(hf.get("rope_scaling") or params or {})
    full.setdefault("rope_theta", hf.get("rope_theta", 1e6))
    return full, {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", 1e4)}


def _layer_types(hf: dict, n: int) -> list[str]:
    every = int(hf.get("sliding_window_pattern") or 6)  # (transformers' default for files without layer_types)
    return hf.get("layer_types") or [SLIDING if (i + 1) % every else FULL for i in range(n)]


def gemma3_config(hf: dict, source: str) -> ModelConfig:
    full, local = _rope(hf)
    kind = lambda p: p.get("rope_type", p.get("type", "default"))  # noqa: E731
    checks = [
        ("attn_logit_softcapping", hf.get("attn_logit_softcapping"), None, "fived's attention has no soft-capping"),
        ("use_bidirectional_attention", bool(hf.get("use_bidirectional_attention")), False, "fived is causal"),
        ("attention_bias", bool(hf.get("attention_bias")), False, "fived's Gemma attention has no biases"),
        ("hidden_activation", hf.get("hidden_activation", ACTIVATION), ACTIVATION, "fived's GeGLU is tanh gelu"),
        ("rope_parameters.sliding_attention.rope_type", kind(local), "default", "fived's windowed rotary is plain"),
    ]
    for key, value, wanted, rule in checks:
        if value != wanted:
            raise Unsupported(source, key, value, rule)
    if kind(full) not in ("default", "linear"):
        raise Unsupported(source, "rope_type", kind(full), "fived reads Gemma 3's plain or linear rotary")
    n = hf["num_hidden_layers"]
    window = int(hf.get("sliding_window") or 0)
    cap = hf.get("final_logit_softcapping")
    cfg = ModelConfig(
        name="hf-gemma3_text",
        **hf_shape(hf),
        rope_theta=float(full.get("rope_theta", 1e6)),
        rope_local_theta=float(local.get("rope_theta", 1e4)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        sliding_window=window,
        window_pattern=window_pattern(_layer_types(hf, n), source) if window else "w",
        qk_norm=True,
        norm_offset=True,
        post_norms=True,
        embed_scale=True,
        ffn_activation="gelu-tanh",
        attn_scale_dim=float(hf.get("query_pre_attn_scalar", 256)),
        final_softcap=float(cap or 0.0),
    )
    if kind(full) == "linear":
        cfg = replace(cfg, rope_scaling="linear", rope_factor=float(full["factor"]))
    return cfg


GEMMA_ONLY = ("norm_offset", "post_norms", "embed_scale", "ffn_activation", "attn_scale_dim", "final_softcap")


def is_gemma(cfg: ModelConfig) -> bool:
    """Whether `cfg` uses a part only Gemma 3 has (and so exports as Gemma3ForCausalLM or not at all)."""
    defaults = ModelConfig()
    return (
        cfg.rope_local_theta > 0
        or cfg.rope_scaling == "linear"
        or any(getattr(cfg, f) != getattr(defaults, f) for f in GEMMA_ONLY)
    )


def check_exportable(cfg: ModelConfig) -> None:
    """Gemma3ForCausalLM has every one of its parts always: refuse a model without one, or with a part
    it has not (one line naming the field)."""
    needed = [
        ("model.norm_offset", cfg.norm_offset, cfg.norm_offset),
        ("model.post_norms", cfg.post_norms, cfg.post_norms),
        ("model.embed_scale", cfg.embed_scale, cfg.embed_scale),
        ("model.qk_norm", cfg.qk_norm, cfg.qk_norm),
        ("model.ffn_activation", cfg.ffn_activation, cfg.ffn_activation == "gelu-tanh"),
        ("model.n_experts", cfg.n_experts, not cfg.is_moe),
        ("model.attention_bias", cfg.attention_bias, not cfg.attention_bias),
        ("model.attention_sinks", cfg.attention_sinks, not cfg.attention_sinks),
        ("model.rope_scaling", cfg.rope_scaling, cfg.rope_scaling in ("none", "linear")),
        # (Gemma's windowed layers rotate unscaled: without their own base they would be the global's)
        ("model.rope_local_theta", cfg.rope_local_theta, cfg.rope_local_theta > 0 or cfg.rope_scaling == "none"),
        ("model.mtp_depth", cfg.mtp_depth, not cfg.mtp_depth),
    ]
    if not float(cfg.attn_scale_dim).is_integer():
        raise ConfigError(
            "model.attn_scale_dim", cfg.attn_scale_dim, "Gemma 3's query_pre_attn_scalar is a whole number", "e.g. 168"
        )
    for field, value, ok in needed:
        if not ok:
            raise ConfigError(
                field,
                value,
                "a model with Gemma 3's parts exports as Gemma3ForCausalLM, which has all of them and no other",
                "export a Gemma 3-shaped model (e.g. --model.name tiny-gemma3)",
            )


def gemma3_hf_config(cfg: ModelConfig) -> dict:
    """The Gemma 3 keys of a config.json for `cfg` (the common ones are the caller's)."""
    full = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "linear":
        full = {"rope_type": "linear", "rope_theta": cfg.rope_theta, "factor": cfg.rope_factor}
    local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
    kinds = [SLIDING if cfg.layer_window(i) else FULL for i in range(cfg.n_layers)]
    return {
        "hidden_activation": ACTIVATION,
        "hidden_act": ACTIVATION,
        "query_pre_attn_scalar": int(cfg.attn_scale_dim or cfg.head_dim),  # (an int to transformers)
        "sliding_window": cfg.sliding_window or None,
        "layer_types": kinds,
        "rope_parameters": {FULL: full, SLIDING: local},
        "final_logit_softcapping": cfg.final_softcap or None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
        # (Gemma3TextConfig's defaults are Gemma's tokenizer's ids: a run's own, if any, replace these)
        **dict.fromkeys(("bos_token_id", "eos_token_id", "pad_token_id")),
    }
