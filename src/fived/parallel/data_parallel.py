"""Data parallelism without sharding: every dp rank holds the whole model and the gradients are
summed over the dp group once per optimizer step, after the last micro-batch.

Each rank's loss is already divided by the token count of the *global* batch, so the sum of the
ranks' gradients is the gradient of the global mean loss: no further division is needed, and the
result does not depend on how the batch was split.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

BUCKET_BYTES = 25 * 1024 * 1024  # as DDP's default bucket: few collectives, bounded extra memory


def sum_gradients_over_dp(params: list[torch.nn.Parameter], group, bucket_bytes: int = BUCKET_BYTES) -> None:
    """All-reduce (sum) the gradients of `params` over `group`, packed into flat buckets."""
    if dist.get_world_size(group) == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    for bucket in _buckets(grads, bucket_bytes):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def _buckets(grads: list[torch.Tensor], bucket_bytes: int):
    """Consecutive groups of same-dtype gradients of at most `bucket_bytes` (one tensor may exceed it)."""
    bucket, size = [], 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if bucket and (size + nbytes > bucket_bytes or g.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(g)
        size += nbytes
    if bucket:
        yield bucket
