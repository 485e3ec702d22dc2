"""fived's communication layer: every collective fived issues itself goes through these functions.

They call `torch.distributed` and nothing else, unless a `CommRecorder` is installed (`recording`,
a scoped context: the trainer installs one around each step). A recorder keeps, per collective:
bytes and calls by (mesh dimension, collective) — the figures `fived train --report` holds against
the planner's formulas — and its timing, under the mesh dimension the caller works for (a group may
hold the ranks of several: with cp=1, dp_cp's are dp's): when it was issued, when the caller started
waiting for it and when that wait ended (an asynchronous collective runs under compute between the
first two; the wait is the exposed part), which `fived.training.step_timer` turns into the step breakdown.

Routed here: TP/SP regions and the vocab-parallel loss, the CP ring, EP all-to-all, ZeRO-0 buckets,
ZeRO-1/2 reduce-scatter/all-gather, gradient-norm and expert-gradient all-reduces, FSDP2's gathers
and reduce-scatters (through its `set_custom_all_gather`/`set_custom_reduce_scatter` hooks) and the
pipeline's point-to-point tensors (their bytes as the stages build the ops; their time is the
pipeline's, see `fived.training.step_timer`). Not routed: FSDP2's HSDP all-reduce across replicas (counted by
`count_fsdp_replica_all_reduce` while a step records), DCP's checkpoint collectives (on a group of
their own, never recorded) and the trainer's logging reductions (not the step's traffic).

Byte conventions (the planner's, `fived.planner.communication`): all-reduce / send / recv the tensor;
an all-gather its output; a reduce-scatter its input; an all-to-all its input.

The recorder is a scoped context and not an object handed to each module because these functions
run inside autograd functions, module hooks and FSDP2's own hooks, which have no handle on the
trainer; the context is installed only for the span of a step, and only groups of the mesh are named.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class CommEvent:
    """One collective (or one batch of point-to-point ops) as the caller saw it. Marks come from the
    recorder's clock (seconds on CPU; CUDA events on GPU, resolved after the step)."""

    dim: str  # the group's name (the bytes' key)
    op: str
    nbytes: int
    issued: object
    role: str  # the mesh dimension the caller works for (its time's); a group may carry several's ranks
    wait_start: object = None  # None: the call itself blocked (issued..wait_end is exposed)
    wait_end: object = None
    done: float | None = None  # wall time it completed (asynchronous ones, where the backend says)


class CommRecorder:
    """What the collectives of one scope did. `clock()` marks a time (default `time.perf_counter`);
    not `timed`: bytes, calls and the collective to blame only."""

    def __init__(self, group_names: dict, clock=time.perf_counter, *, timed: bool = True):
        self.group_names = dict(group_names)
        self.clock, self.timed = clock, timed
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.events: list[CommEvent] = []
        # (collective, group): what a timeout is blamed on
        self.failed: tuple[str, Any] | None = None
        self.last: tuple[str, Any] | None = None
        self.profiling = False  # label each collective for torch.profiler
        self._names: dict[int, str] = {}

    def dim(self, group) -> str:
        group = dist.group.WORLD if group is None else group
        name = self._names.get(id(group))
        if name is None:
            name = _name_by_ranks(self.group_names, group)  # (dp and dp_cp with cp=1: "dp", as listed first)
            self._names[id(group)] = name
        return name

    def count(self, op: str, group, nbytes: int) -> str:
        dim = self.dim(group)
        self.bytes[(dim, op)] += nbytes
        self.calls[(dim, op)] += 1
        self.last = (op, group)
        return dim

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.events.clear()
        self.failed = self.last = None

    def summary(self) -> dict[str, dict[str, int]]:
        """{"dp/all_reduce": {"bytes": .., "calls": ..}, ...}"""
        return {
            f"{d}/{op}": {"bytes": self.bytes[(d, op)], "calls": self.calls[(d, op)]} for d, op in sorted(self.bytes)
        }

    def blamed_collective(self) -> tuple[str, str, tuple[int, ...]]:
        """(collective, mesh dimension, global ranks) of the collective that raised in this step, or
        else of the last one started (an asynchronous one fails later, in its wait)."""
        name, group = self.failed or self.last or ("a collective", None)
        return name, self.dim(group), _ranks(dist.group.WORLD if group is None else group)


