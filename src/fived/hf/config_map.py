"""A Hugging Face `config.json` as a fived ModelConfig, and back.

Llama (2, 3, 3.1 with its rope scaling), Qwen3, Mixtral and Qwen3-MoE share fived's block: RMSNorm
pre-norm, rotary attention with grouped kv heads, SwiGLU; routers take softmax over all experts,
then the top k (renormalised to sum to 1 by Mixtral always, by Qwen3-MoE when norm_topk_prob).
Anything else (biases, another activation, sliding windows, other rope variants, shared experts,
MoE layers that are not a suffix of the stack) is refused, naming the key that differs.
DeepSeek-V3 (fived.hf.deepseek): multi-head latent attention, YaRN, sigmoid group-limited routing;
its multi-token-prediction layers (after num_hidden_layers) are not imported (transformers skips them).
GPT-OSS (fived.hf.gpt_oss): sliding windows, sinks, attention biases, its experts. Gemma 3's text
model (fived.hf.gemma3): windows with their own rotary, post-norms, norms scaling by 1 + weight, GeGLU.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from fived.config import ConfigError, ModelConfig
from fived.hf.unsupported import Unsupported

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


def read_config(directory: str | Path) -> dict:
    path = Path(directory) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            "--init-from",
            str(directory),
            f"no readable config.json ({e})",
            "give a Hugging Face model directory (config.json + *.safetensors)",
        ) from None


SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")


def special_token_ids(directory: str | Path) -> dict:
    """bos/eos/pad ids a Hugging Face directory names (generation_config.json first, then config.json)."""
    out = {}
    for file in ("config.json", "generation_config.json"):
        path = Path(directory) / file
        if path.is_file():
            values = json.loads(path.read_text())
            out.update({k: values[k] for k in SPECIAL_TOKENS if values.get(k) is not None})
    return out


def rope_parameters(hf: dict) -> dict:
    """transformers 5 writes `rope_parameters` (theta inside); older files `rope_theta` + `rope_scaling`."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def model_config_from_hf(hf: dict, source: str) -> ModelConfig:
    """The ModelConfig that computes exactly what the Hugging Face model computes, or Unsupported."""
    kind = hf.get("model_type")
    if kind not in ARCHITECTURES:
        raise Unsupported(source, "model_type", kind, "fived expresses " + ", ".join(ARCHITECTURES))
    if kind == "gpt_oss":
        from fived.hf.gpt_oss import gpt_oss_config

        return gpt_oss_config(hf, source, rope_parameters(hf))
    if kind == "gemma3_text":
        from fived.hf.gemma3 import gemma3_config

        return gemma3_config(hf, source)
    _refuse_differences(hf, source)
    if kind == "deepseek_v3":
        from fived.hf.deepseek import deepseek_config

        return deepseek_config(hf, source, rope_parameters(hf))
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    rope = rope_parameters(hf)
    cfg = ModelConfig(
        name=f"hf-{kind}",
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        ffn_dim=hf["intermediate_size"],
        rope_theta=float(rope["rope_theta"]),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        head_size=0 if head_dim * heads == hf["hidden_size"] else head_dim,
        qk_norm=kind.startswith("qwen3"),
    )
    if rope["rope_type"] == "llama3":
        cfg = replace(
            cfg,
            rope_scaling="llama3",
            rope_factor=float(rope["factor"]),
            rope_low_freq_factor=float(rope["low_freq_factor"]),
            rope_high_freq_factor=float(rope["high_freq_factor"]),
            rope_original_max_len=int(rope["original_max_position_embeddings"]),
        )
    if kind == "mixtral":
        cfg = replace(
            cfg,
            n_experts=hf["num_local_experts"],
            top_k=hf["num_experts_per_tok"],
            moe_ffn_dim=hf["intermediate_size"],
            route_norm=True,
        )
    elif kind == "qwen3_moe":
        cfg = replace(
            cfg,
            n_experts=hf.get("num_experts") or hf["num_local_experts"],
            top_k=hf["num_experts_per_tok"],
            moe_ffn_dim=hf["moe_intermediate_size"],
            route_norm=bool(hf.get("norm_topk_prob", False)),
            n_dense_layers=len(hf.get("mlp_only_layers") or []),
        )
    return cfg


