"""Attention kernels: fused blocks that return their log-sum-exp (ring attention merges them and
gives each block's backward the global output and log-sum-exp), and document-masked attention.

Blocks without a mask are causal or whole: the CPU flash kernel (float64/float32/bf16) on CPU, flash
attention on CUDA in 16 bits, a plain-matmul reference for float32/float64 on CUDA.

Document masking: a token sees the tokens of its own document at in-document positions up to its own
(block-diagonal causal). Tokens are described by one order key each, document * 2^32 + position,
which increases along a packed sequence. `masked_block_forward`/`masked_block_backward` take a block of
queries and one of keys, both in increasing key order, and cut the queries into tiles of QUERY_TILE;
a tile's visible keys are one contiguous range (from its first document's start to its last query),
found by binary search, and only that range is computed. Tiles follow the documents
(`_query_tiles`): a tile holds one long document's queries, or several short documents' (up to
PACKED_TILE), so the computed pairs stay close to the pairs the mask allows. A tile inside one
document sees the keys up to its first query whole (one unmasked fused call) and needs a mask only
for the rest (`_pieces`); the explicit masks are thus about a tile square:
  - CPU: SDPA's CPU flash kernel, unmasked or with an additive mask of its piece's size (never the
    whole score matrix, never saved for backward; a band of consecutive positions of one document
    comes from a small cache, `piece_mask`, any other is rebuilt in backward). Work follows the
    documents: a tile whose range is empty is skipped, so is a whole block (a ring step) whose keys
    share no document with its queries.
  - CUDA: the unmasked pieces on `block_forward`'s kernels, the masked ones on the reference path
    below (explicit scores, any dtype). A fused CUDA kernel for document masks (flex attention's
    block masks, varlen flash) is not wired in: no GPU here to verify it against this reference.
Rows that see no key in a block get output 0 and log-sum-exp -inf, so merging the block is a no-op.

Sliding windows (Mistral, Gemma 3, GPT-OSS): a windowed query also needs key position > its own -
window. The same pieces serve: a tile's keys start at max(its document's start, its first query -
window + 1), tiles hold at most `window` queries (so a tile computes under 2 x window keys), and
every windowed piece carries its mask.

Attention sinks (GPT-OSS): a learned logit per head joins every row's softmax with a zero value, so
out' = out * exp(lse - lse') with lse' = logaddexp(lse, sink); the blocks' backward given (out', lse')
is exact for q, k, v (as a ring's blocks given the global output), and d sink = -sum exp(sink - lse')
* rowsum(dout * out') (`with_sinks`, `sink_grad`).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict

import torch

from fived.layout.attention_tiles import PACKED_TILE, QUERY_TILE, query_tiles, split_tiles

aten = torch.ops.aten
# QUERY_TILE, PACKED_TILE: the tiles' sizes live with the planner's count of them (layout.attention_tiles);
# `_pieces` reads this module's names at each call, so a test may set them here
DOCUMENT_SHIFT = 32  # order key = document << 32 | position (positions < 2^32)

_blockwise_depth = [0]  # > 0 while blockwise attention runs (selective checkpointing recomputes its blocks)


@contextlib.contextmanager
def blockwise():
    _blockwise_depth[0] += 1
    try:
        yield
    finally:
        _blockwise_depth[0] -= 1


def inside_blockwise() -> bool:
    """Whether a ring or a document-masked attention is running its blocks (their kernels are
    recomputed under selective checkpointing, not cached: their number depends on the data)."""
    return _blockwise_depth[0] > 0


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
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    if uses_cuda_flash(q):
        ke, ve = _expand_kv(q, k, v)
        no_rng = torch.zeros((), dtype=torch.int64, device=q.device)  # unused: no dropout
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dout, q, ke, ve, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, no_rng, no_rng, scale=scale
        )
        return dq, _sum_groups(dk, k.shape[1]), _sum_groups(dv, k.shape[1])
    return reference_block_backward(dout, q, k, v, out, lse, causal, scale)


def _sum_groups(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h, s, d = grad.shape
    return grad if h == kv_heads else grad.view(b, kv_heads, h // kv_heads, s, d).sum(2)


def _math_scores(q, ke, causal, scale, mask=None):
    scores = (q @ ke.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return scores if mask is None else scores + mask


def reference_block_forward(q, k, v, causal, scale, mask=None):
    """Reference path (CUDA in float32/float64, where no flash kernel takes the dtype, and CUDA's
    document-masked tiles; also what benchmarks/gpu_acceptance.py holds the fused kernels to):
    explicit scores, plus an additive `mask`."""
    ke, ve = _expand_kv(q, k, v)
    scores = _math_scores(q, ke, causal, scale, mask)
    lse = torch.logsumexp(scores, dim=-1)
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # (rows that see nothing: 0 out)
    return torch.exp(scores - finite[..., None]) @ ve, lse


def reference_block_backward(dout, q, k, v, out, lse, causal, scale, mask=None):
    ke, ve = _expand_kv(q, k, v)
    probs = torch.exp(_math_scores(q, ke, causal, scale, mask) - lse[..., None])
    dv = probs.transpose(-1, -2) @ dout
    ds = probs * (dout @ ve.transpose(-1, -2) - (dout * out).sum(-1, keepdim=True))
    dq, dk = (ds @ ke) * scale, (ds.transpose(-1, -2) @ q) * scale
    return dq, _sum_groups(dk, k.shape[1]), _sum_groups(dv, k.shape[1])


# --- document masking -----------------------------------------------------------------------------


def order_keys(documents: torch.Tensor | None, positions: torch.Tensor, batch: int) -> torch.Tensor:
    """[b, s] int64 order keys of tokens (document << 32 | position); no documents: one document."""
    positions = positions.expand(batch, positions.shape[-1]).long()
    return positions if documents is None else (documents.long() << DOCUMENT_SHIFT) | positions


def _pieces(qkeys: torch.Tensor, kkeys: torch.Tensor, window: int = 0) -> list[tuple[int, int, int, int, int, bool]]:
    """(row, first query, end query, first key, end key, masked) of every kernel call: each query tile
    that sees some key, its keys running from its first query's document start to its last query. A
    tile inside one document splits in two: the keys at or before its first query's position, which
    every query of the tile sees (no mask), and the rest (masked; about the tile's own length). With a
    `window`, a tile's keys start `window` - 1 before its first query and every piece is masked."""
    out = []
    for row in range(qkeys.shape[0]):
        docs = qkeys[row] >> DOCUMENT_SHIFT
        bounds = [0] + (torch.nonzero(docs[1:] != docs[:-1]).flatten() + 1).tolist() + [qkeys.shape[1]]
        tiles = split_tiles(query_tiles(bounds, QUERY_TILE, PACKED_TILE), window)
        first = torch.tensor([a for a, _ in tiles], device=qkeys.device)
        last = torch.tensor([z - 1 for _, z in tiles], device=qkeys.device)
        start = (qkeys[row, first] >> DOCUMENT_SHIFT) << DOCUMENT_SHIFT
        if window:  # (same document: key differences are position differences)
            start = torch.maximum(start, qkeys[row, first] - (window - 1))
        lo = torch.searchsorted(kkeys[row], start).tolist()
        mid = torch.searchsorted(kkeys[row], qkeys[row, first], right=True).tolist()
        hi = torch.searchsorted(kkeys[row], qkeys[row, last], right=True).tolist()
        one_document = (docs[first] == docs[last]).tolist()
        for (a, z), k0, km, k1, whole in zip(tiles, lo, mid, hi, one_document):
            km = min(max(km, k0), k1) if whole and not window else k0
            if km > k0:
                out.append((row, a, z, k0, km, False))
            if k1 > km:
                out.append((row, a, z, km, k1, True))
    return out


def _visible(qkeys: torch.Tensor, kkeys: torch.Tensor, window: int = 0) -> torch.Tensor:
    """[sq, sk]: same document, key position <= query position (and > query position - window)."""
    same = (qkeys[:, None] >> DOCUMENT_SHIFT) == (kkeys[None, :] >> DOCUMENT_SHIFT)
    seen = same & (kkeys[None, :] <= qkeys[:, None])
    return seen & (kkeys[None, :] > qkeys[:, None] - window) if window else seen


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.full(allowed.shape, float("-inf"), dtype=dtype, device=allowed.device).masked_fill_(allowed, 0.0)


# A piece whose queries and keys are each consecutive positions of one document (every windowed
# piece without documents, every masked piece inside one document) has a mask that depends only on
# its shape, the queries' offset from its keys, the window and the dtype: built once, reused by every
# such piece of every layer, step and backward. Least recently used first out past MASK_CACHE_BYTES.
MASK_CACHE_BYTES = 64 << 20
_mask_cache: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor | None]] = OrderedDict()


