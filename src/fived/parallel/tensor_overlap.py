"""Tensor-parallel regions whose communication runs under their GEMMs (`parallel.tp_overlap`), as
Megatron-Core's --tp-comm-overlap does; `fived.parallel.tensor` installs them on attention and dense
MLP blocks. MoE feed-forward regions (router + experts) keep the plain region of tensor.py: their
GEMMs are grouped over experts and routed, so there is no sequence chunk to pipeline against.

A region is one autograd function at each end instead of hooks around plain linears:

  entry + column linears (q/k/v, or gate/up), `ColumnParallelEntry`: the input crosses the network once.
    forward, SP:    the sequence shards travel around the tp ring (point-to-point); the GEMMs of the
                    chunk at hand run while the next chunk is in flight ("collective matmul").
    forward, no SP: nothing to communicate.
    backward:       SP: the all-gather of the input (kept as its shard, so activation memory stays
                    1/tp) starts before, and runs under, the input-gradient GEMMs; the input gradient's
                    reduce-scatter (all-reduce without SP) then runs under the weight-gradient GEMMs.
  row linear + exit (o, or down), `RowParallelExit`:
    forward, SP:    ring reduce-scatter: at each step the partial sum for one destination chunk is
                    computed while the running sum of the previous chunk is in flight.
    forward, no SP: the GEMM in tp chunks of tokens; each chunk's all-reduce starts as soon as its
                    GEMM is done and runs under the next chunk's GEMM.
    backward, SP:   the output gradient's chunks travel around the ring (the all-gather of the
                    gradient), the input-gradient GEMM of each chunk under the next chunk's transfer;
                    the weight gradient is one GEMM over the gathered gradient.

The model's forward is unchanged: the region's pre-hook runs the entry and hands the module the
region's whole input (the gathered one with SP); the column linears' forwards return the outputs
the entry already computed, the row linear's forward is the exit. Bytes: the ring moves what the
all-gather / reduce-scatter moved ((tp-1)/tp of the whole tensor sent, as much received); the
ledger counts them as send/recv (`fived.planner.communication`).

Nothing is modified in place that a GEMM produced: selective checkpointing caches GEMM outputs and
replays them when the block is recomputed.

Split-backward pipeline schedules (zero-bubble, zbv, dualpipev) run a stage's backward twice: an
input pass, then a weight pass that calls the same autograd nodes again. `backward_pass(kind)`
(entered by `fived.parallel.pipeline` around each) tells the regions which gradients that pass wants,
so each GEMM and each collective still runs once: the input pass computes the input gradients (with
their reductions), the weight pass the weight gradients (the column entry re-gathers its input
there; the row exit keeps its gathered output gradient from the input pass for it).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fived.model.transformer import Attention, FeedForward
from fived.parallel import comm

# the column linears (one region input) and the row linear (the region's output) of each region kind
REGION_LINEARS = {Attention: (("wq", "wk", "wv"), "wo"), FeedForward: (("w1", "w3"), "w2")}


# which gradients the running backward wants: "full" (both), "input" or "weight" (split backward)
_PASS = contextvars.ContextVar("fived_backward_pass", default="full")


@contextlib.contextmanager
def backward_pass(kind: str):
    """Run a backward pass of `kind` ("full", "input" or "weight") under this context."""
    token = _PASS.set(kind)
    try:
        yield
    finally:
        _PASS.reset(token)


def current_backward_pass() -> str:
    """The running backward pass: "full", or under a split-backward schedule "input" / "weight"."""
    return _PASS.get()


def _wants() -> tuple[bool, bool]:
    """(input gradients, weight gradients) the running backward pass wants."""
    kind = _PASS.get()
    return kind != "weight", kind != "input"


# --- the rings ------------------------------------------------------------------------------------


def _ring(group) -> tuple[int, int, int, int]:
    """(rank in group, group size, global rank of the next rank, global rank of the previous)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    return rank, size, dist.get_global_rank(group, (rank + 1) % size), dist.get_global_rank(group, (rank - 1) % size)


def ring_all_gather(shard: torch.Tensor, group, on_chunk) -> list[torch.Tensor]:
    """Pass every rank's shard around the tp ring; `on_chunk(chunk, source rank)` runs on each (this
    rank's own first) while the next one is on its way. Returns the shards in rank order."""
    rank, size, nxt, prv = _ring(group)
    chunks: list = [None] * size
    current, source = shard.contiguous(), rank
    for step in range(size):
        chunks[source] = current
        if step == size - 1:
            on_chunk(current, source)
            break
        incoming = torch.empty_like(current)
        pending = comm.exchange([(current, nxt)], [(incoming, prv)], group, role="tp")
        on_chunk(current, source)
        pending.wait()
        current, source = incoming, (source - 1) % size
    return chunks


