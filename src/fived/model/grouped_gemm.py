"""All of a rank's SwiGLU experts in one call: `grouped_swiglu(x, w1, w3, w2, counts)`.

x holds the routing slots sorted by expert, `counts` (a tensor, so it can stay on the device) how
many slots each expert has. The computation is a torch custom op (`fived::grouped_swiglu`), so that
autograd, selective checkpointing and torch.compile each see one op:

- CUDA, bf16, aligned shapes: torch's grouped GEMM (`torch._grouped_mm`, the kernel torchtitan
  uses) with the group offsets on the device: no host synchronisation.
- CUDA otherwise (float32/float64): the slots are scattered into a zero-padded
  [experts, most slots, dim] batch and multiplied with `torch.bmm`, three batched GEMMs instead of
  three per expert (padding rows are zero and never read back; one host read of the largest count).
- CPU: expert by expert inside the op, into slices of preallocated outputs. Measured here (torch
  2.13, one thread): CPU bmm takes ~2x the time of mm for the same FLOPs, and whole-tensor
  element-wise passes ~3x longer than per-expert ones that find their rows in cache, so the padded
  batch loses to the loop on CPU; this path matches the loop's speed (benchmarks/bench_compile.py)
  and saves half of its activations.

It saves for backward the input, gate and up ([slots, hidden]); silu(gate) and the product are
recomputed there (element-wise, cheap). `expert_loop` is the former loop of per-expert GEMMs, kept
as the reference the benchmark and the tests compare against.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from fived.compat import grouped_mm, has_grouped_mm


def expert_loop(x: torch.Tensor, w1, w3, w2, counts: list[int]) -> torch.Tensor:
    """Reference: one SwiGLU per expert over its slice of slots (3 GEMMs per expert and pass)."""
    outs = [(F.silu(c @ w1[e]) * (c @ w3[e])) @ w2[e] for e, c in enumerate(torch.split(x, counts))]
    return torch.cat(outs) if outs else x


def uses_grouped_mm(x: torch.Tensor, w1: torch.Tensor) -> bool:
    """torch's grouped GEMM: CUDA, bf16, and rows aligned to 16 bytes (as its kernels require)."""
    return (
        x.is_cuda and has_grouped_mm() and x.dtype == torch.bfloat16 and w1.shape[1] % 16 == 0 and w1.shape[2] % 16 == 0
    )


