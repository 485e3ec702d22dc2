"""A windowed layer under ring context parallelism: each rank receives only the keys and values its
queries' windows reach (a halo), not every block around the ring.

Which keys a rank needs is a function of the order keys alone (document << 32 | position, increasing
along each rank's tokens): a key is seen by some query of a rank when the rank's first query at or
after it lies in the same document less than `window` positions later (`window_needs`). Every rank
knows every rank's order keys — computed from the halves layout without documents (the caller hands
them), else gathered once per call (8 bytes a token, what the masked ring passes around anyway) — so
both ends of every pair agree on what travels without asking.

Forward: each rank sends each peer the K/V rows that peer needs (one point-to-point batch), attends
its queries to its own block while they travel, then to the received rows (one padded block per
sequence, in key order; padding keys lie after every query and are never seen), and merges the two
by log-sum-exp; the sinks join once at the end. With the halves layout and a window no longer than a
chunk, that is the window - 1 keys before each chunk that another rank holds. Backward: the received
block's dK, dV (in at least float32) go back to their owners, who add them to their own block's
while the local backward runs. Global layers keep the full ring (`fived.parallel.context`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from fived.model.attention import (
    DOCUMENT_SHIFT,
    blockwise,
    masked_block_backward,
    masked_block_forward,
    merge_block,
    sink_grad,
    with_sinks,
)
from fived.parallel import comm

_PAD_KEY = torch.iinfo(torch.int64).max // 2  # after every real key: a padding key is never seen


def window_needs(kkeys: torch.Tensor, qkeys: torch.Tensor, window: int) -> torch.Tensor:
    """[b, sk] bool: which keys (order keys kkeys [b, sk]) some query of qkeys [b, sq] (increasing)
    sees within `window` — its nearest query at or after it is in its document, < window later."""
    at = torch.searchsorted(qkeys.contiguous(), kkeys.contiguous())
    found = at < qkeys.shape[1]
    nearest = qkeys.gather(1, at.clamp(max=qkeys.shape[1] - 1))
    same = (nearest >> DOCUMENT_SHIFT) == (kkeys >> DOCUMENT_SHIFT)
    return found & same & (nearest - kkeys < window)


@dataclass
class HaloPlan:
    """Who sends what: `sends` (global peer, rows, tokens) of this rank's tokens each peer needs,
    `recvs` (global peer, count) of each peer's; the received rows, in peer order, land at
    (`slot_rows`, `slot_cols`) of the remote block, whose order keys are `remote_keys` [b, n]."""

    sends: list[tuple[int, torch.Tensor, torch.Tensor]]
    recvs: list[tuple[int, int]]
    slot_rows: torch.Tensor
    slot_cols: torch.Tensor
    remote_keys: torch.Tensor


def halo_plan(keys: torch.Tensor, all_keys: torch.Tensor, window: int, group) -> HaloPlan:
    """The exchange for this rank's order keys `keys` [b, s] given every rank's `all_keys` [cp, b, s]."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    sends, recvs, rows, got = [], [], [], []
    for peer in range(size):
        if peer == rank:
            continue
        glob = dist.get_global_rank(group, peer)
        r, t = window_needs(keys, all_keys[peer], window).nonzero(as_tuple=True)
        if len(r):
            sends.append((glob, r, t))
        r, t = window_needs(all_keys[peer], keys, window).nonzero(as_tuple=True)
        if len(r):
            recvs.append((glob, len(r)))
            rows.append(r)
            got.append(all_keys[peer][r, t])
    b = keys.shape[0]
    rows_all = torch.cat(rows) if rows else keys.new_zeros(0)
    keys_all = torch.cat(got) if got else keys.new_zeros(0)
    # sort by (row, key): stable sorts, the key first
    order = keys_all.argsort(stable=True)
    order = order[rows_all[order].argsort(stable=True)]
    counts = torch.bincount(rows_all, minlength=b)
    n = int(counts.max()) if len(rows_all) else 0
    starts = counts.cumsum(0) - counts
    slot_rows, slot_cols = torch.empty_like(rows_all), torch.empty_like(rows_all)
    slot_rows[order] = rows_all[order]
    slot_cols[order] = torch.arange(len(order), device=keys.device) - starts[rows_all[order]]
    remote = _PAD_KEY + torch.arange(n, device=keys.device).expand(b, n).clone()
    remote[slot_rows, slot_cols] = keys_all
    return HaloPlan(sends, recvs, slot_rows, slot_cols, remote)