def ring_reduce_scatter(partial_for, group) -> torch.Tensor:
    """The sum over the tp ranks of their partials for this rank's chunk. Step k computes
    `partial_for(chunk)` for chunk rank+k+1 while the running sum of step k-1 travels to the previous
    rank; the rank after this one sends the running sum of the same chunk. After tp steps this rank's
    chunk is home, summed."""
    rank, size, nxt, prv = _ring(group)
    pending = received = in_flight = None
    for step in range(size):
        part = partial_for((rank + step + 1) % size)
        if pending is not None:
            pending.wait()
            part = received + part  # a new tensor: `part` may be a cached GEMM output
        if step < size - 1:
            in_flight, received = part, torch.empty_like(part)  # (kept referenced until its send is done)
            pending = comm.exchange([(in_flight, prv)], [(received, nxt)], group, role="tp")
    return part


def _seq_major(x: torch.Tensor) -> torch.Tensor:
    """[b, s, ...] -> [s, b, ...] contiguous: the sequence dim first, as the collectives split dim 0."""
    return x.transpose(0, 1).contiguous()


def _start_gather(shard: torch.Tensor, group):
    """Asynchronous all-gather of sequence shards; returns (pending, [s, b, ...] sequence-major output)."""
    size = dist.get_world_size(group)
    flat = _seq_major(shard)
    out = flat.new_empty((size * flat.shape[0],) + tuple(flat.shape[1:]))
    return comm.all_gather_single(out, flat, group, async_op=True, role="tp"), out


class _Autocast:
    """The autocast state of a forward, re-entered for its backward (the GEMMs' dtypes must match)."""

    def __init__(self, x: torch.Tensor):
        self.device = x.device.type
        self.enabled = torch.is_autocast_enabled(self.device)
        self.dtype = torch.get_autocast_dtype(self.device) if self.enabled else None

    def __call__(self):
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device, dtype=self.dtype)


def _weight_grad(grad: torch.Tensor, inp: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """d(x W^T)/dW = grad^T x over every token."""
    return (grad.reshape(-1, grad.shape[-1]).t() @ inp.reshape(-1, inp.shape[-1])).to(weight.dtype)


# --- the two ends of a region ---------------------------------------------------------------------


class ColumnParallelEntry(torch.autograd.Function):
    """(region input, x W_1^T, ..., x W_n^T) from this rank's input (its sequence shard with SP)."""

    @staticmethod
    def forward(ctx, x, group, sequence_parallel: bool, *weights):
        ctx.group, ctx.sp, ctx.autocast = group, sequence_parallel, _Autocast(x)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, *weights)  # with SP, the shard: backward gathers it again
        if not sequence_parallel:
            return (x.view_as(x),) + tuple(F.linear(x, w) for w in weights)
        size = dist.get_world_size(group)
        pieces: list[list] = [[None] * size for _ in weights]

        def gemms(chunk, source):
            for i, w in enumerate(weights):
                pieces[i][source] = F.linear(chunk, w)

        chunks = ring_all_gather(x, group, gemms)
        return (torch.cat(chunks, dim=1),) + tuple(torch.cat(p, dim=1) for p in pieces)

    @staticmethod
    def backward(ctx, grad_input, *grads):
        x, *weights = ctx.saved_tensors
        want_input, want_weights = _wants()
        dx, dws = None, [None] * len(weights)
        with ctx.autocast():
            gathering, gathered = _start_gather(x, ctx.group) if ctx.sp and want_weights else (None, None)
            reducing = None
            if want_input:
                dx = grad_input
                for g, w in zip(grads, weights):  # (in the input's dtype: reduced as the plain region does)
                    if g is not None:
                        part = (g @ w).to(x.dtype)
                        dx = part if dx is None else dx + part
                reducing, dx = _start_input_grad_reduction(dx, ctx.group, sequence_parallel=ctx.sp)
            if want_weights:
                if gathering is not None:
                    gathering.wait()
                whole = gathered.transpose(0, 1) if ctx.sp else x
                dws = [None if g is None else _weight_grad(g, whole, w) for g, w in zip(grads, weights)]
            if reducing is not None:
                reducing.wait()
        if dx is not None and ctx.sp:
            dx = dx.transpose(0, 1).contiguous()
        return (dx, None, None, *dws)