def _band_mask(sq: int, sk: int, offset: int, window: int, dtype: torch.dtype, device: torch.device):
    """(additive mask, which rows see a key or None: all) of queries at offset + i and keys at j."""
    gap = torch.arange(offset, offset + sq, device=device)[:, None] - torch.arange(sk, device=device)[None, :]
    allowed = gap >= 0
    if window:
        allowed &= gap < window
    seen = allowed.any(dim=-1)
    return _additive(allowed, dtype), None if bool(seen.all()) else seen


def piece_mask(qkeys: torch.Tensor, kkeys: torch.Tensor, window: int, dtype: torch.dtype):
    """(additive mask [sq, sk], rows that see some key [sq] or None: all) of a masked piece's order
    keys; the band of consecutive positions of one document from the cache."""
    sq, sk = len(qkeys), len(kkeys)
    q0, q1, k0, k1 = torch.stack([qkeys[0], qkeys[-1], kkeys[0], kkeys[-1]]).tolist()
    one_document = q0 >> DOCUMENT_SHIFT == q1 >> DOCUMENT_SHIFT == k0 >> DOCUMENT_SHIFT == k1 >> DOCUMENT_SHIFT
    if not (one_document and q1 - q0 == sq - 1 and k1 - k0 == sk - 1):
        allowed = _visible(qkeys, kkeys, window)
        return _additive(allowed, dtype), allowed.any(dim=-1)
    key = (sq, sk, q0 - k0, window, dtype, qkeys.device)
    if key in _mask_cache:
        _mask_cache.move_to_end(key)
        return _mask_cache[key]
    found = _mask_cache[key] = _band_mask(sq, sk, q0 - k0, window, dtype, qkeys.device)
    held = sum(mask.nbytes for mask, _ in _mask_cache.values())
    while held > MASK_CACHE_BYTES and len(_mask_cache) > 1:
        held -= _mask_cache.popitem(last=False)[1][0].nbytes
    return found


