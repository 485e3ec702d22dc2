"""Context parallelism: each sequence split over the cp ranks, attention computed as a ring.

Load balancing: a sequence is cut into 2*cp chunks and cp rank i holds chunks i and 2*cp-1-i, so
every rank has the same amount of causal work (an early chunk sees few keys, a late one many).
RoPE and the causal mask use the tokens' global positions.

Ring attention (forward): the rank's K/V block travels around the cp ring; at each of the cp steps
a rank attends its queries to the block it holds (masked by global positions), while the next block
is already being received (point-to-point, overlapped with the compute), and merges the partial
result into its running output with log-sum-exp weights (online softmax). Backward runs the ring
again: K/V travel with their gradient accumulators, each rank adds its contribution, and after a
last hop every accumulator is home. Only q, k, v, the output and the log-sum-exp are kept.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fived.parallel.tensor import ReduceFromTensorParallelRegion as AllReduceSumForward


def local_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions of the tokens cp rank `rank` holds: chunks rank and 2*cp-1-rank."""
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, second])


def _ring_exchange(tensors: list[torch.Tensor], group) -> tuple[list[torch.Tensor], list]:
    """Start sending `tensors` to the next cp rank and receiving the previous rank's; returns the
    receive buffers and the pending requests (wait on them before using the buffers)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    nxt = dist.get_global_rank(group, (rank + 1) % size)
    prv = dist.get_global_rank(group, (rank - 1) % size)
    received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, prv, group) for r in received]
    return received, dist.batch_isend_irecv(ops)


def _block(q, k, v, mask, scale):
    """Attention of q to one K/V block: (output, log-sum-exp); rows with no visible key give 0, -inf.
    q [b, h, sq, d]; k, v [b, h, sk, d] (kv heads already expanded); mask [sq, sk], True = visible."""
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - safe[..., None])
    return probs @ v, lse, probs


class RingAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, positions, group):
        """q [b, hq, s, d], k/v [b, hkv, s, d] (local tokens); positions [s] global."""
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        scale, groups = q.shape[-1] ** -0.5, q.shape[1] // k.shape[1]
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        held = [k, v, positions]
        for step in range(size):
            pending = _ring_exchange(held, group) if step < size - 1 else None
            kb, vb, pos_b = held
            mask = positions[:, None] >= pos_b[None, :]
            o, l, _ = _block(q, kb.repeat_interleave(groups, 1), vb.repeat_interleave(groups, 1), mask, scale)
            new = torch.logaddexp(lse, l)
            new_safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
            out = out * torch.exp(lse - new_safe)[..., None] + o * torch.exp(l - new_safe)[..., None]
            lse = new
            if pending is not None:
                received, reqs = pending
                for r in reqs:
                    r.wait()
                held = received
        ctx.save_for_backward(q, k, v, out, lse, positions)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, positions = ctx.saved_tensors
        group = ctx.group
        size = dist.get_world_size(group)
        scale, groups = q.shape[-1] ** -0.5, q.shape[1] // k.shape[1]
        delta = (dout * out).sum(dim=-1, keepdim=True)
        dq = torch.zeros_like(q)
        held = [k, v, positions, torch.zeros_like(k), torch.zeros_like(v)]
        for step in range(size):
            kb, vb, pos_b, dk_acc, dv_acc = held
            mask = positions[:, None] >= pos_b[None, :]
            ke, ve = kb.repeat_interleave(groups, 1), vb.repeat_interleave(groups, 1)
            scores = (q @ ke.transpose(-1, -2)) * scale
            probs = torch.exp(scores.masked_fill(~mask, float("-inf")) - lse[..., None])
            dv = probs.transpose(-1, -2) @ dout
            dp = dout @ ve.transpose(-1, -2)
            ds = probs * (dp - delta)
            dq += (ds @ ke) * scale
            dk = (ds.transpose(-1, -2) @ q) * scale
            b, h, s, d = dk.shape
            dk_acc = dk_acc + dk.view(b, h // groups, groups, s, d).sum(2)
            dv_acc = dv_acc + dv.view(b, h // groups, groups, s, d).sum(2)
            if step < size - 1:  # pass K/V on with their accumulated gradients
                received, reqs = _ring_exchange([kb, vb, pos_b, dk_acc, dv_acc], group)
            else:  # the last hop brings each accumulator back to its owner
                received, reqs = _ring_exchange([dk_acc, dv_acc], group)
            for r in reqs:
                r.wait()
            held = received
        dk_home, dv_home = held[-2], held[-1]
        return dq, dk_home, dv_home, None, None


class RingAttention(nn.Module):
    """Drop-in for CausalAttentionCore ([b, s, h, d] in and out) over a cp group."""

    def __init__(self, group, positions: torch.Tensor):
        super().__init__()
        self.group = group
        self.positions = positions

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        dtype = torch.promote_types(q.dtype, torch.float32)  # softmax statistics in at least fp32
        out = RingAttentionFunction.apply(q.to(dtype), k.to(dtype), v.to(dtype),
                                          self.positions.to(q.device), self.group)
        return out.to(q.dtype).transpose(1, 2)


def apply_context_parallel(chunks: list[nn.Module], group, cp: int, rank: int, seq_len: int) -> torch.Tensor:
    """Swap every attention core for ring attention, give RoPE the global positions, and make the MoE
    load-balancing statistics cover the whole sequence. Returns this rank's token positions."""
    positions = local_positions(seq_len, cp, rank)
    for chunk in chunks:
        chunk.positions = positions
        for block in chunk.layers.values():
            block.attention.core = RingAttention(group, positions)
            moe = block.feed_forward
            if hasattr(moe, "reduce_sequence_stats"):
                moe.reduce_sequence_stats = lambda t, g=group: AllReduceSumForward.apply(t, g)
    return positions
