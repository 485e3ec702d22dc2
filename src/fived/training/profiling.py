"""`--train.profile START:END`: torch.profiler over steps START..END on every rank.

Each rank writes <output_dir>/profile/rank<R>.json (torch's Chrome/Perfetto trace: CPU activities,
and CUDA kernels on GPU). While the window is open fived labels its own work for the profiler
(`fived.training.step_timer` spans: "fived/forward stage0 mb1", "fived/backward ...", "fived/recompute",
"fived/bubble", "fived/optimizer", "fived/data", ...; every collective of `fived.parallel.comm` as
"fived/comm/<role>/<collective>" (the mesh dimension it works for: its group's, but dp for the
gradient reductions over any group, as the step breakdown counts them), and the pipeline's point-to-point ops as they are posted,
"fived/comm/pp/send_f" ...), so they sit in the same trace as the kernels. `merge_traces` then writes
profile/trace.json: every rank's events in one file, one process per rank ("rank R"), on one time
axis (each trace's baseTimeNanoseconds: the host clocks, aligned only as well as the hosts' are).

A launch never replaces an earlier launch's traces (a resumed run profiling the window again): the
second launch's go to profile-2/, the third's to profile-3/, ... (fived.files writes them).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from fived.files import install, write_file
from fived.layout.rules import profile_window


class ProfileWindow:
    """Opens torch.profiler before step START and writes this rank's trace after step END."""

    def __init__(self, spec: str, steps: int, output_dir: str, rank: int, device: torch.device, timer):
        self.window = profile_window(spec, steps) if spec else None
        self.run_dir, self.rank, self.device, self.timer = Path(output_dir), rank, device, timer
        self.profiler: torch.profiler.profile | None = None

    def before_step(self, step: int) -> None:
        """`step`: the 0-based index of the step about to run (the window counts from 1)."""
        if self.window is None or self.profiler is not None or not self.window[0] <= step + 1 <= self.window[1]:
            return  # (a run resumed inside the window profiles what is left of it)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = profiler = torch.profiler.profile(activities=activities)
        profiler.__enter__()
        self._label(True)

    def after_step(self, step: int, *, last: bool = False) -> None:
        """After the step with 0-based index `step`; `last`: the run stops here (close the window)."""
        if self.profiler is None or self.window is None or (step + 1 < self.window[1] and not last):
            return
        self._label(False)
        self.profiler.__exit__(None, None, None)
        folder = profile_folder(self.run_dir, self.rank, new=True)
        tmp = self.run_dir / f".rank{self.rank}.trace.tmp-{os.getpid()}"
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))  # (ours, not a link)
            self.profiler.export_chrome_trace(str(tmp))
            install(self.run_dir, f"{folder}/rank{self.rank}.json", tmp)
        finally:
            self.profiler = None
            tmp.unlink(missing_ok=True)

    def _label(self, on: bool) -> None:
        if self.timer is not None:
            self.timer.profiling = self.timer.recorder.profiling = on


def profile_folder(run_dir: Path, rank: int, *, new: bool) -> str:
    """The folder of this launch's traces: the first of profile, profile-2, ... without a trace of
    `rank` (`new`: where it goes), or the last one with one (where it went)."""
    names = ["profile", *(f"profile-{n}" for n in range(2, 10_000))]
    taken = 0
    while (run_dir / names[taken] / f"rank{rank}.json").is_file():
        taken += 1
    return names[taken] if new else names[max(taken - 1, 0)]


def merge_traces(run_dir: str | Path, world: int) -> Path | None:
    """<profile folder>/trace.json from this launch's traces (those present): one process per rank,
    times in microseconds from the earliest event of any rank."""
    folder = Path(run_dir) / profile_folder(Path(run_dir), 0, new=False)
    traces = {
        r: json.loads((folder / f"rank{r}.json").read_text())
        for r in range(world)
        if (folder / f"rank{r}.json").is_file()
    }
    if not traces:
        return None
    bases = {r: t.get("baseTimeNanoseconds", 0) / 1e3 for r, t in traces.items()}
    origin = min(
        bases[r] + min((e["ts"] for e in t["traceEvents"] if "ts" in e), default=0.0) for r, t in traces.items()
    )
    events = []
    for rank, trace in sorted(traces.items()):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for event in trace["traceEvents"]:
            if event.get("ph") == "M" and event.get("name") in ("process_name", "process_sort_index", "process_labels"):
                continue
            moved = dict(event, pid=rank)
            if "id" in moved:  # flow arrows (CPU op -> kernel) stay within their rank
                moved["id"] = f"{rank}:{moved['id']}"
            if "ts" in moved:
                moved["ts"] = moved["ts"] + bases[rank] - origin
            events.append(moved)
    name = f"{folder.name}/trace.json"
    return write_file(run_dir, name, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
