"""The parallelism recipe: `parallelize(model, mesh, cfg)` applies, in order,
TP -> CP -> EP -> pipeline split -> activation checkpointing -> data parallelism (ZeRO / FSDP),
each a short function in a file of its own. The model code itself has no parallel branches.

It runs on the meta device, before any parameter is materialised, and returns the data-parallel
strategy, whose `wrap` the trainer calls once the parameters are initialised.
"""
from __future__ import annotations

from torch import nn

from fived.config import Config
from fived.mesh import Mesh
from fived.parallel.checkpointing import apply_activation_checkpointing
from fived.parallel.data_parallel import DataParallel, make_data_parallel


def parallelize(model: nn.Module, mesh: Mesh, cfg: Config) -> DataParallel:
    # Tensor, context, expert and pipeline parallelism are added here by later issues; the layout
    # checks refuse them before any rank starts until then.
    apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
    data_parallel = make_data_parallel(mesh, cfg)
    data_parallel.shard(model)
    return data_parallel