def _start(sends: list, recvs: list, group) -> comm.Pending | None:
    if not sends and not recvs:
        return None
    return comm.exchange(sends, recvs, group, role="cp")


class WindowRingFunction(torch.autograd.Function):
    """A windowed layer's attention over the cp `group` (`ring_attention` with a window): q
    [b, hq, s, d], k/v [b, hkv, s, d], order keys [b, s] (increasing), every rank's [cp, b, s]."""

    @staticmethod
    def forward(ctx, q, k, v, keys, all_keys, group, window: int, sinks=None):
        scale = q.shape[-1] ** -0.5
        plan = halo_plan(keys, all_keys, window, group)
        sends = [(torch.stack([k[r, :, t], v[r, :, t]]), peer) for peer, r, t in plan.sends]
        heads, dim = k.shape[1], k.shape[3]
        recvs = [(k.new_empty((2, n, heads, dim)), peer) for peer, n in plan.recvs]
        pending = _start(sends, recvs, group)
        with blockwise():
            out, lse = masked_block_forward(q, k, v, keys, keys, scale, window)  # (while the halo travels)
            b, n = plan.remote_keys.shape
            remote_k = k.new_zeros((b, n, heads, dim))
            remote_v = torch.zeros_like(remote_k)
            if pending is not None:
                pending.wait()
                halo = torch.cat([buf for buf, _ in recvs], dim=1)
                remote_k[plan.slot_rows, plan.slot_cols], remote_v[plan.slot_rows, plan.slot_cols] = halo[0], halo[1]
            remote_k, remote_v = remote_k.transpose(1, 2), remote_v.transpose(1, 2)
            if n:
                o, l = masked_block_forward(q, remote_k, remote_v, keys, plan.remote_keys, scale, window)
                merge_block(out, lse, o, l)
        if sinks is not None:  # (every block merged: the sinks join each row's softmax once)
            out, lse = with_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, keys, out, lse, sinks, remote_k, remote_v)
        ctx.group, ctx.window, ctx.plan = group, window, plan
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, keys, out, lse, sinks, remote_k, remote_v = ctx.saved_tensors
        plan, window, scale = ctx.plan, ctx.window, q.shape[-1] ** -0.5
        dout = dout.to(q.dtype)
        dsinks = None if sinks is None else sink_grad(dout, out, lse, sinks).to(sinks.dtype)
        sends, recvs = [], []
        if remote_k.shape[2]:  # the halo's dK, dV first, so they travel under the local backward
            dq_r, dk_r, dv_r = masked_block_backward(
                dout, q, remote_k, remote_v, out, lse, keys, plan.remote_keys, scale, window
            )
            dk_r, dv_r = dk_r.transpose(1, 2), dv_r.transpose(1, 2)
            back = torch.stack([dk_r[plan.slot_rows, plan.slot_cols], dv_r[plan.slot_rows, plan.slot_cols]])
            pieces = back.split([n for _, n in plan.recvs], dim=1)
            sends = [(piece.contiguous(), peer) for piece, (peer, _) in zip(pieces, plan.recvs)]
        heads, dim = k.shape[1], k.shape[3]
        recvs = [(lse.new_empty((2, len(r), heads, dim)), peer) for peer, r, _ in plan.sends]
        pending = _start(sends, recvs, ctx.group)
        dq, dk, dv = masked_block_backward(dout, q, k, v, out, lse, keys, keys, scale, window)
        if remote_k.shape[2]:
            dq += dq_r
        if pending is not None:
            pending.wait()
            for (buf, _), (_, r, t) in zip(recvs, plan.sends):
                dk.transpose(1, 2).index_put_((r, t), buf[0], accumulate=True)
                dv.transpose(1, 2).index_put_((r, t), buf[1], accumulate=True)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, dsinks


def gathered_keys(keys: torch.Tensor, group) -> torch.Tensor:
    """[cp, b, s]: every rank's order keys (one all-gather)."""
    out = keys.new_empty(dist.get_world_size(group) * keys.numel())
    comm.all_gather_single(out, keys.reshape(-1).contiguous(), group, role="cp")
    return out.view(-1, *keys.shape)
