"""The rules of DeepSeek-V3's parts (latent attention, YaRN, sigmoid group-limited routing) and of
the layouts they have been verified under; each a one-line ConfigError (field, value, rule, a valid
value) before any process starts.

Verified exact against one device in float64 (`fived verify --model tiny-deepseek-v3`): the
dimensions `LATENT_VERIFIED` names. Anything else with latent attention is refused, never run
unverified.
"""

from __future__ import annotations

from fived.config import ModelConfig


def model_checks(m: ModelConfig) -> list[tuple]:
    """(ok, field, value, rule, hint) of a model's DeepSeek-V3 fields."""
    groups = max(m.n_expert_groups, 1)
    per_group = m.n_experts // groups
    checks = [
        (
            m.rope_scaling != "yarn" or m.rope_beta_fast > m.rope_beta_slow > 0,
            "model.rope_beta_fast",
            m.rope_beta_fast,
            f"must exceed model.rope_beta_slow={m.rope_beta_slow} (> 0)",
            "e.g. --model.rope_beta_fast 32",
        ),
        (
            m.rope_scaling != "yarn" or m.rope_factor >= 1,
            "model.rope_factor",
            m.rope_factor,
            "yarn scaling: must be >= 1",
            "e.g. --model.rope_factor 40",
        ),
        (
            m.n_expert_groups >= 1 and (not m.is_moe or m.n_experts % m.n_expert_groups == 0),
            "model.n_expert_groups",
            m.n_expert_groups,
            f"must be >= 1 and divide model.n_experts={m.n_experts}",
            "e.g. --model.n_expert_groups 1",
        ),
        (
            m.n_expert_groups == 1 or per_group >= 2,
            "model.n_expert_groups",
            m.n_expert_groups,
            "a group is ranked by its two best experts: it needs >= 2",
            f"e.g. --model.n_expert_groups {max(m.n_experts // 2, 1)}",
        ),
        (
            1 <= m.topk_expert_groups <= groups,
            "model.topk_expert_groups",
            m.topk_expert_groups,
            f"must be in 1..n_expert_groups={groups}",
            f"e.g. --model.topk_expert_groups {groups}",
        ),
        (
            not m.is_moe or m.top_k <= m.topk_expert_groups * per_group,
            "model.top_k",
            m.top_k,
            f"must be at most the {m.topk_expert_groups} chosen groups' {m.topk_expert_groups * per_group} experts",
            f"e.g. --model.topk_expert_groups {groups}",
        ),
    ]
    if m.is_mla:
        checks += [
            (
                m.qk_rope_head_dim > 0 and m.qk_rope_head_dim % 2 == 0,
                "model.qk_rope_head_dim",
                m.qk_rope_head_dim,
                "latent attention: must be even and > 0 (rotated in pairs)",
                "e.g. --model.qk_rope_head_dim 64",
            ),
        ]
    return checks


def mtp_checks(m: ModelConfig, seq_len: int) -> list[tuple]:
    """(ok, field, value, rule, hint) of multi-token prediction's fields (fived.model.mtp)."""
    return [
        (
            0 <= m.mtp_depth < seq_len,
            "model.mtp_depth",
            m.mtp_depth,
            f"must be in 0..seq_len-1={seq_len - 1} (depth k predicts token t+k+1)",
            "e.g. --model.mtp_depth 1",
        ),
        (
            m.mtp_loss_weight >= 0,
            "model.mtp_loss_weight",
            m.mtp_loss_weight,
            "must be >= 0",
            "e.g. --model.mtp_loss_weight 0.3",
        ),
    ]
