"""Context parallelism: each sequence split over the cp ranks; attention as a ring (cp_mode ring),
by all-to-all (ulysses), or both (hybrid: Ulysses inside groups of cp_ulysses ranks, a ring across).

Load balancing: without document masking a sequence is cut into 2*cp chunks and cp rank i holds chunks
i and 2*cp-1-i, so every rank has the same amount of causal work (an early chunk sees few keys, a
late one many); RoPE uses the tokens' global positions. With document masking the chunks are chosen
per sequence by work (`fived.data.documents`) and every token comes with its document and in-document
position (the model's `documents`, `positions`).

Ring attention (forward): the rank's K/V block travels around the cp ring; at each of the cp steps
a rank attends its queries to the block it holds, while the next block is already being received
(point-to-point, overlapped with the compute), and merges the partial result into its running
output with log-sum-exp weights (online softmax). Because of the chunk layout every block is one
fused attention call with no mask (see `_ring_step_blocks`): the rank's own block is causal, a block
from an earlier rank is seen whole by all queries, a block from a later rank whole by the second
chunk's queries only. The fused kernel (`fived.model.attention`: the CPU flash kernel; flash attention on
CUDA in 16 bits) returns the log-sum-exp and never materialises the score matrix, so memory grows
linearly with the sequence. Backward runs the ring again, the standard flash ring backward: each
block's gradients come from the kernel's backward given the *global* output and log-sum-exp (so its
probabilities are the final ones); K/V travel with their gradient accumulators and after a last hop
every accumulator is home. Only q, k, v, the output and the log-sum-exp are kept.

The masked ring (document masking, and hybrid's ring across Ulysses groups, whose tokens are no
halves layout): K/V travel with their tokens' order keys (document << 32 | position) and each block
runs the document-masked kernel, which skips a block whose keys share no document with the queries.

Sliding windows and attention sinks (GPT-OSS, Gemma 3): a windowed layer exchanges only the K/V its
queries' windows reach (`fived.parallel.context_window`: a halo instead of the ring; its tokens' order
keys from the halves layout's positions when there are no documents); a global layer with sinks runs
the masked ring. The sinks join each row's softmax once all blocks are merged. Ulysses attends its
u-th of the heads with that u-th of the sinks; hybrid's ring across the Ulysses groups exchanges its
windowed layers' halos the same way. `ring_attention(..., halo=False)` keeps the windowed layer on the
masked ring (every block travels; those outside every window are skipped, not computed): the
benchmark's comparison (benchmarks/bench_window_cp.py).

Ulysses (`UlyssesAttention`, exchanges in `fived.parallel.ulysses`): q, k, v are traded for the
group's tokens of a u-th of the heads, sorted into sequence order by their gathered order keys,
attended (causal, document-masked, or hybrid's masked ring), and sent back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fived.layout.cp_chunks import halves_chunks
from fived.model.attention import (
    DocumentAttention,
    block_backward,
    block_forward,
    blockwise,
    kernel_dtype,
    masked_block_backward,
    masked_block_forward,
    order_keys,
    sink_grad,
    with_sinks,
)
from fived.model.transformer import Transformer
from fived.parallel import comm
from fived.parallel.context_window import WindowRingFunction, gathered_keys
from fived.parallel.tensor import ReduceFromTensorParallelRegion as AllReduceSumForward
from fived.parallel.ulysses import Reorder, gather_keys, kv_heads_for_groups, to_heads, to_sequence


def local_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions of the tokens cp rank `rank` holds: chunks rank and 2*cp-1-rank."""
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in halves_chunks(cp)[rank]])


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
        scale, acc = d**-0.5, torch.promote_types(q.dtype, torch.float32)
        # [b, s, h, d] storage, so the caller's transpose back and reshape for wo is a view
        out = q.new_empty((b, s, h, d), dtype=acc).transpose(1, 2)
        lse = q.new_empty((b, h, s), dtype=acc)
        held = [k, v]
        with blockwise():
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
            dqb, dkb, dvb = block_backward(
                dout[:, :, rows],
                q[:, :, rows],
                kb[:, :, keys],
                vb[:, :, keys],
                out[:, :, rows],
                lse[:, :, rows],
                causal,
                scale,
            )
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