def _start_input_grad_reduction(dx, group, *, sequence_parallel: bool):
    """(pending, result buffer): the reduce-scatter (SP, sequence-major) or all-reduce of the input gradient."""
    if dx is None:
        return None, None
    if not sequence_parallel:
        dx = dx.contiguous()
        return comm.all_reduce(dx, group, async_op=True, role="tp"), dx
    flat = _seq_major(dx)
    out = flat.new_empty((flat.shape[0] // dist.get_world_size(group),) + tuple(flat.shape[1:]))
    return comm.reduce_scatter_single(out, flat, group, async_op=True, role="tp"), out


class RowParallelExit(torch.autograd.Function):
    """h W^T summed over tp: this rank's sequence chunk of it with SP, all of it without."""

    @staticmethod
    def forward(ctx, h, weight, group, sequence_parallel: bool):
        ctx.group, ctx.sp, ctx.autocast = group, sequence_parallel, _Autocast(h)
        ctx.save_for_backward(h, weight)
        size = dist.get_world_size(group)
        if sequence_parallel:
            chunk = h.shape[1] // size
            return ring_reduce_scatter(lambda j: F.linear(h[:, j * chunk : (j + 1) * chunk], weight), group)
        return _chunked_all_reduce(h, weight, group, chunks=size)

    @staticmethod
    def backward(ctx, grad):
        h, weight = ctx.saved_tensors
        want_input, want_weights = _wants()
        dh = dw = None
        with ctx.autocast():
            whole = getattr(ctx, "gathered_grad", None)  # (kept by a split backward's input pass)
            if want_input:
                if not ctx.sp:
                    dh, whole = grad @ weight, grad
                else:
                    pieces: list = [None] * dist.get_world_size(ctx.group)
                    chunks = ring_all_gather(grad, ctx.group, lambda g, j: pieces.__setitem__(j, g @ weight))
                    dh, whole = torch.cat(pieces, dim=1), torch.cat(chunks, dim=1)
                dh = dh.to(h.dtype)
                if not want_weights:
                    ctx.gathered_grad = whole
            if want_weights:
                if whole is None:
                    raise RuntimeError("tp_overlap: a weight-gradient pass ran before its input pass")
                dw = _weight_grad(whole, h, weight)
                ctx.gathered_grad = None
        return dh, dw, None, None


def _chunked_all_reduce(h: torch.Tensor, weight: torch.Tensor, group, *, chunks: int) -> torch.Tensor:
    """h W^T with its all-reduce started chunk by chunk of tokens, each under the next chunk's GEMM."""
    rows = h.reshape(-1, h.shape[-1])
    n = rows.shape[0]
    bounds = sorted({n * i // chunks for i in range(chunks + 1)})
    out: torch.Tensor | None = None
    started = []
    for lo, hi in itertools.pairwise(bounds):
        y = F.linear(rows[lo:hi], weight)
        if out is None:
            out = y.new_empty((n, y.shape[-1]))
        out[lo:hi].copy_(y)  # (a copy: `y` may be a cached GEMM output)
        started.append(comm.all_reduce(out[lo:hi], group, async_op=True, role="tp"))
    for pending in started:
        pending.wait()
    assert out is not None  # (at least one chunk of rows)
    return out.view(*h.shape[:-1], out.shape[-1])


# --- installing a region --------------------------------------------------------------------------


class OverlappedRegion:
    """One attention or dense MLP module made an overlapped region: a pre-hook runs the entry, the
    column linears return its outputs, the row linear is the exit, and a forward hook checks that
    the module's output is the exit's (a module that transformed it would bypass the reduction)."""

    def __init__(self, module: nn.Module, group, *, sequence_parallel: bool, columns: tuple[str, ...], row: str):
        self.group, self.sp = group, sequence_parallel
        self.columns = [getattr(module, name) for name in columns]
        self.row = getattr(module, row)
        for linear in self.columns + [self.row]:
            if not isinstance(linear, nn.Linear) or linear.bias is not None:
                raise TypeError(f"tp_overlap: {type(module).__name__} needs bias-free nn.Linear layers")
        self._outputs: dict[int, torch.Tensor] = {}  # id(column linear) -> its output in this forward
        # Weakly: the region's input and output must be freed when the module is done with them.
        self._entry: Any = None
        self._exit: Any = None
        for linear in self.columns:
            linear.forward = functools.partial(self._column_output, linear)
        self.row.forward = self._row_forward
        module.register_forward_pre_hook(self._enter)
        module.register_forward_hook(self._leave)

    def _enter(self, module, args):
        weights = [linear.weight for linear in self.columns]
        whole, *outputs = ColumnParallelEntry.apply(args[0], self.group, self.sp, *weights)
        self._outputs = {id(linear): y for linear, y in zip(self.columns, outputs)}
        self._entry = weakref.ref(whole)
        return (whole,) + tuple(args[1:])

    def _column_output(self, linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if self._entry is None or x is not self._entry() or id(linear) not in self._outputs:
            raise RuntimeError(
                "tp_overlap: a column-parallel linear was called on something other than its region's input, or twice"
            )
        return self._outputs.pop(id(linear))

    def _row_forward(self, h: torch.Tensor) -> torch.Tensor:
        out = RowParallelExit.apply(h, self.row.weight, self.group, self.sp)
        self._exit = weakref.ref(out)
        return out

    def _leave(self, module, args, out):
        if self._exit is None or out is not self._exit():
            raise RuntimeError(f"tp_overlap: {type(module).__name__}'s output must be its row-parallel linear's")
        self._outputs, self._entry, self._exit = {}, None, None


def install_overlapped_region(module: nn.Module, group, *, sequence_parallel: bool) -> bool:
    """Make `module` an overlapped region if it is an attention or dense MLP module; False for others
    (MoE feed-forwards), which keep the plain region."""
    linears = REGION_LINEARS.get(type(module))
    if linears is None:
        return False
    OverlappedRegion(module, group, sequence_parallel=sequence_parallel, columns=linears[0], row=linears[1])
    return True
