"""Context parallelism: each sequence split over the cp ranks, attention computed as a ring.

Load balancing: a sequence is cut into 2*cp chunks and cp rank i holds chunks i and 2*cp-1-i, so
every rank has the same amount of causal work (an early chunk sees few keys, a late one many).
RoPE uses the tokens' global positions.

Ring attention (forward): the rank's K/V block travels around the cp ring; at each of the cp steps
a rank attends its queries to the block it holds, while the next block is already being received
(point-to-point, overlapped with the compute), and merges the partial result into its running
output with log-sum-exp weights (online softmax). Because of the chunk layout every block is one
fused attention call with no mask (see `_ring_step_blocks`): the rank's own block is causal, a block
from an earlier rank is seen whole by all queries, a block from a later rank whole by the second
chunk's queries only. The fused kernel (the CPU flash kernel; flash attention on CUDA in 16 bits)
returns the log-sum-exp and never materialises the score matrix, so memory grows linearly with the
sequence. Backward runs the ring again, the standard flash ring backward: each block's gradients
come from the kernel's backward given the *global* output and log-sum-exp (so its probabilities are
the final ones); K/V travel with their gradient accumulators and after a last hop every
accumulator is home. Only q, k, v, the output and the log-sum-exp are kept.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fived import comm
from fived.model import Transformer
from fived.parallel.tensor import ReduceFromTensorParallelRegion as AllReduceSumForward

aten = torch.ops.aten


def local_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions of the tokens cp rank `rank` holds: chunks rank and 2*cp-1-rank."""
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, second])


def _ring_exchange(tensors: list[torch.Tensor], group) -> tuple[list[torch.Tensor], comm.Pending]:
    """Start sending `tensors` to the next cp rank and receiving the previous rank's; returns the
    receive buffers and the pending exchange (wait on it before using the buffers)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    nxt = dist.get_global_rank(group, (rank + 1) % size)
    prv = dist.get_global_rank(group, (rank - 1) % size)
    received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
    pending = comm.exchange([(t.contiguous(), nxt) for t in tensors], [(r, prv) for r in received], group, role="cp")
    return received, pending


def _ring_step_blocks(rank: int, source: int, local_len: int):
    """(query slice, key slice, causal) of the one block this rank computes against the K/V of cp
    rank `source`. Local tokens are chunks (rank, 2cp-1-rank), each local_len/2 long."""
    half = local_len // 2
    if source == rank:  # own chunks: in local order the positions increase, so plain causal
        return slice(0, local_len), slice(0, local_len), True
    if source < rank:  # chunk `source` is before both query chunks; chunk 2cp-1-source after both
        return slice(0, local_len), slice(0, half), False
    # source > rank: only the late query chunk sees them, and it sees both key chunks whole
    return slice(half, local_len), slice(0, local_len), False


def uses_cuda_flash(q: torch.Tensor) -> bool:
    """Whether a block of these queries runs CUDA's flash kernel (else, on CUDA, the reference path)."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0


def _expand_kv(q, k, v):
    """CUDA flash takes as many kv heads as query heads (GQA by repetition); the CPU kernel does not need it."""
    groups = q.shape[1] // k.shape[1]
    return (k, v) if groups == 1 else (k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1))


def block_forward(q, k, v, causal: bool, scale: float):
    """(output, log-sum-exp) of q [b, hq, sq, d] attending to k, v [b, hkv, sk, d]; fused kernel."""
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    if uses_cuda_flash(q):
        k, v = _expand_kv(q, k, v)
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        return out, lse
    return reference_block_forward(q, k, v, causal, scale)


def block_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """(dq, dk, dv) of one block, given the global output and log-sum-exp of these queries."""
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    if uses_cuda_flash(q):
        ke, ve = _expand_kv(q, k, v)
        no_rng = torch.zeros((), dtype=torch.int64, device=q.device)  # unused: no dropout
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dout, q, ke, ve, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, no_rng, no_rng,
            scale=scale)
        return dq, _sum_groups(dk, k.shape[1]), _sum_groups(dv, k.shape[1])
    return reference_block_backward(dout, q, k, v, out, lse, causal, scale)