def _group_ends(counts: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm's offsets: where each expert's slots end (on the device: no host read)."""
    return torch.cumsum(counts.to(torch.int64), 0).to(torch.int32)


class _Groups:
    """Where each slot sits in the zero-padded [experts * capacity, ...] batch (one flat row index
    per slot, so padding and unpadding are one index_copy / index_select each)."""

    def __init__(self, counts: torch.Tensor, slots: int):
        n = counts.shape[0]
        counts = counts.to(torch.int64)
        self.n, starts = n, torch.cumsum(counts, 0) - counts
        self.capacity = int(counts.max()) if n else 0
        expert = torch.repeat_interleave(torch.arange(n, device=counts.device), counts, output_size=slots)
        self.flat = torch.arange(slots, device=counts.device) + (expert * self.capacity - starts[expert])

    def pad(self, t: torch.Tensor) -> torch.Tensor:
        out = t.new_zeros((self.n * self.capacity, t.shape[-1]))
        return out.index_copy_(0, self.flat, t).view(self.n, self.capacity, t.shape[-1])

    def unpad(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(self.n * self.capacity, t.shape[-1]).index_select(0, self.flat)


def _swiglu_grad(d_hidden, gate, up, d_gate_in, d_up_in):
    """Gradients of gate and up from that of silu(gate) * up (plus any direct ones)."""
    d_gate = torch.ops.aten.silu_backward(d_hidden * up, gate)  # the fused kernel autograd uses
    return d_gate.add_(d_gate_in), (d_hidden * F.silu(gate)).add_(d_up_in)


@torch.library.custom_op("fived::grouped_swiglu", mutates_args=())
def _grouped_swiglu(
    x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if x.device.type == "cpu":
        return _forward_slices(x, w1, w3, w2, counts.tolist())
    if uses_grouped_mm(x, w1):
        offs = _group_ends(counts)
        gate, up = grouped_mm(x, w1, offs=offs), grouped_mm(x, w3, offs=offs)
        return grouped_mm(F.silu(gate) * up, w2, offs=offs), gate, up
    groups = _Groups(counts, x.shape[0])
    xp = groups.pad(x)
    gate, up = torch.bmm(xp, w1), torch.bmm(xp, w3)
    out = torch.bmm(F.silu(gate) * up, w2)
    return groups.unpad(out), groups.unpad(gate), groups.unpad(up)


def _forward_slices(x, w1, w3, w2, counts: list[int]):
    """CPU: expert by expert into slices of the outputs, each expert's element-wise work right after
    its GEMMs while its rows are in cache (CPU bmm measured ~2x slower than mm on the same FLOPs in
    torch 2.13, and whole-tensor element-wise passes ~3x slower than per-expert ones, so no padding)."""
    gate, up = x.new_empty((x.shape[0], w1.shape[2])), x.new_empty((x.shape[0], w1.shape[2]))
    out = x.new_empty((x.shape[0], w2.shape[2]))
    for e, rows in enumerate(_slices(counts)):
        torch.mm(x[rows], w1[e], out=gate[rows])
        torch.mm(x[rows], w3[e], out=up[rows])
        torch.mm(F.silu(gate[rows]) * up[rows], w2[e], out=out[rows])
    return out, gate, up


def _slices(counts: list[int]) -> list[slice]:
    return [slice(end - n, end) for end, n in zip(itertools.accumulate(counts), counts)]


@_grouped_swiglu.register_fake
def _(x, w1, w3, w2, counts):
    rows = x.shape[0]
    return x.new_empty((rows, w2.shape[2])), x.new_empty((rows, w1.shape[2])), x.new_empty((rows, w1.shape[2]))


def _setup_context(ctx, inputs, output):
    x, w1, w3, w2, counts = inputs
    _, gate, up = output
    ctx.save_for_backward(x, w1, w3, w2, counts, gate, up)


@torch.library.custom_op("fived::grouped_swiglu_backward", mutates_args=())
def _grouped_swiglu_backward(
    grad_out: torch.Tensor,
    d_gate_in: torch.Tensor,
    d_up_in: torch.Tensor,
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    counts: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw1, dw3, dw2); an op of its own so that compiled graphs keep it whole too."""
    if x.device.type == "cpu":
        return _backward_slices(grad_out, d_gate_in, d_up_in, x, w1, w3, w2, counts.tolist(), gate, up)
    if uses_grouped_mm(x, w1):
        offs = _group_ends(counts)
        d_hidden = grouped_mm(grad_out, w2.transpose(1, 2), offs=offs)
        d_gate, d_up = _swiglu_grad(d_hidden, gate, up, d_gate_in, d_up_in)
        dx = grouped_mm(d_gate, w1.transpose(1, 2), offs=offs) + grouped_mm(d_up, w3.transpose(1, 2), offs=offs)
        dw1, dw3 = grouped_mm(x.t(), d_gate, offs=offs), grouped_mm(x.t(), d_up, offs=offs)
        return dx, dw1, dw3, grouped_mm((F.silu(gate) * up).t(), grad_out, offs=offs)
    groups = _Groups(counts, x.shape[0])
    # padded: every operand padded once; padding rows stay zero through the element-wise math.
    # (Transposed weights are made contiguous: CPU bmm is several times slower on the strided ones.)
    xp, gp, gate_p, up_p = (groups.pad(t) for t in (x, grad_out, gate, up))
    w1t, w3t, w2t = (w.transpose(1, 2).contiguous() for w in (w1, w3, w2))
    d_gate, d_up = _swiglu_grad(torch.bmm(gp, w2t), gate_p, up_p, groups.pad(d_gate_in), groups.pad(d_up_in))
    dx = groups.unpad(torch.bmm(d_gate, w1t) + torch.bmm(d_up, w3t))
    xt = xp.transpose(1, 2)
    return dx, torch.bmm(xt, d_gate), torch.bmm(xt, d_up), torch.bmm((F.silu(gate_p) * up_p).transpose(1, 2), gp)


def _backward_slices(grad_out, d_gate_in, d_up_in, x, w1, w3, w2, counts: list[int], gate, up):
    """CPU: expert by expert, as `_forward_slices`."""
    dx, dw1, dw3, dw2 = torch.empty_like(x), torch.empty_like(w1), torch.empty_like(w3), torch.empty_like(w2)
    for e, rows in enumerate(_slices(counts)):
        g, u, dout = gate[rows], up[rows], grad_out[rows]
        d_gate, d_up = _swiglu_grad(dout @ w2[e].t(), g, u, d_gate_in[rows], d_up_in[rows])
        torch.mm(d_gate, w1[e].t(), out=dx[rows])
        dx[rows].addmm_(d_up, w3[e].t())
        torch.mm(x[rows].t(), d_gate, out=dw1[e])
        torch.mm(x[rows].t(), d_up, out=dw3[e])
        torch.mm((F.silu(g) * u).t(), dout, out=dw2[e])
    return dx, dw1, dw3, dw2


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