class MaskedRingFunction(torch.autograd.Function):
    """The ring for any token layout: each K/V block travels with its tokens' order keys and every
    block is document-masked (`fived.model.attention.masked_block_forward`: a block whose keys share no
    document with the queries is skipped). Local tokens are in increasing key order."""

    @staticmethod
    def forward(ctx, q, k, v, keys, group, window: int = 0, sinks=None):
        size = dist.get_world_size(group)
        scale = q.shape[-1] ** -0.5
        held = [k, v, keys]
        with blockwise():
            for step in range(size):
                pending = _ring_exchange(held, group) if step < size - 1 else None
                o, l = masked_block_forward(q, held[0], held[1], keys, held[2], scale, window)
                if step == 0:  # the rank's own block: every query sees itself, so lse is finite
                    out, lse = o, l
                else:
                    _merge(out, lse, o, l)
                if pending is not None:
                    held, request = pending
                    request.wait()
        if sinks is not None:  # (every block merged: the sinks join each row's softmax once)
            out, lse = with_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, keys, out, lse, sinks)
        ctx.group, ctx.window = group, window
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, keys, out, lse, sinks = ctx.saved_tensors
        group = ctx.group
        size, scale = dist.get_world_size(group), q.shape[-1] ** -0.5
        dout = dout.to(q.dtype)
        dsinks = None if sinks is None else sink_grad(dout, out, lse, sinks).to(sinks.dtype)
        dq = torch.zeros_like(q, dtype=lse.dtype)
        held = [k, v, keys, torch.zeros_like(k, dtype=lse.dtype), torch.zeros_like(v, dtype=lse.dtype)]
        for step in range(size):
            kb, vb, kkeys, dk_acc, dv_acc = held
            dqb, dkb, dvb = masked_block_backward(dout, q, kb, vb, out, lse, keys, kkeys, scale, ctx.window)
            dq += dqb
            dk_acc += dkb
            dv_acc += dvb
            if step < size - 1:
                held, request = _ring_exchange([kb, vb, kkeys, dk_acc, dv_acc], group)
            else:
                held, request = _ring_exchange([dk_acc, dv_acc], group)
            request.wait()
        return dq.to(q.dtype), held[-2].to(k.dtype), held[-1].to(v.dtype), None, None, None, dsinks


def ring_attention(
    q, k, v, keys, group, *, window: int = 0, sinks=None, all_keys=None, halo: bool = True
) -> torch.Tensor:
    """q [b, hq, s, d], k/v [b, hkv, s, d] over the ring `group`: the halves ring without `keys`,
    the masked ring with them ([b, s] order keys, increasing), which also takes per-head `sinks`
    [hq]; a sliding `window` exchanges only the halo (every rank's keys `all_keys` [cp, b, s],
    gathered when not given), or with `halo` False runs the masked ring."""
    if keys is None:
        assert not window and sinks is None  # (windows and sinks run on the masked ring)
        return RingAttentionFunction.apply(q, k, v, group)
    if window and halo:
        all_keys = gathered_keys(keys, group) if all_keys is None else all_keys
        return WindowRingFunction.apply(q, k, v, keys, all_keys, group, window, sinks)
    return MaskedRingFunction.apply(q, k, v, keys, group, window, sinks)


