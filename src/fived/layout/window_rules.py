"""The rules of sliding windows, attention sinks and attention biases (GPT-OSS, Gemma 3, Mistral),
and of the layouts they are verified under; each a one-line ConfigError (field, value, rule, a valid
value) before any process starts.

Context parallelism swaps the attention core for a ring or Ulysses exchange that knows neither the
window nor the sinks, and generation's KV cache knows neither: both are refused with them, never
run unverified. Tensor parallelism's overlapped regions run their projections without biases.
"""

from __future__ import annotations

from fived.config import ModelConfig, ParallelConfig


def uses_local_attention(m: ModelConfig) -> bool:
    """Whether some layer is windowed or attention has sinks (what the ring and the cache lack)."""
    return (m.sliding_window > 0 and "w" in m.window_pattern) or m.attention_sinks


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


def layout_checks(m: ModelConfig, p: ParallelConfig) -> list[tuple]:
    """(ok, field, value, rule, hint) of the layouts windows, sinks and biases run under."""
    return [
        (
            p.cp == 1 or not uses_local_attention(m),
            "parallel.cp",
            p.cp,
            "context parallelism does not yet run sliding windows or attention sinks",
            "e.g. --cp 1",
        ),
        (
            not (p.tp_overlap and p.tp > 1 and m.attention_bias),
            "parallel.tp_overlap",
            p.tp_overlap,
            "overlapped tensor-parallel regions run their projections without biases (model.attention_bias)",
            "e.g. --parallel.tp_overlap false",
        ),
    ]


def generation_error(m: ModelConfig) -> tuple | None:
    """(field, value, rule, hint) when generation's KV cache cannot run this model, else None."""
    if not uses_local_attention(m):
        return None
    return (
        "model.sliding_window" if m.sliding_window else "model.attention_sinks",
        m.sliding_window or m.attention_sinks,
        "generation's KV cache does not yet run sliding windows or attention sinks",
        "train or verify this model; generate with a model without them",
    )
