"""Where one rank's step time goes, measured: spans of the work the trainer runs and the collectives
`fived.parallel.comm` records, turned into a breakdown whose components add up to the step.

Spans (`StepTimer.span`) nest: data, forward and backward per micro-batch (per pipeline stage and
micro-batch under a schedule), recompute (a checkpointed block's forward run again inside backward),
the pipeline schedule itself, the optimizer (gradient finishing, clipping, AdamW) and the logging
reductions. A collective's exposed time is a span too: a blocking call from issue to return, an
asynchronous one from the start to the end of its wait. Each instant of the step is attributed to
the innermost span running then (exclusive time), so the components sum to the step exactly; the
step's time outside every span is "other". Under a pipeline schedule, the schedule's own exclusive
time is the **bubble**: waiting for the point-to-point tensors of other stages (and the schedule's
bookkeeping). An asynchronous collective's time between issue and wait ran under compute: the wall
time some collective of a mesh dimension was so in flight is reported as **overlapped** for that
dimension, beside the components (gloo tells when it completed; on CUDA it is the time until the
wait, an upper bound).

Marks come from the host clock on CPU, from CUDA events on GPU (read after the step synchronises).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from fived.compat import checkpointed_inner, in_backward
from fived.parallel import comm

COMPUTE = ("forward", "backward", "recompute")


class WallClock:
    now = staticmethod(time.perf_counter)

    @staticmethod
    def settle() -> None:
        pass

    @staticmethod
    def seconds(a, b) -> float:
        return b - a


class CudaClock:
    @staticmethod
    def now():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def seconds(a, b) -> float:
        return a.elapsed_time(b) / 1e3

    @staticmethod
    def settle() -> None:
        torch.cuda.synchronize()  # every event recorded so far has happened


@dataclass
class Span:
    category: str
    start: object
    end: object
    stage: int | None = None
    micro: int | None = None


class StepTimer:
    """One rank's spans and collectives, step by step. `profiling`: spans are also labelled for
    torch.profiler (`record_function`), so they appear in its traces. Not `enabled`: nothing is
    timed; the collectives' bytes and the one to blame for a timeout are still recorded."""

    def __init__(self, device: torch.device, group_names: dict, *, enabled: bool = True):
        self.enabled = enabled
        self.clock = CudaClock() if device.type == "cuda" else WallClock()
        self.recorder = comm.CommRecorder(group_names, clock=self.clock.now, timed=enabled)
        self.spans: list[Span] = []
        self.profiling = False
        self._start = self._end = None

    def span(self, category: str, *, stage: int | None = None, micro: int | None = None):
        return self._span(category, stage, micro) if self.enabled else contextlib.nullcontext()

    @contextlib.contextmanager
    def _span(self, category: str, stage: int | None, micro: int | None):
        label: contextlib.AbstractContextManager = contextlib.nullcontext()
        if self.profiling:
            where = "".join(f" {k}{v}" for k, v in (("stage", stage), ("mb", micro)) if v is not None)
            label = torch.profiler.record_function(f"fived/{category}{where}")
        start = self.clock.now()
        with label:
            try:
                yield
            finally:
                self.spans.append(Span(category, start, self.clock.now(), stage, micro))

    @contextlib.contextmanager
    def step(self, unrouted=None):
        """One step: spans and collectives from here on, until the next `step`."""
        self.recorder.reset()
        self.spans.clear()
        self._start = self.clock.now() if self.enabled else None
        with comm.recording(self.recorder), unrouted or contextlib.nullcontext():
            yield
        self._end = self.clock.now() if self.enabled else None

    def watch_recompute(self, chunks) -> None:
        """Time a checkpointed block's forward when backward runs it again. (Its forward, wrapped: the
        recomputation stops early, by an exception, once it has what backward needs, so a forward
        hook would not see its end.)"""
        for chunk in chunks if self.enabled else []:
            for block in chunk.layers.values():
                inner = checkpointed_inner(block)
                if inner is not None:
                    inner.forward = self._timed_recompute(inner.forward)

    def _timed_recompute(self, forward):
        def forward_or_recompute(*args, **kwargs):
            if not in_backward():  # a forward pass
                return forward(*args, **kwargs)
            with self.span("recompute"):  # inside backward: a recomputation
                return forward(*args, **kwargs)

        return forward_or_recompute

    def breakdown(self) -> dict | None:
        """This step's breakdown (after the step; on CUDA after the device synchronised)."""
        if not self.enabled:
            return None
        self.clock.settle()
        seconds = lambda mark: self.clock.seconds(self._start, mark)  # noqa: E731
        total = seconds(self._end)
        intervals = [(seconds(s.start), seconds(s.end), s.category, s.stage, s.micro) for s in self.spans]
        in_flight: dict[str, list] = defaultdict(list)
        for e in self.recorder.events:
            if e.wait_end is None:  # never waited on here (FSDP2 waits on its gathers itself)
                continue
            if e.wait_start is None:
                intervals.append((seconds(e.issued), seconds(e.wait_end), f"comm_{e.role}", None, None))
                continue
            intervals.append((seconds(e.wait_start), seconds(e.wait_end), f"comm_{e.role}", None, None))
            until = seconds(e.wait_start)
            if e.done is not None:  # (host clock only: gloo's completion time)
                until = min(until, seconds(e.done))
            in_flight[e.role].append((seconds(e.issued), until))
        overlapped = {role: covered(spans) for role, spans in in_flight.items()}
        exclusive, stages, micro = attribute(intervals, total)
        components = {k: v for k, v in exclusive.items() if v > 0 or k == "other"}
        return {
            "total_s": total,
            "components": components,
            "overlapped": overlapped,
            "stage_compute_s": {str(k): v for k, v in sorted(stages.items())},
            "microbatch_s": _per_stage(micro),
        }


