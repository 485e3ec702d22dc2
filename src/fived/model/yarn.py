"""YaRN rotary scaling (as DeepSeek-V3's reference and transformers' "yarn" rope type compute it).

Frequencies that turn more than beta_fast times over the original context are kept, those that turn
fewer than beta_slow times are divided by the factor, and the dimensions between ramp linearly (the
ramp's ends rounded outwards, as transformers' default `truncate`; GPT-OSS keeps them exact). Two
gains come with it: cos and sin are multiplied by mscale(factor, mscale) / mscale(factor,
mscale_all_dim) (or mscale(factor) when either is absent), and the softmax scale by
mscale(factor, mscale_all_dim)^2.
"""

from __future__ import annotations

import math

import torch

from fived.config import ModelConfig


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(inv_freq: torch.Tensor, cfg: ModelConfig, dim: int) -> torch.Tensor:
    """`inv_freq` ([dim/2], float64, unscaled) with YaRN's ramp between kept and divided by rope_factor."""

    def correction(rotations: float) -> float:  # the dimension that turns `rotations` times
        return dim * math.log(cfg.rope_original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

    low, high = correction(cfg.rope_beta_fast), correction(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = float(max(low, 0)), float(min(high, dim - 1))
    if low == high:
        high += 0.001  # (as the reference: no division by zero)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    return inv_freq / cfg.rope_factor * (1 - kept) + inv_freq * kept


def rope_gain(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by (1 without YaRN)."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return _mscale(cfg.rope_factor, cfg.rope_mscale) / _mscale(cfg.rope_factor, cfg.rope_mscale_all_dim)
    return _mscale(cfg.rope_factor)


def softmax_gain(cfg: ModelConfig) -> float:
    """The softmax scale's correction: scores are head_dim^-0.5 times this."""
    if cfg.rope_scaling != "yarn" or not cfg.rope_mscale_all_dim:
        return 1.0
    return _mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2
