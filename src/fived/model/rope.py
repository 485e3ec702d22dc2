"""Rotary position embeddings: the inverse frequencies (plain, Llama 3.1's, YaRN's, linear), the
cos/sin tables and the rotation (rotate-half, as Hugging Face's Llama)."""

from __future__ import annotations

import dataclasses
import math

import torch

from fived.config import ModelConfig
from fived.model.yarn import rope_gain, yarn_frequencies


def rope_frequencies(cfg: ModelConfig, device=None) -> torch.Tensor:
    """Rotary inverse frequencies (float64), with Llama 3.1's scaling when cfg.rope_scaling is "llama3":
    wavelengths longer than original/low_freq_factor are stretched by rope_factor, shorter than
    original/high_freq_factor kept, and the band between interpolated linearly in 1/wavelength;
    YaRN's when "yarn" (fived.model.yarn)."""
    head_dim = cfg.rope_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim)
    if cfg.rope_scaling == "none":
        return inv_freq
    if cfg.rope_scaling == "yarn":
        return yarn_frequencies(inv_freq, cfg, head_dim)
    if cfg.rope_scaling == "linear":  # (Gemma 3's global layers: positions divided by the factor)
        return inv_freq / cfg.rope_factor
    wavelen = 2 * math.pi / inv_freq
    original, low, high = cfg.rope_original_max_len, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    smooth = ((original / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - smooth) * inv_freq / cfg.rope_factor + smooth * inv_freq


def rope_cos_sin(positions: torch.Tensor, cfg: ModelConfig, dtype: torch.dtype):
    """cos/sin tables for rotary embeddings at the given positions [s] (or per sequence, [b, s]),
    shape [s, rope_dim] (or [b, s, rope_dim]); YaRN multiplies both by its gain."""
    inv_freq = rope_frequencies(cfg, positions.device)
    angles = positions.to(torch.float64)[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    gain = rope_gain(cfg)
    return (angles.cos() * gain).to(dtype), (angles.sin() * gain).to(dtype)


def windowed_rope(cfg: ModelConfig) -> ModelConfig:
    """The rotary settings of windowed layers with model.rope_local_theta (Gemma 3): that base, no
    scaling (the global layers keep the model's)."""
    return dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling="none")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half convention (as in Hugging Face Llama); x is [b, s, heads, head_dim], the tables
    [s, head_dim] or [b, s, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = (t[None] if t.dim() == 2 else t for t in (cos, sin))
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]