def _refuse_differences(hf: dict, source: str) -> None:
    kind = hf["model_type"]
    checks = [
        ("hidden_act", hf.get("hidden_act", "silu"), lambda v: v == "silu", "fived's feed-forward is SwiGLU (silu)"),
        ("attention_bias", hf.get("attention_bias", False), lambda v: not v, "fived's projections have no biases"),
        ("mlp_bias", hf.get("mlp_bias", False), lambda v: not v, "fived's projections have no biases"),
        (
            "rope_type",
            rope_parameters(hf)["rope_type"],
            lambda v: v in ("default", "llama3") or (v == "yarn" and kind == "deepseek_v3"),
            "fived's rotary embeddings are plain or Llama 3.1-scaled (YaRN: DeepSeek-V3's)",
        ),
        (
            "partial_rotary_factor",
            rope_parameters(hf).get("partial_rotary_factor", 1.0),
            lambda v: v == 1.0,
            "fived rotates the whole head",
        ),
        ("router_jitter_noise", hf.get("router_jitter_noise", 0.0), lambda v: not v, "fived's router adds no noise"),
        (
            "decoder_sparse_step",
            hf.get("decoder_sparse_step", 1),
            lambda v: v == 1,
            "fived's MoE layers are every layer after the dense ones",
        ),
        (
            "mlp_only_layers",
            hf.get("mlp_only_layers") or [],
            lambda v: list(v) == list(range(len(v))),
            "fived's dense layers come first (model.n_dense_layers)",
        ),
        (
            "shared_expert_intermediate_size",
            hf.get("shared_expert_intermediate_size", 0),
            lambda v: not v,
            "fived's shared experts have no gate",
        ),
    ]
    windowed = hf.get("sliding_window") is not None and hf.get("use_sliding_window", kind == "mixtral")
    checks.append(
        (
            "sliding_window",
            hf.get("sliding_window"),
            lambda v: not windowed,
            "fived's attention sees the whole sequence",
        )
    )
    for key, value, ok, rule in checks:
        if not ok(value):
            raise Unsupported(source, key, value, rule)


