"""AdamW with decoupled weight decay on matrices only, and the warmup + cosine schedule.
(Gradient clipping depends on how gradients are sharded: see DataParallel.clip_gradients.)"""
from __future__ import annotations

import math

import torch

from fived.config import TrainConfig


def build_optimizer(params, t: TrainConfig, decayed=None) -> torch.optim.AdamW:
    """AdamW; `decayed(p)` says whether p is weight-decayed (default: matrices, p.dim() >= 2)."""
    params = [p for p in params if p.requires_grad]
    decayed = decayed or (lambda p: p.dim() >= 2)
    # Norm gains (1-D) are not decayed: decaying them pulls every layer's scale toward zero.
    groups = [
        {"params": [p for p in params if decayed(p)], "weight_decay": t.weight_decay},
        {"params": [p for p in params if not decayed(p)], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)


def lr_multiplier(step: int, t: TrainConfig) -> float:
    """Linear warmup over warmup_steps, then cosine decay to min_lr_ratio at the last step."""
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    span = max(t.steps - t.warmup_steps, 1)
    progress = min((step - t.warmup_steps) / span, 1.0)
    return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, t: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, t))
