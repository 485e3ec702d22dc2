"""AdamW with decoupled weight decay on matrices only, and its learning-rate schedule (fived.optim.lr_schedule).
(Gradient clipping depends on how gradients are sharded: see DataParallel.clip_gradients.)"""

from __future__ import annotations

import torch

from fived.config import TrainConfig
from fived.optim.lr_schedule import lr_multiplier


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


def build_scheduler(optimizer: torch.optim.Optimizer, t: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """The lr plan of fived.optim.lr_schedule (warmup, then cosine, wsd, linear or constant)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, t))
