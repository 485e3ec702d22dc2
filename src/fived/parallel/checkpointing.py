"""Activation checkpointing applied to each transformer block from outside the model.

- full: keep only each block's input; recompute the whole block in backward.
- selective: keep the outputs of the matrix multiplications and attention (the expensive ops) and
  recompute the cheap element-wise ones (norms, activations, RoPE), as in Korthikanti et al.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from fived.compat import checkpoint_wrapper
from fived.model.attention import inside_blockwise
from fived.model.grouped_gemm import GROUPED_SWIGLU_OP
from fived.model.transformer import Transformer

_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten._scaled_mm.default,  # FP8 linears' GEMMs on FP8 hardware (train.fp8; emulated: mm)
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    GROUPED_SWIGLU_OP,  # the experts' GEMMs: output, gate and up
}


def _policy(ctx, op, *args, **kwargs):
    # Ring attention's blocks are recomputed with its exchanges (the ring reruns them anyway), and so
    # are document-masked tiles; caching them would keep a data-dependent number of partial outputs.
    if op in _SAVE and not inside_blockwise():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_policy)


def apply_activation_checkpointing(model: Transformer, mode: str) -> None:
    if mode == "none":
        return
    for name, block in list(model.layers.named_children()):
        if mode == "full":
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False, context_fn=_selective_context)
        model.layers.register_module(name, wrapped)
