"""ZeRO-0: every rank keeps everything; gradients are summed over dp*cp by all-reduce in buckets that
are launched during backward.

As in torch's DDP, gradients are views into flat bucket buffers (accumulated in place, never
copied), and a bucket is all-reduced as soon as its last gradient is accumulated, so communication
overlaps the rest of the backward pass; buckets launch strictly in order, so every rank issues the
same collectives in the same order. Unlike torch's DDP, the buckets never change. DDP rebuilds them
after the first iteration in the order gradients happened to arrive; the position of a gradient in
its bucket decides how a ring all-reduce over more than two ranks adds it up, so step k's sums
would depend on how many steps this process had run, and a run resumed from a checkpoint would end
a few ulps away from the uninterrupted one. Here a parameter always sits at the same offset of the
same bucket, so resuming changes no digit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from fived.model.transformer import Transformer
from fived.parallel import comm
from fived.parallel.data_parallel import DataParallel


@dataclass
class Bucket:
    params: list[nn.Parameter]
    buffer: torch.Tensor
    ready: int = 0
    pending: list = field(default_factory=list)  # (work, reduced tensor) while the all-reduce runs


def reduce_bucket(buffer: torch.Tensor, group, reduce_dtype: torch.dtype):
    """Start summing `buffer` over `group` in `reduce_dtype`; returns (work, tensor being reduced)."""
    send = buffer if buffer.dtype == reduce_dtype else buffer.to(reduce_dtype)
    return comm.all_reduce(send, group, async_op=True, role="dp"), send


class ReplicatedDataParallel(DataParallel):
    def wrap(self, chunks: list[Transformer]) -> list[Transformer]:
        self.chunks = chunks
        self.group = self.mesh.group("dp_cp")  # context-parallel ranks hold other tokens: reduce over both
        apart = {n for n, _ in self.expert_parameters()}  # (summed over edp at the end, as elsewhere)
        params = [p for n, p in self.named_parameters() if p.requires_grad and n not in apart]
        # Reverse order: roughly the order backward produces the gradients.
        self.buckets: list[Bucket] = []
        group, size = [], 0
        for p in reversed(params):
            group.append(p)
            size += p.numel() * p.element_size()
            if size >= self.mesh.layout.bucket_mb * 2**20:  # (DDP's bucket_cap_mb)
                self.buckets.append(self._bucket(group))
                group, size = [], 0
        if group:
            self.buckets.append(self._bucket(group))
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.next_bucket, self.sync = len(self.buckets), True  # (reset by before_micro_batch)
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_gradient)
        return chunks

    @staticmethod
    def _bucket(params: list[nn.Parameter]) -> Bucket:
        buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        offset = 0
        for p in params:
            p.grad = buffer[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        return Bucket(params, buffer)

    def _on_gradient(self, param: nn.Parameter) -> None:
        if not self.sync:
            return
        self.bucket_of[param].ready += 1
        self._launch(all_buckets=False)

    def _launch(self, all_buckets: bool) -> None:
        """Launch the complete buckets in order from the next one (with all_buckets: every one left)."""
        while self.next_bucket < len(self.buckets):
            bucket = self.buckets[self.next_bucket]
            if not all_buckets and bucket.ready < len(bucket.params):
                return
            bucket.pending.append(reduce_bucket(bucket.buffer, self.group, self.reduce_dtype))
            self.next_bucket += 1

    def before_micro_batch(self, is_last: bool) -> None:
        super().before_micro_batch(is_last)  # (the experts' overlapped edp reduction)
        self.sync = is_last  # earlier micro-batches only accumulate
        if is_last:
            self.next_bucket = 0
            for bucket in self.buckets:
                bucket.ready = 0

    def finish_backward(self) -> None:
        """Complete the reductions backward started (before anything else touches the gradients)."""
        self._launch(all_buckets=True)  # (a parameter without a gradient this step leaves its bucket open)
        for bucket in self.buckets:
            for work, reduced in bucket.pending:
                work.wait()
                if reduced is not bucket.buffer:
                    bucket.buffer.copy_(reduced)
            bucket.pending.clear()

    def reduce_gradients(self) -> None:
        self.finish_backward()
        self.reduce_expert_gradients()

    def zero_grad(self) -> None:
        for bucket in self.buckets:  # the gradients stay views into the buckets
            bucket.buffer.zero_()
        for _, p in self.expert_parameters():
            p.grad = None

    def flat_buffers(self) -> list[torch.Tensor]:
        return [bucket.buffer for bucket in self.buckets]
