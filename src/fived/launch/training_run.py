"""One launch of a training run, on one path whoever started the ranks: `fived train --nproc N`
(`LocalRanks`: this process starts them, and restarts them as train.max_restarts allows) or torchrun
(`TorchrunRanks`: this process is one of them; torchrun restarts them, see `--resume auto`). Both
claim the run directory, say the same header, record the launch, train, write run.json and say the
same summary (fived.launch.run_summary); `fived train` and `fived.train` (the Python API) call `launch`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from functools import partial

from fived.config import ConfigError
from fived.launch.ranks import Stopped
from fived.launch.run_setup import TrainingRun
from fived.launch.run_summary import RunSummary, header_lines, summarise


@dataclass
class LaunchOutcome:
    """How a launch ended: its exit code, its summary (when it trained to the end) and, for a stop or
    a failure, the line(s) it said on stderr."""

    code: int
    summary: RunSummary | None = None
    line: str = ""


class LocalRanks:
    """`fived train --nproc N`: this process starts the ranks and speaks for them."""

    launcher = "local rank(s)"
    speaks = True

    def join(self, run: TrainingRun) -> TrainingRun:
        return run

    @contextlib.contextmanager
    def run_directory(self, run: TrainingRun):
        """A new run gets a directory of its own (never one a previous run logged to), locked while it runs."""
        from fived.launch.run_lock import RunLock
        from fived.training.metrics import fresh_output_dir

        if run.fresh_dir:
            run.cfg.train.output_dir = str(fresh_output_dir(run.cfg.train.output_dir))
        with RunLock(run.cfg.train.output_dir):  # one run per directory (refused in one line naming the holder)
            yield

    def train(self, run: TrainingRun, progress: bool) -> tuple[list | None, int, str]:
        """(every rank's TrainResult, exit code, what to say) of the ranks, restarted as configured."""
        from fived.launch.ranks import RankFailed
        from fived.launch.supervisor import failure_line, run_with_restarts, stop_line
        from fived.training.divergence import DIVERGED_EXIT
        from fived.training.trainer import train_rank

        cfg = run.cfg
        try:
            results = run_with_restarts(cfg, run.world, run.resume, partial(train_rank, progress=progress))
            if any(r.preempted for r in results):  # SIGTERM reached the ranks, not the launcher
                raise Stopped("SIGTERM", results)
            return results, 0, ""
        except Stopped as stop:
            line, code = stop_line(stop, cfg)
            return None, code, line
        except RankFailed as failure:
            said = failure.line_of("diverged")
            if said:
                return None, DIVERGED_EXIT, said
            said = failure.line_of("write_failed")  # (a full disk, a read-only filesystem: restarting would not help)
            if said:
                return None, 1, said
            crash = "" if failure.summaries else str(failure) + "\n"  # (a crash's traceback is the useful part)
            restarts = f" (after {cfg.train.max_restarts} restarts)" if cfg.train.max_restarts else ""
            return None, 1, f"{crash}fived train: failed: {failure_line(failure)}{restarts}"

    def gathered(self, value):
        return value

    def leave(self) -> None:
        pass


class TorchrunRanks:
    """This process is one of the ranks torchrun started: it joins them; global rank 0 speaks. (torchrun
    restarts the ranks itself: run `fived train --resume auto` under `torchrun --max-restarts N`.)"""

    launcher = "rank(s) under torchrun"

    def join(self, run: TrainingRun) -> TrainingRun:
        import torch.distributed as dist

        from fived.parallel.process_group import init_distributed

        init_distributed(run.cfg.train.collective_timeout_s, device=run.cfg.train.device)
        self.rank = dist.get_rank()
        self.speaks = self.rank == 0
        return agreed_run(run)

    @contextlib.contextmanager
    def run_directory(self, run: TrainingRun):
        """Rank 0 picks the run directory (every rank writes its checkpoint shards there) and locks it
        until this process ends; a refusal is every rank's."""
        import torch.distributed as dist

        from fived.training.metrics import fresh_output_dir

        if run.fresh_dir:
            chosen = [str(fresh_output_dir(run.cfg.train.output_dir)) if self.rank == 0 else None]
            dist.broadcast_object_list(chosen, src=0)
            run.cfg.train.output_dir = str(chosen[0])
        refusal = [lock_on_rank0(run.cfg.train.output_dir)]  # (held until this process ends, however it ends)
        dist.broadcast_object_list(refusal, src=0)
        if refusal[0]:
            raise RefusedDirectory(refusal[0])
        yield

    def train(self, run: TrainingRun, progress: bool) -> tuple[list | None, int, str]:
        """(every rank's TrainResult on rank 0, exit code, what to say) of this rank's training."""
        from fived.checkpoint.checkpointer import FinalSaveSkipped
        from fived.launch.supervisor import describe_run_dir, restore_config, stop_line
        from fived.training.divergence import DIVERGED_EXIT, Diverged
        from fived.training.faults import PREEMPTED_EXIT
        from fived.training.trainer import train_rank
        from fived.write_errors import WriteFailed

        cfg, previous = run.cfg, None
        if self.rank == 0:
            restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            previous = describe_run_dir(
                cfg,
                run.world,
                {"event": "resume" if run.resume else "start", "resume_from": run.resume, "torchrun_restart": restart},
            )
        try:
            result = train_rank(cfg, progress=progress, resume=run.resume)
        except (
            Diverged,
            WriteFailed,
            FinalSaveSkipped,
        ) as stop:  # (a divergence: every rank at the same step; rank 0 says it)
            if isinstance(stop, Diverged) and self.rank == 0:
                restore_config(cfg.train.output_dir, previous)
            self.speaks = self.speaks or isinstance(stop, WriteFailed)  # (a refused write: each rank its own)
            return None, DIVERGED_EXIT if isinstance(stop, Diverged) else 1, f"fived train: {stop}"
        results = self._gather(result)
        if result.preempted:
            line, _ = stop_line(Stopped("SIGTERM", [result]), cfg)
            return None, PREEMPTED_EXIT, line
        return results, 0, ""

    def _gather(self, result) -> list | None:
        """Every rank's result on rank 0, each without its per-step records (rank 0's are the run's):
        its mean step breakdown, state bytes, collectives, pipeline actions and expert load."""
        import torch.distributed as dist

        from fived.training.breakdown import mean_breakdown

        slim = dataclasses.replace(
            result,
            metrics=result.metrics if self.rank == 0 else [],
            state={},
            breakdowns=[mean_breakdown(result.breakdowns)] if result.breakdowns else [],
        )
        everyone = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(slim, everyone, dst=0)
        return everyone

    def gathered(self, value):
        """Rank 0's `value` on every rank (the summary the API returns on each)."""
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def leave(self) -> None:
        from fived.parallel.process_group import shutdown_distributed

        shutdown_distributed()


class RefusedDirectory(Exception):
    """Under torchrun: rank 0 could not lock the run directory (its one line, raised on every rank)."""


def launch(run: TrainingRun, *, report: bool = False, progress: bool = True) -> LaunchOutcome:
    """Run `run` under whichever launcher started this process, saying the header, any stop or failure
    line (stderr) and the summary (stdout) as the launcher's speaker."""
    from fived.parallel.process_group import under_torchrun

    ranks = TorchrunRanks() if under_torchrun() else LocalRanks()
    run = ranks.join(run)
    try:
        return _launch(ranks, run, report, progress)
    finally:
        ranks.leave()


def _launch(ranks, run: TrainingRun, report: bool, progress: bool) -> LaunchOutcome:
    cfg = run.cfg
    say = partial(print, flush=True) if ranks.speaks else (lambda *a, **k: None)
    if run.finished:
        say(
            f"fived train: {cfg.train.output_dir} already reached train.steps={cfg.train.steps} (its checkpoint: "
            f"step {run.resumed_step}); nothing to do"
        )
        return LaunchOutcome(0)
    try:
        with ranks.run_directory(run):
            return _train(ranks, run, report, progress, say)
    except RefusedDirectory as refused:
        if ranks.speaks:
            print(f"fived: error: {refused}", file=sys.stderr, flush=True)
        return LaunchOutcome(2, line=f"fived: error: {refused}")


def _train(ranks, run: TrainingRun, report: bool, progress: bool, say) -> LaunchOutcome:
    cfg = run.cfg
    for line in header_lines(cfg, run.world, ranks.launcher, run.resumed_step if run.resume else None):
        say(line)
    started = time.perf_counter()
    results, code, line = ranks.train(run, progress)
    if results is None and line:
        if ranks.speaks:
            print("\n" + line, file=sys.stderr, flush=True)  # (after the progress bar's unfinished line)
        return LaunchOutcome(code, line=line)
    summary = None
    if ranks.speaks:
        summary = finish(cfg, run.world, results, report=report, wall_s=time.perf_counter() - started)
        for text in summary.lines():
            say(text)
    return LaunchOutcome(code, ranks.gathered(summary))


def finish(cfg, world: int, results: list, *, report: bool, wall_s: float) -> RunSummary:
    """What a launch writes and says when its ranks are done: run.json, the pipeline trace, the merged
    profile, the `--report` tables; returns its summary."""
    from fived.parallel.pipeline import write_chrome_trace
    from fived.training.report import format_report, write_run_json

    write_run_json(cfg, world, results)  # (what `fived report` shows beside the metrics)
    if cfg.train.trace:
        write_chrome_trace(cfg.train.trace, [a for r in results for a in r.timeline])
        print(f"pipeline trace of {world} rank(s) -> {cfg.train.trace}")
    if cfg.train.profile:
        print_profile(cfg, world)
    if report:
        print(format_report(cfg, world, results))
    summary = summarise(results[0].metrics, cfg.train.output_dir, wall_s, results[0].checkpoints)
    track_summary(cfg, world, summary)
    return summary


def track_summary(cfg, world: int, summary: RunSummary) -> None:
    """The launch's summary into the tracked run rank 0 logged to (reopened here: under `--nproc` the
    ranks were other processes)."""
    from fived.training.tracker import open_tracker, saved_run_id

    if cfg.train.tracker == "none" or saved_run_id(cfg.train.output_dir, cfg.train.tracker) is None:
        return  # (no tracked run started: its warning was said)
    tracker = open_tracker(cfg, world, config=False)
    tracker.summary(summary.to_dict())
    tracker.close()


def print_profile(cfg, world: int) -> None:
    """Merge the ranks' torch.profiler traces and say where they are."""
    from fived.training.profiling import merge_traces

    merged = merge_traces(cfg.train.output_dir, world)
    if merged is not None:
        print(
            f"profile of steps {cfg.train.profile} ({world} rank(s)): {merged.parent}/rank<R>.json, merged "
            f"-> {merged} (open in https://ui.perfetto.dev or chrome://tracing)"
        )


def agreed_run(run: TrainingRun) -> TrainingRun:
    """Every rank torchrun started: global rank 0's TrainingRun (which checkpoint to resume, at which
    step, or that the run is finished), broadcast. Each rank chose before the process group existed,
    and only rank 0 read the checkpoint whole (fived.launch.run_setup.prepare_training): a transient read
    error on another rank must not make that rank alone resume an older step."""
    import torch.distributed as dist

    chosen = [run if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(chosen, src=0)
    agreed = chosen[0]
    assert isinstance(agreed, TrainingRun)
    return agreed


def lock_on_rank0(run_dir: str) -> str | None:
    """Under torchrun: global rank 0 locks the run directory for its lifetime; the refusal, if any
    (one line, also for a lock file that cannot be created: the other ranks must not wait for it)."""
    import torch.distributed as dist

    from fived.launch.run_lock import RunLock
    from fived.write_errors import describe

    if dist.get_rank() != 0:
        return None
    try:
        RunLock(run_dir).acquire()  # (never released explicitly: the process's end releases it)
    except ConfigError as e:
        return str(e)
    except OSError as e:
        return f"cannot lock the run directory ({describe(e, run_dir)})"
    return None