# The innermost `recording` scope last. Shared by every thread: on CUDA the autograd engine's thread
# issues the gradient buckets' collectives. (DCP's checkpoint thread issues none of these.)
_active: list[CommRecorder] = []


@contextlib.contextmanager
def recording(recorder: CommRecorder):
    """Record fived's collectives into `recorder` inside the block."""
    _active.append(recorder)
    try:
        yield recorder
    finally:
        _active.remove(recorder)


def _recorder() -> CommRecorder | None:
    return _active[-1] if _active else None


class Pending:
    """An asynchronous collective: `wait()` before using its result (the wait is timed as exposed)."""

    def __init__(self, works: list, event: CommEvent | None, recorder: CommRecorder | None, group=None):
        self.works, self.event, self.recorder, self.group = works, event, recorder, group

    def wait(self) -> None:
        if self.event is None:
            for work in self.works:
                work.wait()
            return
        assert self.recorder is not None  # (an event is recorded by a recorder)
        self.event.wait_start = self.recorder.clock()
        try:
            for work in self.works:
                work.wait()
        except BaseException:
            self.recorder.failed = (self.event.op, self.group)
            raise
        self.event.wait_end = self.recorder.clock()


@torch.compiler.disable  # bookkeeping on the host, never traced into a compiled block's graph
def _issue(op: str, group, nbytes: int, call, async_op: bool, role: str | None):
    """Run `call()` (one torch.distributed call), counted and timed when a recorder is installed."""
    recorder = _recorder()
    if recorder is None or not recorder.timed:
        if recorder is not None:
            recorder.count(op, group, nbytes)
        work = _blamed(recorder, op, group, call)
        return Pending([work], None, None) if async_op else None
    dim = recorder.count(op, group, nbytes)
    event = CommEvent(dim, op, nbytes, recorder.clock(), role or dim)
    with _label(recorder, event):
        work = _blamed(recorder, op, group, call)
    recorder.events.append(event)
    if not async_op:
        event.wait_end = recorder.clock()
        return None
    _note_completion(work, event)
    return Pending([work], event, recorder, group)


def _label(recorder: CommRecorder, event: CommEvent):
    """While profiling, the collective named by mesh dimension in torch.profiler's traces."""
    if not recorder.profiling:
        return contextlib.nullcontext()
    return torch.profiler.record_function(f"fived/comm/{event.role}/{event.op.replace('/', '-')}")


def _blamed(recorder: CommRecorder | None, op: str, group, call):
    """call(), naming the collective a failure (a timeout) happened in."""
    try:
        return call()
    except BaseException:
        if recorder is not None:
            recorder.failed = (op, group)
        raise


def _note_completion(work, event: CommEvent) -> None:
    """Wall time the backend completes `work` (gloo says so through its future; on CUDA the future
    completes when the work is enqueued, so the caller's wait is all that is known)."""
    if not isinstance(event.issued, float):  # (CUDA events: a CUDA run)
        return
    try:
        future = work.get_future()
    except (RuntimeError, AttributeError):
        return
    future.add_done_callback(lambda _: setattr(event, "done", time.perf_counter()))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(tensor: torch.Tensor, group, *, op=dist.ReduceOp.SUM, async_op: bool = False, role: str | None = None):
    return _issue(
        "all_reduce",
        group,
        _nbytes(tensor),
        lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op),
        async_op,
        role,
    )


def all_gather_single(
    output: torch.Tensor, input: torch.Tensor, group, *, async_op: bool = False, role: str | None = None
):
    return _issue(
        "all_gather_single",
        group,
        _nbytes(output),
        lambda: dist.all_gather_single(output, input, group=group, async_op=async_op),
        async_op,
        role,
    )


def reduce_scatter_single(
    output: torch.Tensor,
    input: torch.Tensor,
    group,
    *,
    op=dist.ReduceOp.SUM,
    async_op: bool = False,
    role: str | None = None,
):
    return _issue(
        "reduce_scatter_single",
        group,
        _nbytes(input),
        lambda: dist.reduce_scatter_single(output, input, op=op, group=group, async_op=async_op),
        async_op,
        role,
    )


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    group,
    *,
    output_splits=None,
    input_splits=None,
    async_op: bool = False,
    role: str | None = None,
):
    return _issue(
        "all_to_all_single",
        group,
        _nbytes(input),
        lambda: dist.all_to_all_single(output, input, output_splits, input_splits, group=group, async_op=async_op),
        async_op,
        role,
    )


