"""Expert parallelism with the token all-to-alls under the expert GEMMs (`parallel.ep_overlap`).

The routing slots are cut into chunks *per expert*: chunk k of an expert with c slots holds its slots
[c*k//n, c*(k+1)//n). Each chunk is therefore still sorted by expert, and both its send and its
receive counts follow from the one exchange of whole counts (each rank applies the same formula to
the counts it received), so no extra counts exchange is needed and the bytes are the plain path's.

Forward: every chunk's dispatch starts at once; chunk k's GEMMs run as soon as its dispatch has
landed, with the later chunks' dispatches and the earlier chunks' combines in flight; the combines
are waited for at the end. Each all-to-all is a pair of autograd functions, `StartAllToAll` and
`WaitAllToAll`, sharing an `InFlight`: backward runs the pair the other way round — the wait's
backward *starts* the reverse all-to-all, the start's backward waits for it, where its result is
needed. Autograd runs ready nodes latest-created first, so backward goes: start the reverse combines
(last chunk first), then per chunk from the last: wait its combine gradient, its GEMMs' backward,
start its reverse dispatch; the other chunks' exchanges run under those GEMMs (checked by
tests/test_expert_overlap.py through the recorder's marks).

Per token the math is the plain path's: the same rows meet the same weights; only the weight
gradients sum their rows in two GEMMs per expert instead of one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fived.layout.layout import EP_OVERLAP_CHUNKS  # (there: the planner counts the calls too)
from fived.parallel import comm


class InFlight:
    """One all-to-all of one chunk: its split sizes, and while it runs its pending collective (the
    forward's, then backward's reverse one with the buffer it fills)."""

    def __init__(self, group, out_splits: list[int], in_splits: list[int]):
        self.group, self.out_splits, self.in_splits = group, out_splits, in_splits
        self.pending: Any = None  # (the collective's Work while it runs)
        self.sent: torch.Tensor | None = None
        self.back_pending: Any = None
        self.back_result: torch.Tensor | None = None
        self.back_sent: torch.Tensor | None = None

    def start(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty((sum(self.out_splits),) + tuple(x.shape[1:]))
        self.sent = sent = x.contiguous()  # (kept alive until the exchange is waited for)
        self.pending = comm.all_to_all_single(
            out, sent, self.group, output_splits=self.out_splits, input_splits=self.in_splits, async_op=True, role="ep"
        )
        return out

    def wait(self) -> None:
        self.pending.wait()
        self.pending = self.sent = None

    def start_back(self, grad: torch.Tensor) -> None:
        self.back_result = result = grad.new_empty((sum(self.in_splits),) + tuple(grad.shape[1:]))
        self.back_sent = sent = grad.contiguous()
        self.back_pending = comm.all_to_all_single(
            result,
            sent,
            self.group,
            output_splits=self.in_splits,
            input_splits=self.out_splits,
            async_op=True,
            role="ep",
        )

    def wait_back(self) -> torch.Tensor:
        self.back_pending.wait()
        result = self.back_result
        assert result is not None  # (start_back came first)
        self.back_pending = self.back_result = self.back_sent = None
        return result


class StartAllToAll(torch.autograd.Function):
    """Starts the all-to-all; its output is filled only once `WaitAllToAll` has run. Backward waits
    for the reverse all-to-all that `WaitAllToAll`'s backward started."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, flight: InFlight):
        ctx.flight = flight
        return flight.start(x)

    @staticmethod
    def backward(ctx, _order_only: torch.Tensor):
        # (the incoming gradient is the one WaitAllToAll's backward sent off: it only orders the nodes)
        return ctx.flight.wait_back(), None


class WaitAllToAll(torch.autograd.Function):
    """Waits for the all-to-all `StartAllToAll` started. Backward starts the reverse one and returns
    at once, so the GEMMs of other chunks run while it travels."""

    @staticmethod
    def forward(ctx, received: torch.Tensor, flight: InFlight):
        ctx.flight = flight
        flight.wait()
        return received.view_as(received)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.flight.start_back(grad)
        return grad, None


def exchange_started(x: torch.Tensor, group, out_splits: list[int], in_splits: list[int]):
    """(buffer, flight): the all-to-all of x under way; `exchange_waited` before reading the buffer."""
    flight = InFlight(group, out_splits, in_splits)
    return StartAllToAll.apply(x, flight), flight


def exchange_waited(buffer: torch.Tensor, flight: InFlight) -> torch.Tensor:
    return WaitAllToAll.apply(buffer, flight)


def chunk_share(count, k: int, chunks: int):
    """Slots of chunk k among an expert's `count` (an int, or an integer tensor of counts
    elementwise): [c*k//n, c*(k+1)//n) of each expert's c slots."""
    return count * (k + 1) // chunks - count * k // chunks


def chunk_order(counts: torch.Tensor, chunks: int) -> torch.Tensor:
    """The rows of expert-sorted slots (`counts` per expert) ordered by chunk, expert-sorted within
    each. Row r of an expert with c slots is in chunk ((r+1)*n - 1) // c, the inverse of
    `chunk_share`'s boundaries."""
    counts = counts.to(torch.int64)
    expert = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts)
    rank_in_expert = torch.arange(expert.shape[0], device=counts.device) - (torch.cumsum(counts, 0) - counts)[expert]
    chunk = ((rank_in_expert + 1) * chunks - 1) // counts[expert]
    return torch.argsort(chunk, stable=True)


# (eager under train.compile: every chunk's row count changes with the routing, so a traced region
# would recompile per micro-batch until torch gives up; the GEMMs are one custom op either way)
@torch.compiler.disable
def overlapped_experts(
    x: torch.Tensor,
    send_counts: torch.Tensor,
    recv_counts: torch.Tensor,
    group,
    local_experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    chunks: int = EP_OVERLAP_CHUNKS,
) -> torch.Tensor:
    """The routed experts over x (slots sorted by global expert) in `chunks` pipelined chunks.
    send_counts[r, e]: this rank's slots for expert e of ep rank r; recv_counts[r, e]: rank r's
    slots for this rank's local expert e (both int64 tensors on x's device; read once on the host
    for the split sizes). `local_experts(tokens, counts)` runs the local experts over rows grouped by
    (source rank, local expert) with `counts` [ep, local] and returns them in that order."""
    send, recv = send_counts.tolist(), recv_counts.tolist()
    order = chunk_order(send_counts.flatten(), chunks)
    send_splits = [[sum(chunk_share(c, k, chunks) for c in row) for row in send] for k in range(chunks)]
    recv_splits = [[sum(chunk_share(c, k, chunks) for c in row) for row in recv] for k in range(chunks)]
    dispatches = [
        exchange_started(piece, group, recv_splits[k], send_splits[k])
        for k, piece in enumerate(x[order].split([sum(s) for s in send_splits]))
    ]
    combines = []
    for k, (buffer, flight) in enumerate(dispatches):
        out = local_experts(exchange_waited(buffer, flight), chunk_share(recv_counts, k, chunks))
        combines.append(exchange_started(out, group, send_splits[k], recv_splits[k]))
    by_chunk = torch.cat([exchange_waited(buffer, flight) for buffer, flight in combines])
    return torch.empty_like(by_chunk).index_copy(0, order, by_chunk)