def merge_block(out, lse, o, l) -> None:
    """Fold a piece's (output, log-sum-exp) into the running ones, in place; rows that have seen no
    key yet carry -inf and output 0, and stay so when the piece shows them none either."""
    new = torch.logaddexp(lse, l)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    out.mul_(torch.exp(lse - safe)[..., None]).add_(o * torch.exp(l - safe)[..., None])
    lse.copy_(new)


def masked_block_forward(q, k, v, qkeys, kkeys, scale: float, window: int = 0):
    """(output in at least float32, log-sum-exp) of q [b, hq, sq, d] attending to k, v [b, hkv, sk, d]
    under the document mask of the order keys qkeys [b, sq], kkeys [b, sk] (each increasing), and
    the sliding `window` (0: none)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    b, h, s, d = q.shape
    # [b, s, h, d] storage, so the caller's transpose back and reshape for wo is a view
    out = torch.zeros((b, s, h, d), dtype=acc, device=q.device).transpose(1, 2)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    for row, q0, q1, k0, k1, masked in _pieces(qkeys, kkeys, window):
        args = (q[row : row + 1, :, q0:q1], k[row : row + 1, :, k0:k1], v[row : row + 1, :, k0:k1])
        if not masked:
            o, l = block_forward(*args, False, scale)
        else:
            mask, seen = piece_mask(qkeys[row, q0:q1], kkeys[row, k0:k1], window, q.dtype)
            if q.device.type == "cpu":
                o, l = aten._scaled_dot_product_flash_attention_for_cpu(*args, 0.0, False, attn_mask=mask, scale=scale)
            else:
                o, l = reference_block_forward(*args, False, scale, mask)
            if seen is not None:
                o = o.masked_fill(~seen[None, None, :, None], 0.0)
                l = l.masked_fill(~seen[None, None, :], float("-inf"))
        merge_block(out[row, :, q0:q1], lse[row, :, q0:q1], o[0], l[0])
    return out, lse


def masked_block_backward(dout, q, k, v, out, lse, qkeys, kkeys, scale: float, window: int = 0):
    """(dq, dk, dv), in at least float32, of one document-masked block, given the global output and
    log-sum-exp of these queries."""
    acc = torch.promote_types(q.dtype, torch.float32)
    dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (q, k, v))
    for row, q0, q1, k0, k1, masked in _pieces(qkeys, kkeys, window):
        rows, keys = (
            (slice(row, row + 1), slice(None), slice(q0, q1)),
            (slice(row, row + 1), slice(None), slice(k0, k1)),
        )
        args = (dout[rows], q[rows], k[keys], v[keys], out[rows], lse[rows])
        if not masked:
            g = block_backward(*args, False, scale)
        else:
            mask = piece_mask(qkeys[row, q0:q1], kkeys[row, k0:k1], window, q.dtype)[0]
            if q.device.type == "cpu":
                g = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    *args, 0.0, False, attn_mask=mask, scale=scale
                )
            else:
                g = reference_block_backward(*args, False, scale, mask)
        dq[rows] += g[0]
        dk[keys] += g[1]
        dv[keys] += g[2]
    return dq, dk, dv


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor):
    """(out', lse') once each row's softmax also holds its head's sink logit (`sinks` [h])."""
    total = torch.logaddexp(lse, sinks.to(lse.dtype)[None, :, None])
    return out * torch.exp(lse - total)[..., None], total


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks [h], given the output and log-sum-exp with the sinks (`with_sinks`)."""
    share = torch.exp(sinks.to(lse.dtype)[None, :, None] - lse)  # [b, h, s]: the sink's probability
    return -(share * (dout.to(out.dtype) * out).sum(-1)).sum((0, 2))


