"""DeepSeek-V3's config.json as a fived ModelConfig, and back (transformers' `DeepseekV3Config`).

Everything DeepSeek-V3 computes has a field: latent attention (q_lora_rank, kv_lora_rank, the head
sizes), YaRN (factor, original context, beta_fast/slow, mscale, mscale_all_dim), sigmoid scores
with the routing bias (`e_score_correction_bias`, imported), group-limited top-k, the routed scaling
factor, shared experts and the first dense layers. Anything else is refused in one line. fived writes
its rotary features in rotate-half order, so an export says rope_interleave false (an import of
interleaved weights permutes their rows: fived.hf.names.deinterleaved_rows).
"""

from __future__ import annotations

from dataclasses import replace

from fived.config import ConfigError, ModelConfig
from fived.hf.unsupported import Unsupported


def _refuse(source: str, key: str, value, rule: str):
    return Unsupported(source, key, value, rule)


def deepseek_config(hf: dict, source: str, rope: dict) -> ModelConfig:
    checks = [
        ("scoring_func", hf.get("scoring_func", "sigmoid"), "sigmoid", "fived's DeepSeek router scores by sigmoid"),
        ("topk_method", hf.get("topk_method", "noaux_tc"), "noaux_tc", "fived routes group-limited with a bias"),
        ("attention_factor", rope.get("attention_factor"), None, "fived derives YaRN's gain from the mscales"),
        ("truncate", rope.get("truncate", True), True, "fived rounds YaRN's ramp outwards"),
    ]
    for key, value, wanted, rule in checks:
        if value != wanted:
            raise _refuse(source, key, value, rule)
    heads = hf["num_attention_heads"]
    cfg = ModelConfig(
        name="hf-deepseek_v3",
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=heads,
        ffn_dim=hf["intermediate_size"],
        rope_theta=float(rope["rope_theta"]),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        q_lora_rank=hf.get("q_lora_rank") or 0,
        kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        n_experts=hf["n_routed_experts"],
        top_k=hf["num_experts_per_tok"],
        moe_ffn_dim=hf["moe_intermediate_size"],
        n_shared_experts=hf.get("n_shared_experts") or 0,
        n_dense_layers=hf.get("first_k_dense_replace") or 0,
        route_norm=bool(hf.get("norm_topk_prob", True)),
        router_score="sigmoid",
        n_expert_groups=hf.get("n_group") or 1,
        topk_expert_groups=hf.get("topk_group") or 1,
        routed_scaling=float(hf.get("routed_scaling_factor", 1.0)),
        mtp_depth=_mtp_depth(hf, source),
    )
    if rope["rope_type"] == "yarn":
        original = int(rope["original_max_position_embeddings"])
        cfg = replace(
            cfg,
            rope_scaling="yarn",
            rope_factor=float(rope.get("factor") or hf["max_position_embeddings"] / original),
            rope_original_max_len=original,
            rope_beta_fast=float(rope.get("beta_fast") or 32),
            rope_beta_slow=float(rope.get("beta_slow") or 1),
            rope_mscale=float(rope.get("mscale") or 0.0),
            rope_mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
        )
    return cfg


def _mtp_depth(hf: dict, source: str) -> int:
    """num_nextn_predict_layers when the checkpoint holds those layers (the released ones do; a
    transformers-saved model does not: transformers builds no multi-token prediction), else 0."""
    depth = int(hf.get("num_nextn_predict_layers") or 0)
    if not depth:
        return 0
    from fived.hf.reader import HfCheckpoint

    names = HfCheckpoint(source).names()  # (none in a directory without weights)
    return depth if f"model.layers.{hf['num_hidden_layers']}.eh_proj.weight" in names else 0


def deepseek_hf_config(cfg: ModelConfig) -> dict:
    """The DeepSeek-V3 keys of a config.json for `cfg` (the common ones are the caller's)."""
    out: dict[str, object] = {
        "q_lora_rank": cfg.q_lora_rank or None,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "head_dim": cfg.qk_rope_head_dim,
        "n_routed_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.top_k,
        "moe_intermediate_size": cfg.expert_dim,
        "n_shared_experts": cfg.n_shared_experts,
        "first_k_dense_replace": cfg.n_dense_layers,
        "norm_topk_prob": cfg.route_norm,
        "n_group": cfg.n_expert_groups,
        "topk_group": cfg.topk_expert_groups,
        "routed_scaling_factor": cfg.routed_scaling,
        "rope_interleave": False,
        "num_nextn_predict_layers": cfg.mtp_depth,
    }
    if cfg.rope_scaling == "yarn":
        out["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": cfg.rope_factor,
            "original_max_position_embeddings": cfg.rope_original_max_len,
            "beta_fast": cfg.rope_beta_fast,
            "beta_slow": cfg.rope_beta_slow,
            **({"mscale": cfg.rope_mscale} if cfg.rope_mscale else {}),
            **({"mscale_all_dim": cfg.rope_mscale_all_dim} if cfg.rope_mscale_all_dim else {}),
        }
    return out


def check_exportable(cfg: ModelConfig) -> None:
    """DeepSeek-V3's layout is fixed where fived's is free: refuse what transformers cannot build."""
    if not cfg.is_moe or cfg.router_score != "sigmoid" or not cfg.n_shared_experts:
        field, value = ("model.router_score", cfg.router_score) if cfg.is_moe else ("model.n_experts", cfg.n_experts)
        if cfg.is_moe and cfg.router_score == "sigmoid":
            field, value = "model.n_shared_experts", cfg.n_shared_experts
        raise ConfigError(
            field,
            value,
            "a latent-attention model exports as DeepSeek-V3: routed experts with sigmoid scores and shared experts",
            "export a model with DeepSeek-V3's MoE (e.g. --model tiny-deepseek-v3)",
        )
