"""The rules of sliding windows, attention sinks and attention biases (GPT-OSS, Gemma 3, Mistral),
of Gemma 3's parts (`gemma_checks`) and of GPT-OSS's experts, under the layouts they are verified under; each a one-line ConfigError
(field, value, rule, a valid value) before any process starts.

Context parallelism's ring and Ulysses cores and generation's KV cache take windows and sinks
(fived.parallel.context, fived.tools.generate). Tensor parallelism's overlapped regions run their
projections without biases; a GPT-OSS expert's output bias would be added once per tp rank if its
hidden size were split (they run whole: parallel.etp 1), and FP8's expert GEMMs have no biases.
"""

from __future__ import annotations

from fived.config import ModelConfig, ParallelConfig


def model_checks(m: ModelConfig) -> list[tuple]:
    """(ok, field, value, rule, hint) of a model's window, sink and bias fields."""
    extras = m.sliding_window > 0 or m.attention_sinks or m.attention_bias
    return [
        (m.sliding_window >= 0, "model.sliding_window", m.sliding_window, "must be >= 0", "e.g. 128"),
        (
            bool(m.window_pattern) and set(m.window_pattern) <= {"w", "g"},
            "model.window_pattern",
            m.window_pattern,
            "must be letters w (windowed) and g (global), cycled over the layers",
            "e.g. --model.window_pattern wg",
        ),
        (
            not (extras and m.is_mla),
            "model.sliding_window",
            m.sliding_window,
            "latent attention has no windows, sinks or attention biases",
            "e.g. --model.sliding_window 0",
        ),
    ]


def gemma_checks(m: ModelConfig) -> list[tuple]:
    """(ok, field, value, rule, hint) of Gemma 3's fields: multi-token prediction's embedding and head
    have neither the embedding's scale nor the soft-capping, latent attention's norms no offset."""
    return [
        (m.rope_factor > 0, "model.rope_factor", m.rope_factor, "must be > 0", "e.g. 8"),
        (m.rope_local_theta >= 0, "model.rope_local_theta", m.rope_local_theta, "must be >= 0 (0: off)", "e.g. 10000"),
        (m.attn_scale_dim >= 0, "model.attn_scale_dim", m.attn_scale_dim, "must be >= 0 (0: head_dim)", "e.g. 168"),
        (m.final_softcap >= 0, "model.final_softcap", m.final_softcap, "must be >= 0 (0: none)", "e.g. 30"),
        (
            not (m.mtp_depth and (m.embed_scale or m.final_softcap)),
            "model.mtp_depth",
            m.mtp_depth,
            "multi-token prediction has no scaled embedding or soft-capped head (model.embed_scale, final_softcap)",
            "e.g. --model.mtp_depth 0",
        ),
        (
            not (m.is_mla and m.norm_offset),
            "model.norm_offset",
            m.norm_offset,
            "latent attention's norms scale by their weight",
            "e.g. --model.norm_offset false",
        ),
    ]


def layout_checks(m: ModelConfig, p: ParallelConfig, fp8: str = "none") -> list[tuple]:
    """(ok, field, value, rule, hint) of the layouts windows, sinks and biases run under."""
    gpt_oss = m.is_moe and m.expert_kind == "gpt-oss"
    return [
        (
            not gpt_oss or p.tp == 1 or p.etp == 1,
            "parallel.etp",
            p.etp,
            "gpt-oss experts (model.expert_kind) run whole under tensor parallelism: their output bias is not split",
            "e.g. --parallel.etp 1",
        ),
        (
            not gpt_oss or fp8 == "none",
            "train.fp8",
            fp8,
            "FP8's expert GEMMs have no biases (model.expert_kind gpt-oss)",
            "e.g. --train.fp8 none",
        ),
        (
            not (p.tp_overlap and p.tp > 1 and m.attention_bias),
            "parallel.tp_overlap",
            p.tp_overlap,
            "overlapped tensor-parallel regions run their projections without biases (model.attention_bias)",
            "e.g. --parallel.tp_overlap false",
        ),
    ]
