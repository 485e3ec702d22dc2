"""`fived train`'s two ways to run: start the local ranks (with restarts), or be one of the ranks
torchrun started (fived.cli decides which)."""
from __future__ import annotations

import argparse
import os
import sys

from fived.config import ConfigError
from fived.launch import Stopped


def train_locally(ns: argparse.Namespace, run) -> int:
    """Start the local ranks (restarting them as train.max_restarts allows) and report the run."""
    from fived.divergence import DIVERGED_EXIT
    from fived.launch import RankFailed
    from fived.mesh import resolve_dp
    from fived.supervisor import failure_line, run_with_restarts, stop_line
    from fived.trainer import run_training

    cfg, world = run.cfg, run.world
    start = f"resuming step {run.resumed_step} of {cfg.train.output_dir}" if run.resume else f"{cfg.train.steps} steps"
    print(f"fived train: model {cfg.model.name}, {world} local rank(s), layout "
          f"dp={resolve_dp(cfg, world)} tp={cfg.parallel.tp} "
          f"pp={cfg.parallel.pp} cp={cfg.parallel.cp} ep={cfg.parallel.ep} zero={cfg.parallel.zero}, "
          f"{start} -> {cfg.train.output_dir}/metrics.jsonl", flush=True)
    try:
        results = run_with_restarts(cfg, world, run.resume, run_training)
        if any(r.preempted for r in results):  # SIGTERM reached the ranks, not the launcher
            raise Stopped("SIGTERM", results)
    except Stopped as stop:
        line, code = stop_line(stop, cfg)
        print("\n" + line, file=sys.stderr)  # (after the progress bar's unfinished line)
        return code
    except RankFailed as failure:
        diverged = failure.line_of("diverged")
        if diverged:
            print("\n" + diverged, file=sys.stderr)
            return DIVERGED_EXIT
        refused = failure.line_of("write_failed")
        if refused:  # (a full disk, a read-only filesystem: restarting would not help)
            print("\n" + refused, file=sys.stderr)
            return 1
        if not failure.summaries:  # a crash, not a timeout: its traceback is the useful part
            print(str(failure), file=sys.stderr)
        print(f"fived train: failed: {failure_line(failure)}" + (
            f" (after {cfg.train.max_restarts} restarts)" if cfg.train.max_restarts else ""), file=sys.stderr)
        return 1
    summarise(ns, cfg, world, results)
    return 0


def summarise(ns: argparse.Namespace, cfg, world: int, results: list) -> None:
    from fived.parallel.pipeline import write_chrome_trace
    from fived.report import format_report, write_run_json

    write_run_json(cfg, world, results)  # (what `fived report` shows beside the metrics)
    if cfg.train.trace:
        write_chrome_trace(cfg.train.trace, [a for r in results for a in r.timeline])
        print(f"pipeline trace of {world} rank(s) -> {cfg.train.trace}")
    if cfg.train.profile:
        print_profile(cfg, world)
    first, last = results[0].metrics[0], results[0].metrics[-1]
    print(f"loss {first['loss']:.4f} (step {first['step']}) -> {last['loss']:.4f} (step {last['step']}); "
          f"{last['tokens_per_s']:.0f} tokens/s, MFU {last['mfu']:.1%}")
    evaluated = [m for m in results[0].metrics if "val_loss" in m]
    if evaluated:
        print(f"val_loss {evaluated[-1]['val_loss']:.4f} (step {evaluated[-1]['step']}, perplexity "
              f"{evaluated[-1]['val_ppl']:.2f})")
    if ns.report:
        print(format_report(cfg, world, results))


def print_profile(cfg, world: int) -> None:
    """Merge the ranks' torch.profiler traces and say where they are."""
    from fived.profiling import merge_traces

    merged = merge_traces(cfg.train.output_dir, world)
    if merged is not None:
        print(f"profile of steps {cfg.train.profile} ({world} rank(s)): {merged.parent}/rank<R>.json, merged "
              f"-> {merged} (open in https://ui.perfetto.dev or chrome://tracing)")


