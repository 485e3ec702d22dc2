"""Routed experts' gradients summed over edp while backward runs (`parallel.overlap_grad_reduce`,
ZeRO-0/1/2 with ep > 1 and edp > 1): Megatron-Core's expert-data-parallel buckets, one per MoE layer.

Outside ZeRO-3 the experts stay out of the dense flat buffers (their gradients are summed over edp,
not dp*cp; `fived.parallel.data_parallel`). Without the switch they are reduced in one blocking call
after backward. With it, while the last micro-batch's backward is armed (under a pipeline: a stage's
last backward, whose end also marks its gradients done — the weight-only passes of split-backward
schedules accumulate without autograd's hooks), each MoE layer whose expert gradients are all final
starts its asynchronous all-reduces, strictly from the last layer to the first so that every edp rank
issues the same collectives in the same order; `finish` (in `reduce_gradients`, before clipping or the
optimizer read them) starts the layers left and waits.

Dtype rule as the blocking path's (`_all_reduce_flat`): gradients held in the reduce dtype are summed
in place (nothing is copied: each expert gradient is a tensor of its own); others (bf16 summed in
float32) in cast pieces of at most REDUCE_CHUNK_ELEMENTS, CAST_PIECES_IN_FLIGHT at most at once (a
further piece first completes the oldest), copied back once reduced.
"""

from __future__ import annotations

import torch
from torch import nn

from fived.layout.spec import CAST_PIECES_IN_FLIGHT, REDUCE_CHUNK_ELEMENTS
from fived.parallel import comm


class ExpertGradReductions:
    """`named`: (canonical name, parameter) of this rank's routed experts, in model order."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], group, reduce_dtype: torch.dtype):
        layers: dict[str, list[nn.Parameter]] = {}
        for name, p in named:  # (a layer's experts: the parameters of one experts module)
            layers.setdefault(name.rsplit(".", 1)[0], []).append(p)
        # last layer first: the order backward finishes them (a later stage's before an earlier one's)
        self.layers = list(layers.values())[::-1]
        self.layer_of = {id(p): k for k, params in enumerate(self.layers) for p in params}
        self.group, self.reduce_dtype = group, reduce_dtype
        self.armed, self.next = False, 0
        self.ready = [0] * len(self.layers)
        self.counted: set[int] = set()
        self.pending: list[tuple] = []  # (work, reduced tensor, gradient it goes to), oldest first
        for params in self.layers:
            for p in params:
                p.register_post_accumulate_grad_hook(self._on_gradient)

    def arm(self, on: bool) -> None:
        self.armed = on  # (the counts start from zero: `finish` left them so)

    def backward_of_stage(self, *, last: bool, weights: bool, stage: nn.Module | None) -> None:
        """A pipeline stage's backward starts (`stage` None) or ended: after its last micro-batch's
        pass that produced weight gradients, every expert gradient of the stage is final."""
        if stage is None:
            self.arm(last and weights)
            return
        if last and weights:
            for p in stage.parameters():
                self._count(p)
            self._launch(every=False)
        self.arm(False)

    def _on_gradient(self, param: nn.Parameter) -> None:
        if self.armed:
            self._count(param)
            self._launch(every=False)

    def _count(self, param: nn.Parameter) -> None:
        k = self.layer_of.get(id(param))
        if k is not None and id(param) not in self.counted:  # (once: the hook and a stage's end may both say so)
            self.counted.add(id(param))
            self.ready[k] += 1

    def _launch(self, *, every: bool) -> None:
        while self.next < len(self.layers) and (every or self.ready[self.next] == len(self.layers[self.next])):
            self._start(self.layers[self.next])
            self.next += 1

    def _start(self, params: list[nn.Parameter]) -> None:
        for p in params:
            grad = p.grad
            if grad is None:  # (as the blocking path: a parameter without a gradient is left out)
                continue
            if grad.dtype == self.reduce_dtype:  # in place, where clipping and the optimizer read it
                self.pending.append((comm.all_reduce(grad, self.group, async_op=True, role="dp"), grad, grad))
                continue
            flat = grad.view(-1)  # (a gradient is contiguous, like its parameter)
            for a in range(0, flat.numel(), REDUCE_CHUNK_ELEMENTS):
                if len(self.pending) >= CAST_PIECES_IN_FLIGHT:
                    self._complete()
                piece = flat[a : a + REDUCE_CHUNK_ELEMENTS]
                send = piece.to(self.reduce_dtype)
                self.pending.append((comm.all_reduce(send, self.group, async_op=True, role="dp"), send, piece))

    def _complete(self) -> None:
        work, reduced, target = self.pending.pop(0)
        work.wait()
        if reduced is not target:
            target.copy_(reduced)

    def finish(self) -> None:
        """Start the layers still waiting (a parameter without a gradient leaves its layer open), then
        wait for every reduction in flight; ready for the next step."""
        self.armed = False  # (backward is over: what starts now was left to the wait)
        self._launch(every=True)
        while self.pending:
            self._complete()
        self.next = 0
        self.ready, self.counted = [0] * len(self.layers), set()
