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
after the reduce-scatter and keeps only the slice's reduced gradients. "Stage 0" here (used under
pipeline schedules, where DDP's hooks would fire inside the schedule) is the same flat buffer
unsharded: one all-reduce over dp per step.

Bytes per parameter held per rank (b = parameter dtype size, S = dp_shard):
  ZeRO-1: params b + grads b + Adam 2b/S;   ZeRO-2: params b + grads b/S + Adam 2b/S.
In bf16 runs (train.dtype=bfloat16) the buffers are bf16 and the optimizer updates float32 masters
of this rank's slices (master 4 + Adam 8 bytes, over S): ZeRO-1 2 + 2 + 12/S, ZeRO-2 2 + 14/S.
"""
from __future__ import annotations

import itertools
import math

import torch
from torch import nn

from fived import comm
from fived.layout.spec import REDUCE_CHUNK_ELEMENTS
from fived.optim import build_optimizer
from fived.parallel.data_parallel import DataParallel


class ShardedOptimizerDataParallel(DataParallel):
    def shard(self, chunks: list[nn.Module]) -> None:
        """The flat layout, decided on the meta device: which parameters, their offsets, this rank's
        slice (so the placement table knows each parameter's flat range before anything exists)."""
        self.chunks = chunks
        self.stage = self.cfg.parallel.zero
        if self.stage == 0:  # unsharded (under pipeline schedules): one all-reduce over dp
            self.shards, rank = 1, 0
        else:
            self.shards = self.mesh.dp_shard * self.mesh.cp  # context-parallel ranks shard too
            rank = self.mesh.rank("dp_shard_cp")
        apart = {n for n, _ in self.expert_parameters()}
        named = [(n, p) for n, p in self.named_parameters() if p.requires_grad and n not in apart]
        self.names = [n for n, _ in named]
        self.numels = [p.numel() for _, p in named]
        self.offsets = [0, *itertools.accumulate(self.numels)][:-1]
        self.index = {n: i for i, n in enumerate(self.names)}
        self.shard_len = math.ceil(sum(self.numels) / self.shards)
        self.lo, self.hi = rank * self.shard_len, (rank + 1) * self.shard_len

    def storage(self, name: str) -> tuple[tuple[int, int] | None, tuple[int, int] | None, int]:
        if name not in self.index:  # experts kept apart: whole, replicated over edp
            return super().storage(name)
        i = self.index[name]
        a = min(max(self.lo - self.offsets[i], 0), self.numels[i])
        b = max(min(self.hi - self.offsets[i], self.numels[i]), a)
        # ZeRO-0 under a pipeline keeps the buffer whole on every dp rank; sharded stages
        # repeat a slice only across HSDP replica groups
        replica = self.mesh.rank("dp_cp") if self.stage == 0 else self.mesh.rank("dp_replicate")
        return None, (a, b), replica

    def wrap(self, chunks: list[nn.Module]) -> list[nn.Module]:
        if self.stage == 0:
            self.shard_group, self.replicate_group = None, self.mesh.group("dp_cp")
        else:
            self.shard_group = self.mesh.group("dp_shard_cp")
            self.replicate_group = self.mesh.group("dp_replicate") if self.mesh.dp_replicate > 1 else None
        by_name = dict(self.named_parameters())
        self.params = [by_name[n] for n in self.names]
        dtype, device = self.params[0].dtype, self.params[0].device
        self.param_buf = torch.zeros(self.shard_len * self.shards, dtype=dtype, device=device)
        with torch.no_grad():
            for p, offset in zip(self.params, self.offsets):
                n = p.numel()
                self.param_buf[offset:offset + n].copy_(p.reshape(-1))
                p.data = self.param_buf[offset:offset + n].view_as(p)

        self.grad_buf: torch.Tensor | None = None
        if self.stage <= 1:
            self._attach_grad_buffer()
            self.shard_grad = self.grad_buf[self.lo:self.hi]
        else:
            self.shard_grad = torch.zeros(self.shard_len, dtype=dtype, device=device)
        self.segments = self._slice_segments()
        return chunks

    def _attach_grad_buffer(self) -> None:
        """A flat zeroed gradient buffer; each parameter's .grad is a view, so autograd accumulates
        every micro-batch in place into the flat layout the reduce-scatter needs."""
        self.grad_buf = torch.zeros_like(self.param_buf)
        for p, offset in zip(self.params, self.offsets):
            p.grad = self.grad_buf[offset:offset + p.numel()].view_as(p)

    def _slice_segments(self) -> list[tuple[nn.Parameter, bool]]:
        """This rank's slice cut at parameter boundaries: (view parameter, decayed?)."""
        segments, self.segment_names = [], []
        for p, name, offset in zip(self.params, self.names, self.offsets):
            a, b = max(offset, self.lo), min(offset + p.numel(), self.hi)
            if a < b:
                seg = nn.Parameter(self.param_buf[a:b])  # shares the buffer's storage
                seg.grad = self.shard_grad[a - self.lo:b - self.lo]
                segments.append((seg, p.dim() >= 2))
                self.segment_names.append(name)
        return segments

    def build_optimizer(self) -> torch.optim.Optimizer:
        # A slice of a matrix is decayed like the matrix (the slices themselves are 1-D).
        decayed = {id(s) for s, decay in self.segments if decay}
        experts = [p for _, p in self.expert_parameters()]  # not ZeRO-sharded: reduced over edp
        decayed |= {id(p) for p in experts}
        tensors = [s for s, _ in self.segments] + experts
        optimized = self.with_masters(tensors)  # bf16 runs: float32 masters of the slices, decayed alike
        decayed |= {id(m) for t, m in zip(tensors, optimized) if id(t) in decayed}
        self.optimizer = build_optimizer(optimized, self.cfg.train, lambda p: id(p) in decayed)
        return self.optimizer

    def before_micro_batch(self, is_last: bool) -> None:
        if self.grad_buf is None:  # ZeRO-2: a full buffer only while the step's backward runs
            self._attach_grad_buffer()

    def reduce_gradients(self) -> None:
        if self.grad_buf.dtype == self.reduce_dtype:
            out = self.grad_buf[self.lo:self.hi] if self.stage <= 1 else self.shard_grad
            self._reduce(self.grad_buf, out)  # in place for ZeRO-1
        else:  # bf16 gradients summed in float32: cast and reduced in pieces (a float32 copy of the
            # whole buffer would be twice the gradients' own bytes at the step's peak)
            flat = self.grad_buf.view(self.shards, self.shard_len)  # row r: shard r's slice
            piece = max(1, REDUCE_CHUNK_ELEMENTS // self.shards)
            for a in range(0, self.shard_len, piece):
                b = min(self.shard_len, a + piece)
                send = flat[:, a:b].to(self.reduce_dtype)  # [shards, b - a], each shard's piece in a row
                out = send[0] if self.shard_group is None else send.new_empty(b - a)
                self._reduce(send.view(-1), out)
                self.shard_grad[a:b].copy_(out)
        if self.stage == 2:
            for p in self.params:
                p.grad = None
            self.grad_buf = None
        self.reduce_expert_gradients()

    def _reduce(self, send: torch.Tensor, out: torch.Tensor) -> None:
        """Sum `send` (shards' pieces one after another) over the shard group into this rank's `out`,
        then over the HSDP replicas (or, unsharded, over dp: then `out` is `send`)."""
        if self.shard_group is not None:
            comm.reduce_scatter_single(out, send, self.shard_group, role="dp")
        if self.replicate_group is not None:
            comm.all_reduce(out, self.replicate_group, role="dp")

    def named_grads(self, model_grads: bool = False):
        if model_grads:
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
        if self.shard_group is not None:
            with torch.no_grad():  # in place: this rank's slice is already where it belongs
                comm.all_gather_single(self.param_buf, self.param_buf[self.lo:self.hi], self.shard_group, role="dp")

    def zero_grad(self) -> None:
        for _, p in self.expert_parameters():
            p.grad = None
        if self.stage <= 1:
            self.grad_buf.zero_()
        # ZeRO-2's reduce-scatter overwrites shard_grad; its full buffer is already gone.

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        seg_params = [s for s, _ in self.segments]
        experts = [p for _, p in self.expert_parameters()]
        return {"params": self.params + seg_params + experts,
                "grads": [p.grad for p in self.params + experts if p.grad is not None] + [s.grad for s in seg_params],
                "optimizer": self.optimizer_state()}

    def flat_buffers(self) -> list[torch.Tensor]:
        extra = [self.shard_grad] if self.stage == 2 else []  # (ZeRO-1's is a slice of grad_buf)
        return [self.param_buf] + ([self.grad_buf] if self.grad_buf is not None else []) + extra
