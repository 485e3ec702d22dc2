"""DeepSeek-V3's multi-token prediction (MTP): D sequential modules after the main model, on the
last pipeline stage, sharing the embedding and the output head.

Module k (1..D) takes the previous depth's hidden state h^{k-1} at each position t (h^0: the main
model's final-normed output, what its head reads), RMS-normalises it and the embedding of token t+k,
concatenates [embedding; hidden] (the order of the released checkpoints' `eh_proj`), projects 2d -> d,
runs one transformer block (a MoE block in DeepSeek-V3) and normalises; the shared head turns h^k
into the prediction of token t+k+1. Positions whose depth-k target lies past the sequence's end have
no target and are excluded (the reference rolls the labels and masks them); being causal, they never
influence a position that has one.

The objective adds lambda x the mean over depths of the depth-k cross-entropy (each a mean over its
global target count, so the value does not depend on the layout). The MTP losses reach the gradient
through `AddLossGrad` on the main model's output before its head, as the MoE auxiliary loss does: the main loss function,
pipeline schedules and activation checkpointing stay as they are. MTP runs only in training; the
tokens it needs (`mtp_tokens`, from `fived.data.documents.future_tokens`) are cut by context
parallelism like the inputs, so a shift that crosses a chunk boundary still reads the right token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from fived.config import ModelConfig


def plain_loss_sum(logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of the valid positions (tensor parallelism swaps in its vocab-parallel one)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    each = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    return (each * valid.flatten().to(each.dtype)).sum()


def mtp_target_counts(m: ModelConfig, global_batch: int, seq_len: int) -> list[int]:
    """The global batch's depth-k targets, k = 1..D (depth k has none at a sequence's last k positions)."""
    return [global_batch * (seq_len - k) for k in range(1, m.mtp_depth + 1)]


def mtp_loss_scales(m: ModelConfig, global_batch: int, seq_len: int) -> list[float]:
    """What each depth's summed cross-entropy is multiplied by in the objective: lambda / D over its
    global target count."""
    return [m.mtp_loss_weight / m.mtp_depth / n for n in mtp_target_counts(m, global_batch, seq_len)]


class AddLossGrad(torch.autograd.Function):
    """Identity on `x` whose backward also seeds `losses` (one per depth) with `scales`, and logs them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, losses: torch.Tensor, scales: torch.Tensor, sink: list):
        ctx.sink, ctx.logged = sink, False
        ctx.save_for_backward(losses, scales)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        losses, scales = ctx.saved_tensors
        # Logged once per micro-batch: a zero-bubble schedule's weight pass runs this node again (it is
        # where the input pass stopped), and needs the seeds again for the MTP weights' gradients.
        if not ctx.logged:
            ctx.sink.append(losses.detach())
            ctx.logged = True
        return grad, scales.to(losses.dtype), None, None


class MTPModule(nn.Module):
    def __init__(self, cfg: ModelConfig, depth: int, block: nn.Module, norm: Callable[[], nn.Module]):
        super().__init__()
        self.depth = depth
        self.enorm, self.hnorm = norm(), norm()
        self.eh_proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = block
        self.norm = norm()  # (the released checkpoints' shared_head.norm)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, *block_args) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        return self.norm(self.block(x, *block_args))


class MultiTokenPrediction(nn.ModuleDict):
    """The D modules (keyed "0".."D-1": parameters `mtp.{k-1}.*`) and what the runtime sets: the
    loss function and the per-depth loss scales."""

    def __init__(self, cfg: ModelConfig, block: Callable[[int], nn.Module], norm: Callable[[], nn.Module]):
        super().__init__({str(k): MTPModule(cfg, k + 1, block(cfg.n_layers + k), norm) for k in range(cfg.mtp_depth)})
        self.loss_sum: Callable = plain_loss_sum  # (tensor parallelism: vocab-parallel)
        self.loss_scales: list[float] = [0.0] * cfg.mtp_depth  # lambda / (D x global targets of depth k)
        self.losses: list[torch.Tensor] = []  # per backward: the depths' summed cross-entropies

    def blocks(self) -> list[nn.Module]:
        return [cast("MTPModule", m).block for m in self.values()]

    def forward(self, hidden: torch.Tensor, future: torch.Tensor, embed, head, block_args: tuple) -> torch.Tensor:
        """`hidden`: the main model's output (final-normed); `future`: [b, s, D+1] the tokens t+1 ..
        t+D+1 (negative past the end: no target there); `embed`, `head`: the shared embedding and
        head; returns `hidden` carrying the MTP losses' gradient (the main head reads it next)."""
        main, losses = hidden, []
        for k, module in enumerate(self.values()):
            hidden = module(hidden, embed(future[..., k].clamp_min(0)), *block_args)
            target = future[..., k + 1]
            valid = target >= 0
            losses.append(self.loss_sum(head(hidden), target.clamp_min(0), valid))
        stacked = torch.stack(losses)
        scales = torch.tensor(self.loss_scales, dtype=stacked.dtype, device=stacked.device)
        return AddLossGrad.apply(main, stacked, scales, self.losses)
