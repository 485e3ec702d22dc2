"""Ulysses (all-to-all) context parallelism's exchanges (DeepSpeed-Ulysses): a group of u ranks, each
holding some tokens of every head, trades them for all of the group's tokens of a u-th of the heads
(before attention), and back (after). Rank j of the group takes heads [j h/u, (j+1) h/u); the group's
tokens arrive rank-major (rank 0's tokens first). Through `fived.parallel.comm` (role cp): all-to-all of q, k,
v forward and of the output back, the reverse in backward, and an all-gather of the tokens' order keys.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fived.parallel import comm


def _all_to_all(send: torch.Tensor, group) -> torch.Tensor:
    """send [u, ...] (piece j for rank j) -> [u, ...] (piece r from rank r)."""
    recv = torch.empty_like(send)
    comm.all_to_all_single(recv, send, group, role="cp")
    return recv


def sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[b, s, h, d] (this rank's tokens, every head) -> [b, u*s, h/u, d] (the group's tokens, rank-major)."""
    u = dist.get_world_size(group)
    b, s, h, d = x.shape
    send = x.reshape(b, s, u, h // u, d).permute(2, 0, 1, 3, 4).contiguous()
    return _all_to_all(send, group).permute(1, 0, 2, 3, 4).reshape(b, u * s, h // u, d)


def heads_to_sequence(y: torch.Tensor, group) -> torch.Tensor:
    """The inverse: [b, u*s, h/u, d] -> [b, s, h, d]."""
    u = dist.get_world_size(group)
    b, us, hh, d = y.shape
    send = y.reshape(b, u, us // u, hh, d).permute(1, 0, 2, 3, 4).contiguous()
    return _all_to_all(send, group).permute(1, 2, 0, 3, 4).reshape(b, us // u, u * hh, d)


class Exchange(torch.autograd.Function):
    """`forward(x, group)` whose gradient goes back by `backward(grad, group)` (its inverse exchange)."""

    @staticmethod
    def forward(ctx, x, group, forward, backward):
        ctx.group, ctx.inverse = group, backward
        return forward(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.inverse(grad, ctx.group), None, None, None


def to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """`sequence_to_heads` with autograd (backward: `heads_to_sequence`)."""
    return Exchange.apply(x, group, sequence_to_heads, heads_to_sequence)


def to_sequence(y: torch.Tensor, group) -> torch.Tensor:
    """`heads_to_sequence` with autograd (backward: `sequence_to_heads`)."""
    return Exchange.apply(y, group, heads_to_sequence, sequence_to_heads)


def _take(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    return x.gather(1, order.view(order.shape + (1,) * (x.dim() - 2)).expand_as(x))


class Reorder(torch.autograd.Function):
    """x [b, n, ...] with each row's tokens in `order` [b, n]; keeps only the order for backward."""

    @staticmethod
    def forward(ctx, x, order):
        ctx.save_for_backward(order)
        return _take(x, order)

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        return _take(grad, order.argsort(dim=1)), None


def gather_keys(keys: torch.Tensor, group) -> torch.Tensor:
    """[b, s] order keys of this rank's tokens -> [b, u*s] of the group's, rank-major."""
    u = dist.get_world_size(group)
    b, s = keys.shape
    out = torch.empty((u * b, s), dtype=keys.dtype, device=keys.device)
    comm.all_gather_single(out, keys.contiguous(), group, role="cp")
    return out.view(u, b, s).permute(1, 0, 2).reshape(b, u * s)


def kv_heads_for_groups(k: torch.Tensor, u: int) -> torch.Tensor:
    """k or v [b, s, hkv, d] with each kv head repeated so that u divides their number (when u is a
    multiple of hkv): rank j then receives the kv head its query heads use."""
    hkv = k.shape[2]
    return k if hkv % u == 0 else k.repeat_interleave(u // hkv, dim=2)
