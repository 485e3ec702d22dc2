"""ZeRO-1 and ZeRO-2 over flat, balanced shards (PyTorch has no equivalent).

All parameters of the rank live in one flat buffer, padded to a multiple of the dp_shard size;
rank r of the dp_shard group owns the contiguous slice [r*L, (r+1)*L). Per step:
  1. micro-batches accumulate gradients into a flat gradient buffer of the same layout;
  2. one reduce-scatter (SUM) over dp_shard leaves each rank the reduced gradients of its slice
     (then, with HSDP replicas, one all-reduce of that slice over dp_replicate);
  3. AdamW updates only the slice — its parameters are views into the flat buffer, split at
     parameter boundaries so weight decay still follows each parameter;
  4. one all-gather over dp_shard refreshes every parameter.
ZeRO-1 keeps the full gradient buffer between steps (reduce-scatter in place); ZeRO-2 frees it
after the reduce-scatter and keeps only the slice's reduced gradients (with
`parallel.zero2_reduce_every_microbatch` it never has one: fived.parallel.zero_microbatch). "Stage 0" here (used under
pipeline schedules, where DDP's hooks would fire inside the schedule) is the same flat buffer
unsharded: one all-reduce over dp per step.

With `parallel.overlap_grad_reduce` / `overlap_param_gather` (Megatron-Core's --overlap-grad-reduce /
--overlap-param-gather) the flat buffer is cut into buckets of about `parallel.bucket_mb` at parameter
boundaries, each padded and sharded on its own (`fived.layout.spec.flat_buckets`: rank r owns the r-th
piece of every bucket), so that:
  - a bucket's reduce-scatter starts as soon as the last micro-batch's backward has accumulated its
    last gradient (under a pipeline schedule: that stage's last backward), in bucket order from the
    last, identical on every rank; the trainer waits for them only after the backward;
  - after the optimizer step each bucket's all-gather starts at once, and a module waits for its
    bucket only when the next forward reaches it.
Without either switch there is one bucket: the layout above.

Bytes per parameter held per rank (b = parameter dtype size, S = dp_shard):
  ZeRO-1: params b + grads b + Adam 2b/S;   ZeRO-2: params b + grads b/S + Adam 2b/S.
In bf16 runs (train.dtype=bfloat16) the buffers are bf16 and the optimizer updates float32 masters
of this rank's slices (master 4 + Adam 8 bytes, over S): ZeRO-1 2 + 2 + 12/S, ZeRO-2 2 + 14/S.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fived.layout.spec import (
    CAST_PIECES_IN_FLIGHT,
    REDUCE_CHUNK_ELEMENTS,
    FlatBucket,
    FlatLayout,
    Stored,
    TensorSpec,
    in_flat_buffer,
)
from fived.model.transformer import Transformer
from fived.parallel import comm
from fived.parallel.data_parallel import DataParallel
from fived.parallel.zero_microbatch import MicroBatchReductions


class ShardedOptimizerDataParallel(DataParallel):
    def shard(self, chunks: list[Transformer]) -> None:
        """The flat layout, decided on the meta device: which parameters, their offsets, this rank's
        slice (so the placement table knows each parameter's flat range before anything exists)."""
        self.chunks = chunks
        self.stage = self.mesh.layout.zero
        if self.stage == 0:  # unsharded (under pipeline schedules): one all-reduce over dp
            self.shards, rank = 1, 0
        else:
            self.shards = self.mesh.layout.shards  # context-parallel ranks shard too
            rank = self.mesh.rank("dp_shard_cp")
        apart = {n for n, _ in self.expert_parameters()}
        named = [(n, p) for n, p in self.named_parameters() if p.requires_grad and n not in apart]
        self.names = [n for n, _ in named]
        self.numels = [p.numel() for _, p in named]
        self.index = {n: i for i, n in enumerate(self.names)}
        p = self.mesh.layout
        self.overlap_reduce, self.overlap_gather = p.overlap_grad_reduce, p.overlap_param_gather
        self.every_micro = p.zero2_reduce_every_microbatch  # (fived.parallel.zero_microbatch)
        layout_cap = self.mesh.layout.bucket_elements(self.precision.weights.itemsize)
        self.flat = FlatLayout(self.names, self.numels, self.shards, layout_cap)
        self.buckets: list[FlatBucket] = self.flat.buckets
        self.bucket_of_param, self.offsets = self.flat.bucket_of, self.flat.offsets
        self.shard_rank = rank
        self.shard_len = sum(bucket.piece for bucket in self.buckets)  # elements this rank owns, padding included
        # where each bucket's owned piece sits in ZeRO-2's compact gradient shard
        self.compact = [sum(b.piece for b in self.buckets[:k]) for k in range(len(self.buckets))]

    def storage(self, spec: TensorSpec) -> Stored:
        if (spec.name in self.index) != in_flat_buffer(spec, self.mesh.ep):
            raise RuntimeError(f"{spec.name}: the runtime's flat buffer and the sharding spec disagree on it")
        return self.data_rank().stored(spec, self.flat)

    def wrap(self, chunks: list[Transformer]) -> list[Transformer]:
        if self.stage == 0:
            self.shard_group, self.replicate_group = None, self.mesh.group("dp_cp")
        else:
            self.shard_group = self.mesh.group("dp_shard_cp")
            self.replicate_group = self.mesh.group("dp_replicate") if self.mesh.dp_replicate > 1 else None
        by_name = dict(self.named_parameters())
        self.params = [by_name[n] for n in self.names]
        dtype, device = self.params[0].dtype, self.params[0].device
        self.param_buf = torch.zeros(self.shard_len * self.shards, dtype=dtype, device=device)  # (pieces x shards)
        with torch.no_grad():
            for p, offset in zip(self.params, self.offsets):
                n = p.numel()
                self.param_buf[offset : offset + n].copy_(p.reshape(-1))
                p.data = self.param_buf[offset : offset + n].view_as(p)

        self.grad_buf: torch.Tensor | None = None
        if self.stage <= 1:
            self._attach_grad_buffer()
        self.shard_grad = torch.zeros(self.shard_len, dtype=dtype, device=device) if self.stage == 2 else None
        self.segments = self._slice_segments()
        self.reducing: BucketReductions | MicroBatchReductions | None = None
        if self.overlap_reduce:
            self.reducing = MicroBatchReductions(self) if self.every_micro else BucketReductions(self)
        self.gathering: dict[int, Any] = {}  # bucket -> its all-gather's Work in flight (overlap_param_gather)
        if self.overlap_gather:
            self._wait_in_forward()
        return chunks

    def owned_grad(self, k: int) -> torch.Tensor:
        """Where bucket k's reduced piece lives for the optimizer: in the full gradient buffer
        (ZeRO-1), or ZeRO-2's compact shard."""
        if self.stage == 2:
            assert self.shard_grad is not None
            return self.shard_grad[self.compact[k] : self.compact[k] + self.buckets[k].piece]
        lo, hi = self.buckets[k].owned(self.shard_rank)
        return self.full_grads()[lo:hi]

    def _attach_grad_buffer(self) -> None:
        """A flat zeroed gradient buffer; each parameter's .grad is a view, so autograd accumulates
        every micro-batch in place into the flat layout the reduce-scatter needs."""
        self.grad_buf = torch.zeros_like(self.param_buf)
        for p, offset in zip(self.params, self.offsets):
            p.grad = self.grad_buf[offset : offset + p.numel()].view_as(p)

    def _slice_segments(self) -> list[tuple[nn.Parameter, bool]]:
        """This rank's pieces cut at parameter boundaries: (view parameter, decayed?)."""
        segments, self.segment_names = [], []
        for i, (p, name, offset) in enumerate(zip(self.params, self.names, self.offsets)):
            k = self.bucket_of_param[i]
            lo, hi = self.buckets[k].owned(self.shard_rank)
            a, b = max(offset, lo), min(offset + p.numel(), hi)
            if a < b:
                seg = nn.Parameter(self.param_buf[a:b])  # shares the buffer's storage
                seg.grad = self.owned_grad(k)[a - lo : b - lo]
                segments.append((seg, p.dim() >= 2))
                self.segment_names.append(name)
        return segments

    def build_optimizer(self, placements) -> torch.optim.Optimizer:
        # A slice of a matrix is decayed like the matrix (the slices themselves are 1-D).
        decayed = {id(s) for s, decay in self.segments if decay}
        experts = self.expert_parameters()  # not ZeRO-sharded: reduced over edp
        decayed |= {id(p) for _, p in experts}
        tensors = [s for s, _ in self.segments] + [p for _, p in experts]
        optimized = self.with_masters(tensors)  # bf16 runs: float32 masters of the slices, decayed alike
        decayed |= {id(m) for t, m in zip(tensors, optimized) if id(t) in decayed}
        names = self.segment_names + [n for n, _ in experts]
        self.optimizer = self.make_optimizer(list(zip(names, optimized)), placements, lambda p: id(p) in decayed)
        return self.optimizer

    def before_micro_batch(self, is_last: bool) -> None:
        super().before_micro_batch(is_last)  # (the experts' overlapped edp reduction)
        if self.grad_buf is None and not self.every_micro:  # ZeRO-2: a full buffer only while backward runs
            self._attach_grad_buffer()
        if self.reducing is not None and self.mesh.pp == 1:  # (a pipeline says which backward is last)
            self.reducing.arm(is_last)

    def backward_of_stage(self, *, last: bool, weights: bool, stage: nn.Module | None = None) -> None:
        """A pipeline stage's backward starts (`stage` None) or ended (`stage` given): with `last` its
        last micro-batch's, so its buckets may start reducing; a weight-only pass (split-backward
        schedules) accumulates without autograd's hooks, so its end marks the stage's gradients done."""
        super().backward_of_stage(last=last, weights=weights, stage=stage)  # (the experts')
        if self.reducing is None:
            return
        if stage is None:
            self.reducing.arm(last and weights)
            return
        if weights and (last or self.every_micro):  # (every micro-batch's pass counts there)
            self.reducing.gradients_done(stage)
        self.reducing.arm(False)

    def finish_backward(self) -> None:
        if self.reducing is not None:
            self.reducing.finish()

    def reduce_gradients(self) -> None:
        if self.reducing is None:
            for k in range(len(self.buckets)):
                self._reduce_bucket(k)
        elif self.stage == 2 and not self.every_micro:  # (the overlapped reduce-scatters wrote into the full buffer)
            for k, bucket in enumerate(self.buckets):
                lo, hi = bucket.owned(self.shard_rank)
                self.owned_grad(k).copy_(self.full_grads()[lo:hi])
        if self.stage == 2:
            for p in self.params:
                p.grad = None
            self.grad_buf = None
        self.reduce_expert_gradients()

    def bucket_gradients(self, k: int) -> torch.Tensor:
        bucket = self.buckets[k]
        return self.full_grads()[bucket.start : bucket.start + bucket.piece * self.shards]

    def full_grads(self) -> torch.Tensor:
        """The flat buffer every gradient of the step lands in (ZeRO-2 lets it go once reduced)."""
        assert self.grad_buf is not None, "ZeRO-2's full gradient buffer is gone until the next backward"
        return self.grad_buf

    def _reduce_bucket(self, k: int) -> None:
        whole, out = self.bucket_gradients(k), self.owned_grad(k)
        if whole.dtype == self.reduce_dtype:
            self._reduce(whole, out)  # in place for ZeRO-1
            return
        # bf16 gradients summed in float32: cast and reduced in pieces (a float32 copy of the whole
        # buffer would be twice the gradients' own bytes at the step's peak)
        piece_len = self.buckets[k].piece
        flat = whole.view(self.shards, piece_len)  # row r: shard r's piece
        piece = max(1, REDUCE_CHUNK_ELEMENTS // self.shards)
        for a in range(0, piece_len, piece):
            b = min(piece_len, a + piece)
            send = flat[:, a:b].to(self.reduce_dtype)  # [shards, b - a], each shard's piece in a row
            reduced = send[0] if self.shard_group is None else send.new_empty(b - a)
            self._reduce(send.view(-1), reduced)
            out[a:b].copy_(reduced)

    def _reduce(self, send: torch.Tensor, out: torch.Tensor) -> None:
        """Sum `send` (shards' pieces one after another) over the shard group into this rank's `out`,
        then over the HSDP replicas (or, unsharded, over dp: then `out` is `send`)."""
        if self.shard_group is not None:
            comm.reduce_scatter_single(out, send, self.shard_group, role="dp")
        if self.replicate_group is not None:
            comm.all_reduce(out, self.replicate_group, role="dp")

    def named_grads(self, model_grads: bool = False):
        if model_grads and self.every_micro:  # the reduced shard already: tp's partial sums act
            yield from self.named_grads()  # element by element, alike on every tp rank's same slice
        elif model_grads:
            yield from super().named_grads()
        else:
            for seg, name in zip(self.segments, self.segment_names):
                yield name, seg[0].grad

    def optimized(self):
        for name, seg in zip(self.segment_names, (seg for seg, _ in self.segments)):
            yield name, self.master_of.get(seg, seg)
        for name, p in self.expert_parameters():
            yield name, self.master_of.get(p, p)

    def norm_groups(self) -> list:
        return [self.shard_group] if self.shard_group is not None else []  # the slices are disjoint

    def step(self) -> None:
        self.step_masters()  # (its masters_to_model gathers the updated slices)

    def masters_to_model(self) -> None:
        super().masters_to_model()  # this rank's slice of the flat buffer, from its masters
        self.gather_parameters()

    def gather_parameters(self) -> None:
        """Every bucket from its owners, in place (this rank's piece is already where it belongs); with
        overlap_param_gather only started: a module waits for its buckets when forward reaches it."""
        if self.shard_group is None:
            return
        with torch.no_grad():
            for k, bucket in enumerate(self.buckets):
                lo, hi = bucket.owned(self.shard_rank)
                whole = self.param_buf[bucket.start : bucket.start + bucket.piece * self.shards]
                work = comm.all_gather_single(
                    whole, self.param_buf[lo:hi], self.shard_group, async_op=self.overlap_gather, role="dp"
                )
                if self.overlap_gather:
                    self.gathering[k] = work

    def wait_parameters(self, buckets=None) -> None:
        for k in list(self.gathering) if buckets is None else buckets:
            work = self.gathering.pop(k, None)
            if work is not None:
                work.wait()

    def _wait_in_forward(self) -> None:
        """Forward pre-hooks waiting for the all-gathers (started after the previous step) of the
        buckets a module computes with: each transformer block waits for all of its parameters' at
        its start — code inside a block reads its submodules' weights (tp_overlap's fused region
        GEMMs, FP8 linears), and the wait stays outside a compiled block's graph —, each module
        outside the blocks (embedding, final norm, head) for those it holds itself."""
        index = {id(p): i for i, p in enumerate(self.params)}

        def wait_for(module: nn.Module, params) -> None:
            mine = sorted({self.bucket_of_param[index[id(p)]] for p in params if id(p) in index})
            if mine:
                module.register_forward_pre_hook(lambda _m, _args: self.wait_parameters(mine), prepend=True)

        for chunk in self.chunks:
            blocks = list(chunk.layers.values())
            for block in blocks:
                wait_for(block, block.parameters())
            in_blocks = {id(p) for block in blocks for p in block.parameters()}
            for module in chunk.modules():
                wait_for(module, [p for p in module.parameters(recurse=False) if id(p) not in in_blocks])

    def zero_grad(self) -> None:
        for _, p in self.expert_parameters():
            p.grad = None
        if self.stage <= 1:
            self.full_grads().zero_()
        # ZeRO-2's reduce-scatter overwrites shard_grad; its full buffer is already gone.

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        seg_params = [s for s, _ in self.segments]
        experts = [p for _, p in self.expert_parameters()]
        return {
            "params": self.params + seg_params + experts,
            "grads": [p.grad for p in self.params + experts + seg_params if p.grad is not None],
            "optimizer": self.optimizer_state(),
        }

    def flat_buffers(self) -> list[torch.Tensor]:
        extra = [self.shard_grad] if self.shard_grad is not None else []  # (ZeRO-1's is a slice of grad_buf)
        return [self.param_buf] + ([self.grad_buf] if self.grad_buf is not None else []) + extra


class BucketReductions:
    """ZeRO-1/2's overlapped gradient reduction (`parallel.overlap_grad_reduce`): while armed (the
    last micro-batch's backward), each gradient autograd accumulates counts toward its bucket, and
    complete buckets start their reduce-scatter (an all-reduce over dp when unsharded, under a
    pipeline) strictly from the last bucket to the first, so every rank issues the same collectives
    in the same order. Each writes this rank's reduced piece into the full gradient buffer, where
    the tensor-parallel partial sums find it; `finish` starts what is left and waits. Gradients
    summed in a wider dtype than they are held in (bf16 summed in float32) go in the plain path's
    cast pieces (REDUCE_CHUNK_ELEMENTS), CAST_PIECES_IN_FLIGHT at most: a further piece first
    completes the oldest."""

    def __init__(self, dp: ShardedOptimizerDataParallel):
        self.dp, self.armed = dp, False
        self.index = {id(p): i for i, p in enumerate(dp.params)}
        self.sizes = [b.last - b.first for b in dp.buckets]
        self.ready = [0] * len(dp.buckets)
        self.next = len(dp.buckets) - 1
        self.pending: list[tuple] = []  # (work, reduced, where it goes), oldest first
        self.counted: set[int] = set()
        self.casting = dp.params[0].dtype != dp.reduce_dtype
        for p in dp.params:
            p.register_post_accumulate_grad_hook(self._on_gradient)

    def arm(self, on: bool) -> None:
        self.armed = on  # (the counts start from zero: `finish` left them so)

    def _on_gradient(self, param) -> None:
        if self.armed:
            self._count(param)
            self._launch(every=False)

    def gradients_done(self, stage: nn.Module) -> None:
        """Every gradient of `stage` is final for this step (its last backward ran)."""
        for p in stage.parameters():
            self._count(p)
        self._launch(every=False)

    def _count(self, param) -> None:
        i = self.index.get(id(param))
        if i is not None and i not in self.counted:  # (once: autograd's hook and a stage's end may both say so)
            self.counted.add(i)
            self.ready[self.dp.bucket_of_param[i]] += 1

    def _launch(self, *, every: bool) -> None:
        while self.next >= 0 and (every or self.ready[self.next] >= self.sizes[self.next]):
            self._start(self.next)
            self.next -= 1

    def _start(self, k: int) -> None:
        dp = self.dp
        whole, bucket = dp.bucket_gradients(k), dp.buckets[k]
        lo, hi = bucket.owned(dp.shard_rank)
        target = whole if dp.shard_group is None else dp.full_grads()[lo:hi]
        if not self.casting:  # in place: the reduced piece lands where the optimizer reads it
            work = (
                comm.all_reduce(whole, dp.replicate_group, async_op=True, role="dp")
                if dp.shard_group is None
                else comm.reduce_scatter_single(target, whole, dp.shard_group, async_op=True, role="dp")
            )
            self.pending.append((work, target, target))
            return
        rows = whole.view(dp.shards, bucket.piece)  # row r: shard r's piece
        step = max(1, REDUCE_CHUNK_ELEMENTS // dp.shards)
        for a in range(0, bucket.piece, step):
            b = min(bucket.piece, a + step)
            if len(self.pending) >= CAST_PIECES_IN_FLIGHT:
                self._complete()
            send = rows[:, a:b].to(dp.reduce_dtype)  # [shards, b - a], each shard's piece in a row
            if dp.shard_group is None:
                work, reduced = comm.all_reduce(send, dp.replicate_group, async_op=True, role="dp"), send.view(-1)
            else:
                reduced = send.new_empty(b - a)
                work = comm.reduce_scatter_single(reduced, send.view(-1), dp.shard_group, async_op=True, role="dp")
            self.pending.append((work, reduced, target[a:b]))

    def _complete(self) -> None:
        """Wait for the oldest reduction in flight, sum it over the HSDP replicas (in the reduction's
        dtype, as the plain path does), and put it where the optimizer reads it."""
        dp = self.dp
        work, reduced, target = self.pending.pop(0)
        work.wait()
        if dp.shard_group is not None and dp.replicate_group is not None:
            comm.all_reduce(reduced, dp.replicate_group, role="dp")
        if reduced.data_ptr() != target.data_ptr() or reduced.dtype != target.dtype:
            target.copy_(reduced)

    def finish(self) -> None:
        """Start the buckets still waiting (a parameter without a gradient leaves its bucket open),
        then complete every reduction in flight."""
        self._launch(every=True)
        while self.pending:
            self._complete()
        self.next, self.armed = len(self.ready) - 1, False
        self.ready, self.counted = [0] * len(self.ready), set()