def exchange(
    sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], group, *, role: str | None = None
) -> Pending:
    """Start point-to-point sends (tensor, global peer) and receives (buffer, global peer) on `group`
    as one batch; wait on the result before reading the buffers."""
    ops = [dist.P2POp(dist.isend, t, peer, group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, group) for t, peer in recvs]
    return _exchange(ops, group, role)


@torch.compiler.disable
def _exchange(ops: list, group, role: str | None) -> Pending:
    recorder = _recorder()
    note_point_to_point(ops)
    if recorder is None or not recorder.timed:
        return Pending(_blamed(recorder, "send/recv", group, lambda: dist.batch_isend_irecv(ops)), None, None)
    dim = recorder.dim(group)
    event = CommEvent(dim, "send/recv", sum(_nbytes(op.tensor) for op in ops), recorder.clock(), role or dim)
    with _label(recorder, event):
        works = _blamed(recorder, "send/recv", group, lambda: dist.batch_isend_irecv(ops))
    recorder.events.append(event)
    return Pending(works, event, recorder, group)


@torch.compiler.disable
def note_point_to_point(ops: list) -> None:
    """Count the bytes of point-to-point ops another library issues (the pipeline schedules)."""
    recorder = _recorder()
    if recorder is None:
        return
    for op in ops:
        recorder.count("send" if op.op is dist.isend else "recv", op.group, _nbytes(op.tensor))


class FsdpAllGather:
    """FSDP2's all-gather (`FSDPModule.set_custom_all_gather`) through this layer."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        # Bytes only where FSDP2 waits on the Work itself (it checks its type) or runs the collective
        # on a side stream of its own (CUDA: a time marked there would not be the caller's wait)
        if async_op or output_tensor.is_cuda:
            return _issue_unwaited(
                "all_gather_single",
                group,
                _nbytes(output_tensor),
                lambda: dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op),
            )
        return all_gather_single(output_tensor, input_tensor, group, role="dp")


class FsdpReduceScatter:
    """FSDP2's reduce-scatter (`FSDPModule.set_custom_reduce_scatter`) through this layer."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        if async_op or output_tensor.is_cuda:  # (bytes only, as FsdpAllGather)
            return _issue_unwaited(
                "reduce_scatter_single",
                group,
                _nbytes(input_tensor),
                lambda: dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op),
            )
        return reduce_scatter_single(output_tensor, input_tensor, group, op=op, role="dp")


def _issue_unwaited(op: str, group, nbytes: int, call):
    recorder = _recorder()
    if recorder is not None:
        recorder.count(op, group, nbytes)
    return _blamed(recorder, op, group, call)


@contextlib.contextmanager
def count_fsdp_replica_all_reduce(replicate_group):
    """FSDP2's HSDP all-reduce across replicas calls `torch.distributed.all_reduce` with no hook to
    route it: while the block runs, calls on `replicate_group` (that very group: DCP's thread uses a
    group of its own) are counted into the installed recorder. (fived itself issues no all-reduce on
    FSDP2's replicate group, which would be counted twice.) The torch.distributed functions are looked
    up when called, by fived as by FSDP2: the dry run's mirrored collectives and the fault tests'
    stalls replace them.)"""
    real = dist.all_reduce

    def counted(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        recorder = _recorder()
        if recorder is not None and group is replicate_group:
            recorder.count("all_reduce", group, _nbytes(tensor))
        return real(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = counted
    try:
        yield
    finally:
        dist.all_reduce = real


def _name_by_ranks(group_names: dict, group) -> str:
    ranks = _ranks(group)
    for g, name in group_names.items():
        if len(_ranks(g)) > 1 and _ranks(g) == ranks:
            return name
    return "ranks" + "-".join(map(str, ranks))


def _ranks(group) -> tuple[int, ...]:
    if group is None or not dist.is_initialized():
        return ()
    return tuple(dist.get_process_group_ranks(group))
