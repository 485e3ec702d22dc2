"""The parallelism recipe: `parallelize(model, mesh, cfg)` applies, in order,
TP -> CP -> EP -> pipeline split -> activation checkpointing -> data parallelism,
each a short function in a file of its own. The model code itself has no parallel branches.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from fived.config import Config
from fived.mesh import Mesh
from fived.parallel.checkpointing import apply_activation_checkpointing
from fived.parallel.data_parallel import sum_gradients_over_dp


@dataclass
class Parallelized:
    """What the trainer needs from the recipe: the (wrapped) model, and what to call once the
    gradients of the last micro-batch are in."""

    model: torch.nn.Module
    finish_gradients: Callable[[], None] = field(default=lambda: None)


def parallelize(model: torch.nn.Module, mesh: Mesh, cfg: Config) -> Parallelized:
    # Tensor, context, expert and pipeline parallelism are added here by later issues; the layout
    # checks refuse them before any rank starts until then.
    apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
    dp_group = mesh.group("dp")
    # Parameters are looked up at call time: materialising the model (to_empty) replaces them.
    return Parallelized(model, finish_gradients=lambda: sum_gradients_over_dp(list(model.parameters()), dp_group))