def hf_config_from_model(cfg: ModelConfig, dtype: str, extra: dict | None = None) -> dict:
    """config.json for a fived model: Llama, Qwen3, Mixtral or Qwen3-MoE, whichever expresses it."""
    kind = export_kind(cfg)
    out = {
        "architectures": [ARCHITECTURES[kind]],
        "model_type": kind,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": max(cfg.rope_original_max_len, 2048),
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if cfg.rope_scaling == "llama3":
        out["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": cfg.rope_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_len,
        }
    if kind == "deepseek_v3":
        from fived.hf.deepseek import deepseek_hf_config

        out.update(deepseek_hf_config(cfg))
    elif kind == "gemma3_text":
        from fived.hf.gemma3 import gemma3_hf_config

        out.update(gemma3_hf_config(cfg))
    elif kind == "gpt_oss":
        from fived.hf.gpt_oss import gpt_oss_hf_config

        out.update(gpt_oss_hf_config(cfg))
    elif kind == "mixtral":
        out.update(
            num_local_experts=cfg.n_experts,
            num_experts_per_tok=cfg.top_k,
            intermediate_size=cfg.expert_dim,
            sliding_window=None,
            router_jitter_noise=0.0,
            output_router_logits=False,
        )
    elif kind == "qwen3_moe":
        out.update(
            num_experts=cfg.n_experts,
            num_experts_per_tok=cfg.top_k,
            moe_intermediate_size=cfg.expert_dim,
            norm_topk_prob=cfg.route_norm,
            decoder_sparse_step=1,
            use_sliding_window=False,
            sliding_window=None,
            mlp_only_layers=list(range(cfg.n_dense_layers)),
            output_router_logits=False,
        )
    if "rope_parameters" in out:  # (GPT-OSS, Gemma 3: transformers 5's form, theta inside)
        del out["rope_theta"], out["rope_scaling"]
    out.update(extra or {})
    return out


def _refuse_windowed_parts(cfg: ModelConfig) -> None:
    """Windows, sinks and biases have no place in Llama, Qwen3, Mixtral, Qwen3-MoE or DeepSeek-V3 as
    fived writes them (one line naming the field; GPT-OSS and Gemma 3 have their own routes)."""
    local: list[tuple[str, object, bool]] = [
        ("model.sliding_window", cfg.sliding_window, cfg.sliding_window > 0),
        ("model.attention_sinks", cfg.attention_sinks, cfg.attention_sinks),
        ("model.attention_bias", cfg.attention_bias, cfg.attention_bias),
        ("model.rope_truncate", cfg.rope_truncate, not cfg.rope_truncate),
    ]
    for key, setting, used in local:
        if used:
            raise ConfigError(
                key,
                setting,
                "only GPT-OSS (gpt-oss experts, sinks and biases together) and Gemma 3 export windows, "
                "sinks or attention biases",
                "export a model without them (e.g. --model.name tiny)",
            )


def export_kind(cfg: ModelConfig) -> str:
    """The Hugging Face architecture that computes what `cfg` computes (Llama or Qwen3 when dense;
    Mixtral or Qwen3-MoE with experts; DeepSeek-V3 with latent attention), or a ConfigError naming
    the field none of them has; GPT-OSS or Gemma 3 when it has their parts."""
    from fived.hf.gemma3 import is_gemma
    from fived.hf.gpt_oss import is_gpt_oss

    if is_gemma(cfg):
        from fived.hf.gemma3 import check_exportable as check_gemma

        check_gemma(cfg)
        return "gemma3_text"
    if is_gpt_oss(cfg):
        from fived.hf.gpt_oss import check_exportable as check_gpt_oss

        check_gpt_oss(cfg)
        return "gpt_oss"
    _refuse_windowed_parts(cfg)
    if cfg.is_mla:
        from fived.hf.deepseek import check_exportable

        check_exportable(cfg)
        return "deepseek_v3"
    deepseek_only = [
        ("model.rope_scaling", cfg.rope_scaling, cfg.rope_scaling == "yarn"),
        ("model.router_score", cfg.router_score, cfg.router_score != "softmax"),
        ("model.n_expert_groups", cfg.n_expert_groups, cfg.n_expert_groups > 1),
        ("model.routed_scaling", cfg.routed_scaling, cfg.routed_scaling != 1.0),
    ]
    for field, value, used in deepseek_only:
        if used:
            raise ConfigError(
                field,
                value,
                "only DeepSeek-V3 has it, and fived exports DeepSeek-V3 for latent-attention models only",
                "export a model with --model.kv_lora_rank > 0 (e.g. tiny-deepseek-v3)",
            )
    if cfg.rope_scaling != "none" and cfg.qk_norm:
        raise ConfigError(
            "model.rope_scaling",
            cfg.rope_scaling,
            "fived exports Llama 3.1's rope scaling as Llama or Mixtral only, which have no q/k norms",
            "export a model without --model.qk_norm",
        )
    if not cfg.is_moe:
        return "qwen3" if cfg.qk_norm else "llama"
    if cfg.n_shared_experts:
        raise ConfigError(
            "model.n_shared_experts",
            cfg.n_shared_experts,
            "Mixtral and Qwen3-MoE have no ungated shared experts",
            "export a model trained with --model.n_shared_experts 0",
        )
    if cfg.router_bias_rate > 0:
        raise ConfigError(
            "model.router_bias_rate",
            cfg.router_bias_rate,
            "the learned expert-selection biases have no place in Mixtral's or Qwen3-MoE's router",
            "export a model trained with 0",
        )
    if cfg.qk_norm:
        return "qwen3_moe"
    if not cfg.route_norm or cfg.n_dense_layers:
        field, value = (
            ("model.route_norm", False) if not cfg.route_norm else ("model.n_dense_layers", cfg.n_dense_layers)
        )
        raise ConfigError(
            field,
            value,
            "Mixtral renormalises the top-k weights and has no dense layers "
            "(Qwen3-MoE would, but needs --model.qk_norm true)",
            "export a Mixtral-shaped model",
        )
    return "mixtral"