class RingAttention(nn.Module):
    """Drop-in for CausalAttentionCore ([b, s, h, d] in and out) over a cp group: the halves ring,
    or with `documents` the document-masked ring. A windowed layer, or one with sinks, runs the
    masked ring with its tokens' order keys (`positions`: the rank's tokens' positions in the
    halves layout). The kernels run in one dtype (`kernel_dtype`)."""

    def __init__(self, group, *, positions: torch.Tensor | None = None, window: int = 0):
        super().__init__()
        self.group, self.positions, self.window = group, positions, window

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        dtype = kernel_dtype(q, k, v)
        keys = all_keys = None
        if documents is not None:
            assert positions is not None  # (document masking hands the in-document positions too)
            keys = order_keys(documents, positions, q.shape[0])
        elif self.window or sinks is not None:
            assert self.positions is not None
            keys = order_keys(None, self.positions.to(q.device), q.shape[0])
            if self.window:  # every rank's keys are the halves layout's: no need to gather them
                size = dist.get_world_size(self.group)
                held = [local_positions(q.shape[1] * size, size, r, q.device) for r in range(size)]
                all_keys = torch.stack([order_keys(None, p, q.shape[0]) for p in held])
        q, k, v = (t.transpose(1, 2).to(dtype) for t in (q, k, v))
        out = ring_attention(q, k, v, keys, self.group, window=self.window, sinks=sinks, all_keys=all_keys)
        return out.transpose(1, 2)


class UlyssesAttention(nn.Module):
    """Drop-in for CausalAttentionCore over a Ulysses group (`fived.parallel.ulysses`): q, k, v traded
    for the group's tokens of a u-th of the heads, put in sequence order (by their order keys), and
    attended: causal, or document-masked, or — hybrid — by the masked ring across the groups in
    `ring` (each ring rank the same heads); the output goes back to its tokens."""

    def __init__(self, group, positions: torch.Tensor, ring=None, *, window: int = 0):
        """`positions`: the rank's tokens' positions in the halves layout (without document masking);
        `window`: the layer's sliding window (0: none)."""
        super().__init__()
        self.group, self.ring, self.positions, self.window = group, ring, positions, window

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        dtype, u = kernel_dtype(q, k, v), dist.get_world_size(self.group)
        if sinks is not None:  # (this rank attends the group's tokens for its u-th of the heads)
            sinks = sinks.view(u, -1)[dist.get_rank(self.group)]
        given = self.positions if documents is None else positions
        assert given is not None  # (document masking hands the in-document positions too)
        positions = given.to(q.device)
        keys = gather_keys(order_keys(documents, positions, q.shape[0]), self.group)
        q, k, v = (to_heads(t.to(dtype), self.group) for t in (q, kv_heads_for_groups(k, u), kv_heads_for_groups(v, u)))
        order = keys.argsort(dim=1, stable=True)
        keys = keys.gather(1, order)
        q, k, v = (Reorder.apply(t, order).transpose(1, 2) for t in (q, k, v))
        if self.ring is not None:
            out = ring_attention(q, k, v, keys, self.ring, window=self.window, sinks=sinks)
        elif documents is not None or self.window or sinks is not None:
            out = DocumentAttention.apply(q, k, v, keys, sinks, self.window)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1]
            )
        return to_sequence(Reorder.apply(out.transpose(1, 2), order.argsort(dim=1)), self.group)


def apply_context_parallel(chunks: list[Transformer], mesh, cfg) -> torch.Tensor:
    """Swap every attention core for the cp mode's (ring, Ulysses, or Ulysses groups joined by a
    ring), give RoPE the global positions (of the halves layout; document masking brings its own per
    batch), and make the MoE load-balancing statistics cover the whole sequence. Returns this rank's
    token positions in the halves layout."""
    group, mode = mesh.group("cp"), mesh.layout.cp_mode
    positions = local_positions(cfg.train.seq_len, mesh.cp, mesh.rank("cp"))
    for chunk in chunks:
        chunk.positions = positions
        for block in chunk.blocks():
            window = getattr(block.attention.core, "window", 0)  # (the layer's sliding window)
            if mode == "ring":
                block.attention.core = RingAttention(group, positions=positions, window=window)
            elif mode == "ulysses":
                block.attention.core = UlyssesAttention(group, positions, window=window)
            else:
                ulysses, ring = mesh.group("cp_ulysses"), mesh.group("cp_ring")
                block.attention.core = UlyssesAttention(ulysses, positions, ring=ring, window=window)
            moe = block.feed_forward
            if hasattr(moe, "reduce_sequence_stats"):  # (after folding's sum over tp, if any)
                moe.reduce_sequence_stats = lambda t, g=group, f=moe.reduce_sequence_stats: AllReduceSumForward.apply(
                    f(t), g
                )
    return positions