def covered(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one of the (start, end) spans: collectives in flight at once (a
    pipeline of buckets) count once, as the wall time they ran under compute."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def attribute(intervals: list[tuple], total: float) -> tuple[dict, dict, dict]:
    """Exclusive seconds per category of nested intervals (start, end, category, stage, micro) in a
    step of `total` seconds (time outside every interval is "other"); also the compute seconds per
    pipeline stage and per (stage, micro-batch). A child outside its parent is clipped to it."""
    out: dict[str, float] = defaultdict(float)
    stages: dict[int, float] = defaultdict(float)
    micro: dict[tuple, float] = defaultdict(float)
    out["other"] = total
    stack = [(0.0, total, "other", None, None)]
    for start, end, category, stage, mb in sorted(intervals, key=lambda x: (x[0], -x[1])):
        while len(stack) > 1 and start >= stack[-1][1]:
            stack.pop()
        parent = stack[-1]
        start, end = max(start, parent[0]), min(end, parent[1])
        if end <= start:
            continue
        stage = parent[3] if stage is None else stage  # (a recompute or a wait belongs to its stage)
        mb = parent[4] if mb is None else mb
        out[parent[2]] -= end - start
        out[category] += end - start
        _charge(stages, micro, parent, -(end - start))
        node = (start, end, category, stage, mb)
        _charge(stages, micro, node, end - start)
        stack.append(node)
    return dict(out), dict(stages), dict(micro)


def _per_stage(micro: dict[tuple, float]) -> list[list[float]]:
    """[[seconds of each micro-batch] for each stage this rank holds, in stage order]."""
    stages: dict[int, list] = defaultdict(list)
    for (stage, _), seconds in sorted(micro.items()):
        stages[stage].append(seconds)
    return [stages[s] for s in sorted(stages)]


def _charge(stages: dict, micro: dict, node: tuple, seconds: float) -> None:
    """Compute seconds to the node's stage and micro-batch (exclusive: a parent gives up its child's)."""
    if node[2] in COMPUTE:
        stages[node[3] or 0] += seconds
        if node[4] is not None:
            micro[(node[3] or 0, node[4])] += seconds
