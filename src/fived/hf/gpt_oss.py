"""GPT-OSS's config.json as a fived ModelConfig (transformers' `GptOssConfig`), import only.

Everything GPT-OSS computes has a field: windowed and global layers (`layer_types`, a repeating
pattern: model.window_pattern), the sliding window, per-head sinks, biases on q/k/v/o, YaRN with
its exact ramp ends (truncate false), the router's bias and softmax over the top-k logits (fived's
softmax over all experts then top-k renormalised: the same weights), and the experts' biases and
clamped SwiGLU. The experts' gate and up projections are stored interleaved in one tensor
(gate_up_proj [E, dim, 2 x hidden], gate in the even columns): fived's w1 and w3 read every other
column (fived.hf.names.Source.columns). Export is refused (fived.hf.config_map.export_kind).
"""

from __future__ import annotations

from fived.config import ModelConfig
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


def gpt_oss_config(hf: dict, source: str, rope: dict) -> ModelConfig:
    if rope["rope_type"] not in ("yarn", "default"):
        raise Unsupported(source, "rope_type", rope["rope_type"], "fived reads GPT-OSS's yarn or plain rotary")
    if rope.get("attention_factor") is not None or rope.get("mscale") or rope.get("mscale_all_dim"):
        raise Unsupported(source, "attention_factor", rope.get("attention_factor"), "fived derives YaRN's gain")
    heads = hf["num_attention_heads"]
    n = hf["num_hidden_layers"]
    cfg = ModelConfig(
        name="hf-gpt_oss",
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        n_layers=n,
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        head_size=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_dim=hf["intermediate_size"],
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
        cfg.rope_scaling = "yarn"
        cfg.rope_factor = float(rope["factor"])
        cfg.rope_original_max_len = int(rope["original_max_position_embeddings"])
        cfg.rope_beta_fast = float(rope.get("beta_fast") or 32.0)
        cfg.rope_beta_slow = float(rope.get("beta_slow") or 1.0)
        cfg.rope_truncate = bool(rope.get("truncate", True))
    return cfg
