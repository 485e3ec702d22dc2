"""All of a rank's SwiGLU experts in one call: `grouped_swiglu(x, w1, w3, w2, counts)`.

x holds the routing slots sorted by expert, `counts` (a tensor, so it can stay on the device) how
many slots each expert has. The computation is a torch custom op (`fived::grouped_swiglu`), so that
autograd, selective checkpointing and torch.compile each see one op:

- CUDA, 16-bit, aligned shapes: torch's grouped GEMM (`torch._grouped_mm`, the kernel torchtitan
  uses) with the group offsets on the device: no host synchronisation.
- elsewhere (CPU; float32/float64 on CUDA): the slots are scattered into a zero-padded
  [experts, most slots, dim] batch and multiplied with `torch.bmm`, three batched GEMMs instead of
  three per expert (padding rows are zero and never read back).

It saves for backward the input, gate and up ([slots, hidden]); silu(gate) and the product are
recomputed there (element-wise, cheap). `expert_loop` is the former loop of per-expert GEMMs, kept
as the reference the benchmark and the tests compare against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def expert_loop(x: torch.Tensor, w1, w3, w2, counts: list[int]) -> torch.Tensor:
    """Reference: one SwiGLU per expert over its slice of slots (3 GEMMs per expert and pass)."""
    outs = [(F.silu(c @ w1[e]) * (c @ w3[e])) @ w2[e] for e, c in enumerate(torch.split(x, counts))]
    return torch.cat(outs) if outs else x


def _uses_grouped_mm(x: torch.Tensor, w1: torch.Tensor) -> bool:
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and w1.shape[1] % 16 == 0 and w1.shape[2] % 16 == 0)


class _Groups:
    """Where each slot sits in the padded [experts, capacity, ...] batch."""

    def __init__(self, counts: torch.Tensor, slots: int):
        n = counts.shape[0]
        self.n, self.slots = n, slots
        counts = counts.to(torch.int64)
        self.offsets = torch.cumsum(counts, 0)
        self.expert = torch.repeat_interleave(torch.arange(n, device=counts.device), counts, output_size=slots)
        self.row = torch.arange(slots, device=counts.device) - (self.offsets - counts)[self.expert]
        self.capacity = int(counts.max()) if n else 0  # (a host read: this path is not the CUDA one)

    def pad(self, t: torch.Tensor) -> torch.Tensor:
        out = t.new_zeros((self.n, self.capacity, t.shape[-1]))
        out[self.expert, self.row] = t
        return out

    def unpad(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.expert, self.row]


def _mm(a, w, groups, x_like):
    """Per-expert a_e @ w[e] for slot rows a [slots, k], w [E, k, n]."""
    if _uses_grouped_mm(x_like, w):
        return torch._grouped_mm(a, w, offs=groups.offsets.to(torch.int32))
    return groups.unpad(torch.bmm(groups.pad(a), w))


def _weight_grad(a, g, groups, x_like):
    """Per-expert a_e^T @ g_e: [E, k, n] for slot rows a [slots, k], g [slots, n]."""
    if _uses_grouped_mm(x_like, a.new_empty(0, 16, 16)):
        return torch._grouped_mm(a.t(), g, offs=groups.offsets.to(torch.int32))
    return torch.bmm(groups.pad(a).transpose(1, 2), groups.pad(g))


@torch.library.custom_op("fived::grouped_swiglu", mutates_args=())
def _grouped_swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                    counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups = _Groups(counts, x.shape[0])
    gate, up = _mm(x, w1, groups, x), _mm(x, w3, groups, x)
    return _mm(F.silu(gate) * up, w2, groups, x), gate, up


@_grouped_swiglu.register_fake
def _(x, w1, w3, w2, counts):
    rows = x.shape[0]
    return x.new_empty((rows, w2.shape[2])), x.new_empty((rows, w1.shape[2])), x.new_empty((rows, w1.shape[2]))


def _setup_context(ctx, inputs, output):
    x, w1, w3, w2, counts = inputs
    _, gate, up = output
    ctx.save_for_backward(x, w1, w3, w2, counts, gate, up)


@torch.library.custom_op("fived::grouped_swiglu_backward", mutates_args=())
def _grouped_swiglu_backward(grad_out: torch.Tensor, d_gate_in: torch.Tensor, d_up_in: torch.Tensor,
                             x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                             counts: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw1, dw3, dw2); an op of its own so that compiled graphs keep it whole too."""
    groups = _Groups(counts, x.shape[0])
    act = F.silu(gate)
    d_hidden = _mm(grad_out, w2.transpose(1, 2), groups, x)  # d(silu(gate) * up)
    sig = torch.sigmoid(gate)
    d_gate = d_hidden * up * sig * (1 + gate * (1 - sig)) + d_gate_in
    d_up = d_hidden * act + d_up_in
    dx = _mm(d_gate, w1.transpose(1, 2), groups, x) + _mm(d_up, w3.transpose(1, 2), groups, x)
    dw1, dw3 = _weight_grad(x, d_gate, groups, x), _weight_grad(x, d_up, groups, x)
    return dx, dw1, dw3, _weight_grad(act * up, grad_out, groups, x)


@_grouped_swiglu_backward.register_fake
def _(grad_out, d_gate_in, d_up_in, x, w1, w3, w2, counts, gate, up):
    return torch.empty_like(x), torch.empty_like(w1), torch.empty_like(w3), torch.empty_like(w2)


def _backward(ctx, grad_out, grad_gate, grad_up):
    x, w1, w3, w2, counts, gate, up = ctx.saved_tensors
    grad_gate = torch.zeros_like(gate) if grad_gate is None else grad_gate  # gate/up outputs are
    grad_up = torch.zeros_like(up) if grad_up is None else grad_up  # only saved; their grads are 0
    return (*_grouped_swiglu_backward(grad_out, grad_gate, grad_up, x, w1, w3, w2, counts, gate, up), None)


_grouped_swiglu.register_autograd(_backward, setup_context=_setup_context)


def grouped_swiglu(x: torch.Tensor, w1, w3, w2, counts: torch.Tensor) -> torch.Tensor:
    """Every expert's SwiGLU over its slots; under autocast in autocast's dtype, as a matmul would be."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        dtype = torch.get_autocast_dtype(kind)
        x, w1, w3, w2 = (t.to(dtype) for t in (x, w1, w3, w2))
    return _grouped_swiglu(x, w1, w3, w2, counts)[0]


GROUPED_SWIGLU_OP = torch.ops.fived.grouped_swiglu.default  # (selective checkpointing caches its outputs)
