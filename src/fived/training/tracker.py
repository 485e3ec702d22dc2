"""Experiment tracking (train.tracker): W&B or MLflow gets the resolved config and layout, every record
fived writes to metrics.jsonl (fived.training.metrics.MetricsLog hands each one over) and each
launch's summary. Global rank 0 only.

One tracked run per launch chain: its id is kept in the run directory (tracker.json), so a resume or a
restart continues it. Each library reads its own settings (WANDB_MODE, WANDB_DIR, WANDB_PROJECT;
MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME): fived passes none. A tracker is never the reason a run
fails: its error is one warning line and training goes on (metrics.jsonl is the run's record).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fived.config import Config, ConfigError

RUN_ID_FILE = "tracker.json"  # {"tracker": "wandb", "run_id": "..."} in the run directory


def check_tracker(name: str) -> None:
    """Before any process starts: the tracker's package is installed (a one-line ConfigError if not)."""
    if name != "none" and importlib.util.find_spec(name) is None:  # (the extra is named as the module)
        raise ConfigError(
            "train.tracker", name, f"needs the {name} package, which is not installed", f"pip install 'fived[{name}]'"
        )


def flat_numbers(record: dict, prefix: str = "") -> dict[str, float]:
    """The numbers of a (nested) record, keyed by their path ("breakdown/components/compute"): new keys
    such as per-source losses are tracked as they come; text and lists are left to metrics.jsonl."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_numbers(value, name + "/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and name != "step":
            out[metric_name(name)] = float(value)
    return out


class _Wandb:
    def __init__(self, run_id: str | None, config: dict):
        import wandb

        self.run = wandb.init(id=run_id, resume="allow") if run_id else wandb.init()
        self.run_id: str = self.run.id
        if config:
            self.run.config.update(config, allow_val_change=True)  # (a resume may change steps or layout)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def summary(self, values: dict[str, float]) -> None:
        self.run.summary.update(values)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class _Mlflow:
    def __init__(self, run_id: str | None, config: dict):
        import mlflow

        self.mlflow = mlflow
        self.run_id = mlflow.start_run(run_id=run_id).info.run_id
        if config:
            self._log_config(
                {f"{section}.{k}": str(v) for section, values in config.items() for k, v in values.items()}
            )

    def _log_config(self, params: dict[str, str]) -> None:
        """Params are the config the tracked run started with (MLflow's params never change); a
        resume's changed values (more steps, another layout) are tags `resumed.<key>`."""
        logged = self.mlflow.get_run(self.run_id).data.params
        self.mlflow.log_params({k: v for k, v in params.items() if k not in logged})
        changed = {f"resumed.{k}": v for k, v in params.items() if k in logged and logged[k] != v}
        if changed:
            self.mlflow.set_tags(changed)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.mlflow.log_metrics(metrics, step=step)

    def summary(self, values: dict[str, float]) -> None:
        self.mlflow.log_metrics(values)

    def close(self, failed: bool) -> None:
        self.mlflow.end_run(status="FAILED" if failed else "FINISHED")


def metric_name(key: str) -> str:
    """A metric name both trackers accept (a source's path may hold any character; MLflow's names are
    relative paths of word characters, '.', '-', ' ', ':' and '/')."""
    return "/".join(p for p in re.sub(r"[^\w.\- :/]", "_", key).split("/") if p not in ("", ".", "..")) or "_"


BACKENDS: dict[str, Any] = {"wandb": _Wandb, "mlflow": _Mlflow}


@dataclass
class Tracker:
    """This process's handle on the tracked run (or none): no method raises; a failure is one warning
    line per kind of call, and the run goes on."""

    name: str = "none"
    backend: Any = None
    failed: set[str] = field(default_factory=set)

    def log(self, record: dict) -> None:
        """One metrics.jsonl record, at its step."""
        if self.backend is not None:
            self._call("logging metrics", self.backend.log, record["step"], flat_numbers(record))

    def summary(self, values: dict) -> None:
        """A launch's summary figures (summary/<name>)."""
        if self.backend is not None:
            self._call("logging the summary", self.backend.summary, flat_numbers(values, "summary/"))

    def close(self, *, failed: bool = False) -> None:
        if self.backend is not None:
            self._call("closing the tracked run", self.backend.close, failed)
            self.backend = None

    def _call(self, what: str, fn, *args) -> bool:
        try:
            fn(*args)
            return True
        except Exception as e:  # (anything the library raises: tracking must not end the run)
            if what not in self.failed:
                self.failed.add(what)
                _warn(self.name, what, e)
            return False


def open_tracker(cfg: Config, world: int, *, config: bool = True) -> Tracker:
    """The launch chain's tracked run (continued when the run directory names one, else started and
    named there), with the resolved config and layout logged (`config`); the no-op Tracker when
    train.tracker is none or the library fails to start."""
    name, run_dir = cfg.train.tracker, cfg.train.output_dir
    if name == "none":
        return Tracker()
    saved = saved_run_id(run_dir, name)
    try:
        backend = BACKENDS[name](saved, _config(cfg, world) if config else {})
    except Exception as e:  # (not logged in, no server, a bad URI: the run trains without tracking)
        _warn(name, "starting the tracked run", e)
        return Tracker()
    if backend.run_id != saved:
        _save_run_id(run_dir, name, backend.run_id)
    return Tracker(name, backend)


def saved_run_id(run_dir: str, name: str) -> str | None:
    """The tracked run this run directory's launches log to, if it names one of `name`'s."""
    from fived.files import read_json

    path = Path(run_dir) / RUN_ID_FILE
    saved = read_json(path) if path.is_file() else None
    return str(saved["run_id"]) if saved and saved.get("tracker") == name and saved.get("run_id") else None


def _save_run_id(run_dir: str, name: str, run_id: str) -> None:
    from fived.files import write_file

    try:
        write_file(run_dir, RUN_ID_FILE, json.dumps({"tracker": name, "run_id": run_id}))
    except (OSError, ValueError) as e:  # (a resume will start a new tracked run; training goes on)
        _warn(name, f"saving the tracked run's id in {run_dir}/{RUN_ID_FILE}", e)


def _config(cfg: Config, world: int) -> dict:
    from fived.layout.layout import Layout

    return {**cfg.to_dict(), "layout": {**Layout.from_config(cfg, world).to_dict(), "world": world}}


def _warn(name: str, what: str, error: Exception) -> None:
    first = (str(error).strip().splitlines() or [""])[0]
    if len(first) > 300:
        first = first[:297] + "..."
    if name == "mlflow" and "MLFLOW_ALLOW_FILE_STORE" not in os.environ and "file" in first.lower():
        first += " — for a local file store set MLFLOW_ALLOW_FILE_STORE=true (see docs/training.md)"
    print(
        f"fived: warning: train.tracker={name}: {what} failed ({type(error).__name__}: {first}); training goes on",
        file=sys.stderr,
        flush=True,
    )
