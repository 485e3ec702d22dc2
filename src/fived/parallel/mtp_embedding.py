"""Multi-token prediction under pipeline parallelism: the last stage embeds the future tokens with
the first stage's embedding (fived.model.mtp), which lives on pipeline rank 0.

As Megatron-Core does for a tied embedding, the last stage holds a copy of the weights — not a
parameter of its own (no optimizer state, no checkpoint entry, counted once in the gradient norm):
before each step's forward the first stage sends its (tp-local) weights to it, and after backward
the copy's gradient is added to the embedding's, before the data-parallel reduction (so with
ZeRO-0/1/2 not overlapped, whose gradients are still per-parameter then; the layout rules refuse the rest). Under a
V-shaped schedule both stages are on pipeline rank 0: the copy reads the embedding's own weights and
adds its gradient straight into the embedding's.

The copy's lookup computes its weight gradient inside its own backward. A zero-bubble schedule's
weight pass differentiates only the stage's parameters, so the lookup takes one of them (the first MTP
module's embedding norm) as an input it returns no gradient for: that puts it on the weight pass's path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fived.model.mtp import MTPModule
from fived.model.transformer import Transformer
from fived.parallel import comm


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, anchor: torch.Tensor, sink: Callable):
        ctx.save_for_backward(ids)
        ctx.sink, ctx.shape = sink, weight.shape
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        rows = grad.new_zeros(ctx.shape).index_add_(0, ids.flatten(), grad.reshape(-1, ctx.shape[1]))
        ctx.sink(rows)
        return None, None, None, None


class EmbeddingCopy(nn.Module):
    """The lookup of the last stage (tensor parallelism hooks it as the embedding); `weight` is
    read, never a parameter; `sink(rows)` receives its gradient."""

    def __init__(self, weight: Callable[[], torch.Tensor], sink: Callable, anchor: torch.Tensor):
        super().__init__()
        self._weight, self.sink, self.anchor = weight, sink, anchor

    @property
    def weight(self) -> torch.Tensor:
        return self._weight()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _Lookup.apply(ids, self.weight.detach(), self.anchor, self.sink)


def _accumulate(param: torch.Tensor, rows: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = rows.to(param.dtype)
    else:
        param.grad += rows.to(param.grad.dtype)


class MTPEmbeddingLink:
    def __init__(self, group, *, first: Transformer | None, last: Transformer | None, peer: int, shape, device, dtype):
        """`first`/`last`: this rank's first/last stage (None where it holds none); `peer`: the
        global rank of the other end (-1 when one rank holds both)."""
        self.group, self.peer = group, peer
        self.embedding = first.tok_embeddings if first is not None else None
        self.buffer: torch.Tensor | None = None  # the copy's weights (another rank holds the embedding)
        self.grad: torch.Tensor | None = None
        self.copy: EmbeddingCopy | None = None
        if last is None:
            return
        assert last.mtp is not None
        anchor = cast("MTPModule", last.mtp["0"]).enorm.weight  # (a stage parameter: see above)
        assert isinstance(anchor, torch.Tensor)
        if self.embedding is not None:
            weight = self.embedding.weight
            self.copy = EmbeddingCopy(lambda: weight, lambda rows: _accumulate(weight, rows), anchor)
        else:
            buffer = self.buffer = torch.zeros(shape, device=device, dtype=dtype)
            self.copy = EmbeddingCopy(lambda: buffer, self._keep, anchor)
        object.__setattr__(last, "mtp_embeddings", self.copy)  # (not registered: no parameter of the stage)

    def _keep(self, rows: torch.Tensor) -> None:
        self.grad = rows if self.grad is None else self.grad + rows

    def _exchange(self, tensor: torch.Tensor, *, send: bool) -> None:
        pairs = [(tensor, self.peer)]
        comm.exchange(pairs if send else [], [] if send else pairs, self.group, role="pp").wait()

    @torch.no_grad()
    def sync_weights(self) -> None:
        """Before a step's forward: the first stage's weights to the last stage's copy."""
        if self.peer < 0:
            return
        if self.buffer is not None:
            self._exchange(self.buffer, send=False)
        elif self.embedding is not None:
            self._exchange(self.embedding.weight.detach().contiguous(), send=True)

    @torch.no_grad()
    def add_gradient(self) -> None:
        """After backward, before the dp reduction: the copy's gradient into the embedding's."""
        if self.peer < 0:
            return
        if self.buffer is not None:
            self._exchange(self.grad if self.grad is not None else torch.zeros_like(self.buffer), send=True)
            self.grad = None
        elif self.embedding is not None:
            received = torch.empty_like(self.embedding.weight)
            self._exchange(received, send=False)
            _accumulate(self.embedding.weight, received)


def link_mtp_embedding(chunks: list[Transformer], mesh, *, has_first: bool, last_rank: int, shape, device, dtype):
    """The link of this rank (None when this rank holds neither end)."""
    first = next((c for c in chunks if c.tok_embeddings is not None), None) if has_first else None
    last = next((c for c in chunks if c.mtp is not None and c.output is not None), None)
    if first is None and last is None:
        return None
    group = mesh.group("pp")
    peer = -1 if last_rank == 0 else dist.get_global_rank(group, last_rank if mesh.rank("pp") == 0 else 0)
    return MTPEmbeddingLink(group, first=first, last=last, peer=peer, shape=shape, device=device, dtype=dtype)
