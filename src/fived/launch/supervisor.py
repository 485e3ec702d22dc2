"""`fived train`'s launcher policy: start the ranks, restart them all from the newest complete
checkpoint when one dies (at most train.max_restarts times), stop them on signals, and record every
launch in the run directory.

The run directory describes itself from the start: `config.toml` (the resolved config, every field;
`fived train --config` runs it again) and `launches.jsonl` (one line per start, resume or restart:
command line, fived and torch versions, layout, world size, the checkpoint it continued from, and for
a restart which rank failed, at which step and why).

Exit codes: 0 done; 1 a rank failed (restarts exhausted); 65 diverged (non-finite or spiking loss:
nothing saved after the newest healthy checkpoint, see fived.training.divergence; never restarted); 75
preempted after saving (resumable: run `fived train --resume DIR`); 130 interrupted (Ctrl-C); 143
terminated with nothing saved.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from fived.checkpoint.checkpointer import find_checkpoint
from fived.config import Config
from fived.files import append_line, read_json_lines, write_file
from fived.launch.config_file import DIGEST_KEY, digest
from fived.launch.ranks import RankFailed, Stopped, run_ranks
from fived.parallel.mesh import resolve_dp
from fived.training.faults import INTERRUPTED_EXIT, PREEMPTED_EXIT, TERMINATED_EXIT, timeout_line
from fived.version import __version__
from fived.write_errors import writing


def describe_run_dir(cfg: Config, world: int, event: dict) -> str | None:
    """Write config.toml and append one line to launches.jsonl in the run directory. Returns the
    config.toml it replaced (None if there was none), for restore_config."""
    from fived.config_docs import commented_toml

    run_dir = Path(cfg.train.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    previous = (
        (run_dir / "config.toml").read_text() if (run_dir / "config.toml").is_file() else None
    )  # (fived's: the run directory is)
    text = commented_toml(cfg)
    write_config_toml(run_dir, text)  # (every field, with its description)
    p = cfg.parallel
    record = {
        "time": time.time(),
        "command": sys.argv,
        "fived_version": __version__,
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "world_size": world,
        "layout": {
            "dp": resolve_dp(cfg, world),
            "tp": p.tp,
            "pp": p.pp,
            "cp": p.cp,
            "ep": p.ep,
            "zero": p.zero,
            "dp_replicate": p.dp_replicate,
        },
        **event,
        DIGEST_KEY: digest(text),  # (a resume refuses a config.toml fived did not write: config_file)
        "config": cfg.to_dict(),
    }  # (config.toml is the latest; every launch's is kept here)
    with writing(run_dir / "launches.jsonl"):
        append_line(run_dir, "launches.jsonl", json.dumps(record))
    return previous


def write_config_toml(run_dir: Path, text: str) -> None:
    with writing(run_dir / "config.toml"):
        write_file(run_dir, "config.toml", text)


def restore_config(run_dir: str | Path, previous: str | None) -> None:
    """A launch that diverged puts back the config.toml it replaced (its own config stays in
    launches.jsonl): `fived train --config DIR/config.toml` must not run the diverging settings again.
    A new run that diverged keeps its own (there is nothing else; the exit line says what to lower)."""
    if previous is not None:
        write_config_toml(Path(run_dir), previous)


def last_logged_step(run_dir: str) -> int:
    path = Path(run_dir) / "metrics.jsonl"
    records = [r for r in read_json_lines(path) if "step" in r] if path.exists() else []
    return records[-1]["step"] if records else 0


def _saves_on_sigterm(cfg: Config) -> bool:
    return cfg.checkpoint.final or cfg.checkpoint.every > 0


def run_with_restarts(cfg: Config, world: int, resume: str | None, train: Callable) -> list:
    """Run `train(cfg, resume=...)` on every rank; on a rank's death restart them all from the newest
    complete checkpoint. Raises RankFailed when restarts are exhausted, Stopped on a signal."""
    restarts = 0
    previous = describe_run_dir(cfg, world, {"event": "resume" if resume else "start", "resume_from": resume})
    grace = cfg.train.preempt_grace_s if _saves_on_sigterm(cfg) else 0.0
    while True:
        try:
            return run_ranks(
                world,
                partial(train, cfg, resume=resume),
                device=cfg.train.device,
                timeout_s=cfg.train.collective_timeout_s,
                grace_s=grace,
            )
        except RankFailed as failure:
            diverged = failure.line_of("diverged")
            if diverged:
                restore_config(cfg.train.output_dir, previous)
            if restarts >= cfg.train.max_restarts or diverged or failure.line_of("write_failed"):
                raise  # (a diverged run would diverge again from the same checkpoint; a full disk is full)
            restarts += 1
            checkpoint = find_checkpoint(cfg.train.output_dir)
            resume = str(checkpoint) if checkpoint is not None else None
            why, failed_step = failure_line(failure), last_logged_step(cfg.train.output_dir) + 1
            describe_run_dir(
                cfg,
                world,
                {
                    "event": "restart",
                    "restart": restarts,
                    "failed_rank": failure.rank,
                    "failed_step": failed_step,
                    "why": why,
                    "resume_from": resume,
                },
            )
            print(
                f"fived train: {why} (in step {failed_step}); restart {restarts} of {cfg.train.max_restarts} from "
                f"{Path(resume).name if resume else 'the start'}",
                file=sys.stderr,
                flush=True,
            )


def failure_line(failure: RankFailed) -> str:
    timeouts = [s for s in failure.summaries if s.get("kind") == "collective_timeout"]
    return "collective timeout: " + timeout_line(timeouts) if timeouts else failure.reason


def stop_line(stop: Stopped, cfg: Config) -> tuple[str, int]:
    """The one line and the exit code for a run stopped by a signal."""
    run_dir = cfg.train.output_dir
    if stop.signal_name == "SIGTERM" and stop.results and stop.results[0].preempted:
        step = stop.results[0].metrics[-1]["step"] if stop.results[0].metrics else last_logged_step(run_dir)
        saved = Path(run_dir) / "checkpoints" / f"step-{step}"
        if not saved.is_dir():  # (the save was skipped: no room on the disk, said by its warning)
            newest = find_checkpoint(run_dir)
            return (
                f"fived train: preempted (SIGTERM): every rank stopped after step {step}, whose save was "
                f"skipped; newest checkpoint {newest}; continue with: fived train --resume {run_dir}"
                if newest
                else f"fived train: preempted (SIGTERM) after step {step}; nothing could be saved",
                PREEMPTED_EXIT if newest else TERMINATED_EXIT,
            )
        return (
            f"fived train: preempted (SIGTERM): every rank stopped after step {step} and saved "
            f"{saved}; continue with: fived train --resume {run_dir}",
            PREEMPTED_EXIT,
        )
    newest = find_checkpoint(run_dir)
    then = f"; newest checkpoint {newest}, continue with: fived train --resume {run_dir}" if newest else ""
    code = INTERRUPTED_EXIT if stop.signal_name == "SIGINT" else TERMINATED_EXIT
    if stop.abandoned_save and not (stop.results and stop.results[0].preempted):
        return (
            f"fived train: a second {stop.signal_name} came during the preemption save: the save was abandoned, every rank was stopped{then or '; no checkpoint of this run is saved'}",
            code,
        )
    return f"fived train: stopped by {stop.signal_name}: every rank was stopped{then}", code