def train_under_torchrun(ns: argparse.Namespace, run) -> int:
    """This process is one of the ranks torchrun started: join them and train. (torchrun restarts
    the ranks itself: run `fived train --resume auto` under `torchrun --max-restarts N`.)"""
    import torch.distributed as dist

    from fived.divergence import DIVERGED_EXIT, Diverged
    from fived.faults import PREEMPTED_EXIT
    from fived.write_errors import WriteFailed
    from fived.launch import init_distributed, shutdown_distributed
    from fived.metrics import fresh_output_dir
    from fived.supervisor import describe_run_dir, restore_config
    from fived.trainer import run_training

    init_distributed(run.cfg.train.collective_timeout_s, device=run.cfg.train.device)
    run = agreed_run(run)
    cfg = run.cfg
    if run.finished:
        if dist.get_rank() == 0:
            print(f"fived train: {cfg.train.output_dir} already reached train.steps={cfg.train.steps}; nothing to do",
                  flush=True)
        shutdown_distributed()
        sys.stdout.flush()
        os._exit(0)
    if run.fresh_dir:  # rank 0 picks the run directory; every rank writes its checkpoint shards there
        chosen = [str(fresh_output_dir(cfg.train.output_dir)) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(chosen, src=0)
        cfg.train.output_dir = chosen[0]
    refusal = [lock_on_rank0(cfg.train.output_dir)]  # (held until this process ends, however it ends)
    dist.broadcast_object_list(refusal, src=0)
    if refusal[0]:
        if dist.get_rank() == 0:
            print(f"fived: error: {refusal[0]}", file=sys.stderr, flush=True)
        shutdown_distributed()
        os._exit(2)
    previous = None
    if dist.get_rank() == 0:
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        previous = describe_run_dir(cfg, run.world, {"event": "resume" if run.resume else "start",
                                                     "resume_from": run.resume, "torchrun_restart": restart})
    try:
        result = run_training(cfg, True, True, False, run.resume)
    except (Diverged, WriteFailed) as stop:  # (a divergence: every rank at the same step; one says it)
        if isinstance(stop, WriteFailed) or dist.get_rank() == 0:
            print(f"\nfived train: {stop}", file=sys.stderr, flush=True)
        if isinstance(stop, Diverged) and dist.get_rank() == 0:
            restore_config(cfg.train.output_dir, previous)
        shutdown_distributed()
        os._exit(DIVERGED_EXIT if isinstance(stop, Diverged) else 1)
    summarise_on_ranks(ns, cfg, run.world, result)
    # As every fived rank ends: gloo and DTensor can abort at interpreter exit, which torchrun would
    # count as a failure and restart.
    shutdown_distributed()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(PREEMPTED_EXIT if result.preempted else 0)


def summarise_on_ranks(ns: argparse.Namespace, cfg, world: int, result) -> None:
    """Under torchrun, what `summarise` does for local ranks: the pipeline trace, the merged profile
    and run.json from every rank's figures, gathered to rank 0 (and --report printed there)."""
    import torch.distributed as dist

    from fived.breakdown import mean_breakdown
    from fived.parallel.pipeline import write_chrome_trace
    from fived.report import format_report, write_run_json

    if cfg.train.trace:  # every rank's timeline, gathered to rank 0
        timelines = [None] * dist.get_world_size()
        dist.all_gather_object(timelines, result.timeline)
        if dist.get_rank() == 0:
            write_chrome_trace(cfg.train.trace, [a for t in timelines for a in t])
    if cfg.train.profile:
        dist.barrier()  # every rank's trace written
        if dist.get_rank() == 0:
            print_profile(cfg, world)
    breakdowns = [None] * dist.get_world_size()  # every rank's mean step breakdown, for run.json
    dist.all_gather_object(breakdowns, [mean_breakdown(result.breakdowns)] if result.breakdowns else [])
    if dist.get_rank() == 0:
        write_run_json(cfg, world, [result], breakdowns)
        if ns.report:
            print(format_report(cfg, world, [result]))


def agreed_run(run):
    """Every rank torchrun started: global rank 0's TrainingRun (which checkpoint to resume, at which
    step, or that the run is finished), broadcast. Each rank chose before the process group existed,
    and only rank 0 read the checkpoint whole (fived.run_setup.prepare_training): a transient read
    error on another rank must not make that rank alone resume an older step."""
    import torch.distributed as dist

    chosen = [run if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(chosen, src=0)
    return chosen[0]


def lock_on_rank0(run_dir: str) -> str | None:
    """Under torchrun: global rank 0 locks the run directory for its lifetime; the refusal, if any
    (one line, also for a lock file that cannot be created: the other ranks must not wait for it)."""
    import torch.distributed as dist

    from fived.run_lock import RunLock
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
