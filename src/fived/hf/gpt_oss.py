"""GPT-OSS's config.json as a fived ModelConfig (transformers' `GptOssConfig`), import only.

Everything GPT-OSS computes has a field: windowed and global layers (`layer_types`, a repeating
pattern: model.window_pattern), the sliding window, per-head sinks, biases on q/k/v/o, YaRN with
its exact ramp ends (truncate false), the router's bias and softmax over the top-k logits (fived's
softmax over all experts then top-k renormalised: the same weights), and the experts' biases and
clamped SwiGLU. The experts' gate and up projections are stored interleaved in one tensor
(gate_up_proj [E, dim, 2 x hidden], gate in the even columns): fived's w1 and w3 read every other
column (fived.hf.names.Source.columns); export writes them interleaved again (fived.hf.export). A model
with GPT-OSS's experts or sinks exports as GptOssForCausalLM, which needs all of its parts.
"""

from __future__ import annotations

from dataclasses import replace

from fived.config import ConfigError, ModelConfig
from fived.hf.unsupported import Unsupported

LAYER_KIND = {"sliding_attention": "w", "full_attention": "g"}


def window_pattern(layer_types: list[str], source: str) -> str:
    """The shortest pattern whose cycle gives `layer_types` (as w/g letters), or Unsupported."""
    if any(kind not in LAYER_KIND for kind in layer_types):
        raise Unsupported(source, "layer_types", layer_types, "fived's layers are sliding_attention or full_attention")
    letters = "".join(LAYER_KIND[kind] for kind in layer_types)
    for period in range(1, len(letters) + 1):
        if all(letters[i] == letters[i % period] for i in range(len(letters))):
            return letters[:period]
    return letters  # (unreachable: the whole string is its own cycle)


def hf_shape(hf: dict) -> dict:
    """The ModelConfig shape fields GPT-OSS's and Gemma 3's config.json state alike (head_dim given, or
    hidden / heads)."""
    heads = hf["num_attention_heads"]
    return dict(
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        head_size=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_dim=hf["intermediate_size"],
    )


def gpt_oss_config(hf: dict, source: str, rope: dict) -> ModelConfig:
    if rope["rope_type"] not in ("yarn", "default"):
        raise Unsupported(source, "rope_type", rope["rope_type"], "fived reads GPT-OSS's yarn or plain rotary")
    if rope.get("attention_factor") is not None or rope.get("mscale") or rope.get("mscale_all_dim"):
        raise Unsupported(source, "attention_factor", rope.get("attention_factor"), "fived derives YaRN's gain")
    n = hf["num_hidden_layers"]
    cfg = ModelConfig(
        name="hf-gpt_oss",
        **hf_shape(hf),
        rope_theta=float(rope["rope_theta"]),
        norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        sliding_window=int(hf.get("sliding_window") or 0),
        window_pattern=window_pattern(hf.get("layer_types") or ["sliding_attention", "full_attention"] * n, source)
        if hf.get("sliding_window")
        else "w",
        attention_sinks=True,
        attention_bias=bool(hf.get("attention_bias", True)),
        n_experts=hf["num_local_experts"],
        top_k=hf["num_experts_per_tok"],
        moe_ffn_dim=hf["intermediate_size"],
        route_norm=True,
        expert_kind="gpt-oss",
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
    )
    if not cfg.attention_bias:
        raise Unsupported(source, "attention_bias", False, "fived's GPT-OSS attention has biases")
    if rope["rope_type"] == "yarn":
        cfg = replace(
            cfg,
            rope_scaling="yarn",
            rope_factor=float(rope["factor"]),
            rope_original_max_len=int(rope["original_max_position_embeddings"]),
            rope_beta_fast=float(rope.get("beta_fast") or 32.0),
            rope_beta_slow=float(rope.get("beta_slow") or 1.0),
            rope_truncate=bool(rope.get("truncate", True)),
        )
    return cfg


def is_gpt_oss(cfg: ModelConfig) -> bool:
    """Whether `cfg` uses a part only GPT-OSS has (its experts, sinks): it exports as GPT-OSS or not at all."""
    return cfg.attention_sinks or (cfg.is_moe and cfg.expert_kind == "gpt-oss")


def check_exportable(cfg: ModelConfig) -> None:
    """GptOssForCausalLM has sinks, biases and its experts in every layer, softmax top-k routing, YaRN
    or plain rotary: refuse a model that differs (one line naming the field)."""
    needed = [
        ("model.attention_sinks", cfg.attention_sinks, cfg.attention_sinks),
        ("model.attention_bias", cfg.attention_bias, cfg.attention_bias),
        ("model.expert_kind", cfg.expert_kind, cfg.is_moe and cfg.expert_kind == "gpt-oss"),
        ("model.n_shared_experts", cfg.n_shared_experts, not cfg.n_shared_experts),
        ("model.n_dense_layers", cfg.n_dense_layers, not cfg.n_dense_layers),
        ("model.route_norm", cfg.route_norm, cfg.route_norm),
        ("model.router_score", cfg.router_score, cfg.router_score == "softmax" and cfg.n_expert_groups == 1),
        ("model.routed_scaling", cfg.routed_scaling, cfg.routed_scaling == 1.0),
        ("model.router_bias_rate", cfg.router_bias_rate, not cfg.router_bias_rate),
        ("model.qk_norm", cfg.qk_norm, not cfg.qk_norm),
        ("model.kv_lora_rank", cfg.kv_lora_rank, not cfg.is_mla),
        ("model.rope_scaling", cfg.rope_scaling, cfg.rope_scaling in ("none", "yarn")),
        ("model.rope_mscale", cfg.rope_mscale, not (cfg.rope_mscale or cfg.rope_mscale_all_dim)),
        ("model.mtp_depth", cfg.mtp_depth, not cfg.mtp_depth),
    ]
    for field, value, ok in needed:
        if not ok:
            raise ConfigError(
                field,
                value,
                "a model with GPT-OSS's experts or sinks exports as GptOssForCausalLM, which has all of its parts "
                "and no other",
                "export a GPT-OSS-shaped model (e.g. --model.name tiny-gpt-oss)",
            )


def gpt_oss_hf_config(cfg: ModelConfig) -> dict:
    """The GPT-OSS keys of a config.json for `cfg` (the common ones are the caller's)."""
    rope: dict[str, object] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "yarn":
        rope = {
            "rope_type": "yarn",
            "rope_theta": cfg.rope_theta,
            "factor": cfg.rope_factor,
            "original_max_position_embeddings": cfg.rope_original_max_len,
            "beta_fast": cfg.rope_beta_fast,
            "beta_slow": cfg.rope_beta_slow,
            "truncate": cfg.rope_truncate,
        }
    kinds = [
        next(k for k, v in LAYER_KIND.items() if v == ("w" if cfg.layer_window(i) else "g"))
        for i in range(cfg.n_layers)
    ]
    return {
        "intermediate_size": cfg.expert_dim,
        "num_local_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.top_k,
        "sliding_window": cfg.sliding_window or None,
        "layer_types": kinds,
        "attention_bias": True,
        "swiglu_alpha": cfg.swiglu_alpha,
        "swiglu_limit": cfg.swiglu_limit,
        "router_aux_loss_coef": cfg.aux_loss_coef,
        "output_router_logits": False,
        "rope_parameters": rope,
        # (transformers' YaRN expects the scaled context here)
        "max_position_embeddings": int(cfg.rope_factor * cfg.rope_original_max_len)
        if cfg.rope_scaling == "yarn"
        else max(cfg.rope_original_max_len, 2048),
    }
