"""ZeRO-2 reducing every micro-batch's gradients (`parallel.zero2_reduce_every_microbatch`), as
DeepSpeed ZeRO-2 and Megatron-FSDP's optim_grads do: no whole gradient buffer.

Autograd accumulates each parameter's gradient into a tensor of its own (no flat buffer). As soon as
every parameter of a bucket (`fived.layout.spec.flat_buckets`) holds a gradient, the bucket is packed
into a transient buffer in the reduction dtype (float32 in bf16 runs), its parameters' gradients are
let go of (the next micro-batch starts afresh), and it is reduce-scattered over dp_shard (x cp) into
this rank's piece of an accumulator in the reduction dtype. So a reduction hides under every
micro-batch's backward, not only the last one's, bf16 gradients are summed over micro-batches in
float32, and the step's peak holds buckets in flight instead of the whole gradient buffer.

Why it is exact whatever the timing: a reduction is linear, and a bucket is packed and its gradients
dropped on the thread that runs backward, between two parameters' accumulations (autograd's hook runs
after one), so every micro-batch's gradient is reduced exactly once, whichever reduction it falls in.
The timing only has to be the same on every rank of the shard group (the same collectives in the same
order): buckets go strictly from the last to the first, round after round, decided by the same
gradients everywhere.

Under a pipeline schedule a weight-only pass (zero-bubble, zbv, dualpipev) accumulates without
autograd's hooks: its end looks for complete buckets. `finish` reduces what is left, sums the HSDP
replicas once per bucket (the sum over replicas commutes with the sum over micro-batches) and writes
ZeRO-2's shard.

Memory per rank: the accumulator (the shard itself when the reduction dtype is the gradients', else a
float32 one of the shard's size while backward runs), the gradients of buckets not complete yet, and
at most CAST_PIECES_IN_FLIGHT packed buckets in flight (a bucket and its reduced piece).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fived.layout.spec import CAST_PIECES_IN_FLIGHT
from fived.parallel import comm


class MicroBatchReductions:
    """The per-micro-batch counterpart of zero.BucketReductions for ZeRO-2's flat buckets."""

    def __init__(self, dp: Any) -> None:  # (zero.ShardedOptimizerDataParallel: zero imports this module)
        self.dp = dp
        self.members = [[dp.params[i] for i in range(b.first, b.last)] for b in dp.buckets]
        self.next = len(dp.buckets) - 1
        self.pending: list[tuple] = []  # (work, reduced piece, where in the accumulator, packed), oldest first
        self.acc: torch.Tensor | None = None  # this step's reduced shard, in the reduction dtype
        for p in dp.params:
            p.register_post_accumulate_grad_hook(self._on_gradient)

    def arm(self, on: bool) -> None:
        """(Every micro-batch's gradients count, not only the last's: nothing to arm.)"""

    def _on_gradient(self, _param) -> None:
        self._launch()

    def gradients_done(self, stage: nn.Module) -> None:
        """A stage's backward pass ended: a weight-only pass set gradients without autograd's hooks."""
        self._launch()

    def _launch(self) -> None:
        while all(p.grad is not None for p in self.members[self.next]):
            self._start(self.next)
            self.next = self.next - 1 if self.next > 0 else len(self.members) - 1

    def accumulator(self) -> torch.Tensor:
        """Zeroed at the step's first reduction: ZeRO-2's shard itself, or a float32 one (bf16 runs)."""
        shard = self.dp.shard_grad
        assert shard is not None  # (ZeRO-2's)
        if self.acc is None:
            dp = self.dp
            if shard.dtype == dp.reduce_dtype:
                self.acc = shard.zero_()
            else:
                self.acc = torch.zeros(dp.shard_len, dtype=dp.reduce_dtype, device=shard.device)
        return self.acc

    @torch.no_grad()
    def _start(self, k: int) -> None:
        """Bucket k's gradients so far: packed (padding zero), let go of, reduce-scattered."""
        dp, bucket = self.dp, self.dp.buckets[k]
        if len(self.pending) >= CAST_PIECES_IN_FLIGHT:
            self._complete()
        target = self.accumulator()[dp.compact[k] : dp.compact[k] + bucket.piece]
        packed = torch.zeros(bucket.piece * dp.shards, dtype=dp.reduce_dtype, device=target.device)
        for p, offset in zip(self.members[k], dp.offsets[bucket.first : bucket.last]):
            if p.grad is not None:
                packed[offset - bucket.start : offset - bucket.start + p.numel()].copy_(p.grad.reshape(-1))
                p.grad = None
        reduced = packed.new_empty(bucket.piece)
        work = comm.reduce_scatter_single(reduced, packed, dp.shard_group, async_op=True, role="dp")
        self.pending.append((work, reduced, target, packed))

    def _complete(self) -> None:
        work, reduced, target, _packed = self.pending.pop(0)  # (`_packed` alive until its collective is done)
        work.wait()
        target.add_(reduced)

    @torch.no_grad()
    def finish(self) -> None:
        """Reduce the gradients not reduced yet (every bucket still holding one, last to first: the same
        everywhere), sum the replicas, write ZeRO-2's shard."""
        dp = self.dp
        for k in range(len(self.members) - 1, -1, -1):
            if any(p.grad is not None for p in self.members[k]):
                self._start(k)
        while self.pending:
            self._complete()
        acc, shard = self.accumulator(), dp.shard_grad
        assert shard is not None
        if dp.replicate_group is not None:
            for k, bucket in enumerate(dp.buckets):
                comm.all_reduce(acc[dp.compact[k] : dp.compact[k] + bucket.piece], dp.replicate_group, role="dp")
        if acc.data_ptr() != shard.data_ptr():
            shard.copy_(acc)
        self.acc, self.next = None, len(self.members) - 1