def _sum_groups(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h, s, d = grad.shape
    return grad if h == kv_heads else grad.view(b, kv_heads, h // kv_heads, s, d).sum(2)


def _math_scores(q, ke, causal, scale):
    scores = (q @ ke.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return scores


def reference_block_forward(q, k, v, causal, scale):
    """Reference path (CUDA in float32/float64, where no flash kernel takes the dtype; also what
    benchmarks/gpu_acceptance.py holds the fused kernels to): explicit scores."""
    ke, ve = _expand_kv(q, k, v)
    scores = _math_scores(q, ke, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]) @ ve, lse


def reference_block_backward(dout, q, k, v, out, lse, causal, scale):
    ke, ve = _expand_kv(q, k, v)
    probs = torch.exp(_math_scores(q, ke, causal, scale) - lse[..., None])
    dv = probs.transpose(-1, -2) @ dout
    ds = probs * (dout @ ve.transpose(-1, -2) - (dout * out).sum(-1, keepdim=True))
    dq, dk = (ds @ ke) * scale, (ds.transpose(-1, -2) @ q) * scale
    return dq, _sum_groups(dk, k.shape[1]), _sum_groups(dv, k.shape[1])


_ring_depth = [0]  # > 0 while a ring's forward runs (selective checkpointing recomputes its blocks)


def inside_ring() -> bool:
    return _ring_depth[0] > 0


def _merge(out, lse, block_out, block_lse) -> None:
    """Fold one block's (output, log-sum-exp) into the running ones, in place (online softmax).
    Every query row already has a finite log-sum-exp: the causal block (first) covers its own key."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new)[..., None]).add_(block_out * torch.exp(block_lse - new)[..., None])
    lse.copy_(new)


class RingAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group):
        """q [b, hq, s, d], k/v [b, hkv, s, d]: the local tokens in load-balanced chunk order."""
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        b, h, s, d = q.shape
        scale, acc = d ** -0.5, torch.promote_types(q.dtype, torch.float32)
        # [b, s, h, d] storage, so the caller's transpose back and reshape for wo is a view
        out = q.new_empty((b, s, h, d), dtype=acc).transpose(1, 2)
        lse = q.new_empty((b, h, s), dtype=acc)
        held = [k, v]
        _ring_depth[0] += 1
        try:
            for step in range(size):
                pending = _ring_exchange(held, group) if step < size - 1 else None
                rows, keys, causal = _ring_step_blocks(rank, (rank - step) % size, s)
                o, l = block_forward(q[:, :, rows], held[0][:, :, keys], held[1][:, :, keys], causal, scale)
                if step == 0:
                    out.copy_(o), lse.copy_(l)
                else:
                    _merge(out[:, :, rows], lse[:, :, rows], o, l)
                if pending is not None:
                    held, request = pending
                    request.wait()
        finally:
            _ring_depth[0] -= 1
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        s, scale = q.shape[2], q.shape[-1] ** -0.5
        dout = dout.to(q.dtype)
        dq = torch.zeros_like(q, dtype=lse.dtype)
        held = [k, v, torch.zeros_like(k, dtype=lse.dtype), torch.zeros_like(v, dtype=lse.dtype)]
        for step in range(size):
            kb, vb, dk_acc, dv_acc = held
            rows, keys, causal = _ring_step_blocks(rank, (rank - step) % size, s)
            dqb, dkb, dvb = block_backward(dout[:, :, rows], q[:, :, rows], kb[:, :, keys], vb[:, :, keys],
                                            out[:, :, rows], lse[:, :, rows], causal, scale)
            dq[:, :, rows] += dqb
            dk_acc[:, :, keys] += dkb
            dv_acc[:, :, keys] += dvb
            if step < size - 1:  # pass K/V on with their accumulated gradients
                held, request = _ring_exchange([kb, vb, dk_acc, dv_acc], group)
            else:  # the last hop brings each accumulator back to its owner
                held, request = _ring_exchange([dk_acc, dv_acc], group)
            request.wait()
        dk_home, dv_home = held[-2], held[-1]
        return dq.to(q.dtype), dk_home.to(k.dtype), dv_home.to(v.dtype), None


class RingAttention(nn.Module):
    """Drop-in for CausalAttentionCore ([b, s, h, d] in and out) over a cp group. The kernels run in
    one dtype: autocast's where it is on (as SDPA would), else the inputs' common type."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kind = q.device.type
        if torch.is_autocast_enabled(kind):
            dtype = torch.get_autocast_dtype(kind)
        else:
            dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
        q, k, v = (t.transpose(1, 2).to(dtype) for t in (q, k, v))
        return RingAttentionFunction.apply(q, k, v, self.group).transpose(1, 2)


def apply_context_parallel(chunks: list[Transformer], group, cp: int, rank: int, seq_len: int) -> torch.Tensor:
    """Swap every attention core for ring attention, give RoPE the global positions, and make the MoE
    load-balancing statistics cover the whole sequence. Returns this rank's token positions."""
    positions = local_positions(seq_len, cp, rank)
    for chunk in chunks:
        chunk.positions = positions
        for block in chunk.blocks():
            block.attention.core = RingAttention(group)
            moe = block.feed_forward
            if hasattr(moe, "reduce_sequence_stats"):
                moe.reduce_sequence_stats = lambda t, g=group: AllReduceSumForward.apply(t, g)
    return positions