class DocumentAttention(torch.autograd.Function):
    """Document-masked (and windowed, and sinked) attention of q [b, hq, s, d] over k, v [b, hkv, s, d]
    (one device); keys [b, s]; `sinks` [hq] or None."""

    @staticmethod
    def forward(ctx, q, k, v, keys, sinks=None, window: int = 0, scale: float | None = None):
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        with blockwise():
            out, lse = masked_block_forward(q, k, v, keys, keys, scale, window)
        if sinks is not None:
            out, lse = with_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.window, ctx.scale = window, scale
        ctx.save_for_backward(q, k, v, out, lse, keys, sinks)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, keys, sinks = ctx.saved_tensors
        dout = dout.to(q.dtype).contiguous()
        dq, dk, dv = masked_block_backward(dout, q, k, v, out, lse, keys, keys, ctx.scale, ctx.window)
        dsinks = None if sinks is None else sink_grad(dout, out, lse, sinks).to(sinks.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, dsinks, None, None


def kernel_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.dtype:
    """The one dtype attention kernels run in: autocast's where it is on (as SDPA would), else the
    inputs' common type."""
    kind = q.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)


def document_attention(
    q,
    k,
    v,
    documents: torch.Tensor | None,
    positions: torch.Tensor,
    *,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """[b, s, h, d] in and out: attention within documents (None: one per row), within a sliding
    `window` (0: none), with per-head `sinks` (see the module's docstring)."""
    dtype = kernel_dtype(q, k, v)
    keys = order_keys(documents, positions, q.shape[0])
    q, k, v = (t.transpose(1, 2).to(dtype) for t in (q, k, v))
    return DocumentAttention.apply(q, k, v, keys, sinks, window, scale).transpose(1, 2)
