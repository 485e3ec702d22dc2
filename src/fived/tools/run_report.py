"""`fived report RUN_DIR`: the page of a training run, from what the run directory holds —
metrics.jsonl (loss, validation loss where logged, lr, grad norm, tokens/s, MFU per step),
config.toml (the layout), and run.json, which `fived train` writes at the end (`fived.training.report.
write_run_json`: the same measured-vs-planner tables `fived train --report` prints, the executed
pipeline actions of the last step, the MoE expert load per layer, the measured step breakdown beside
the planner's), `fived diagnose`'s findings, and launches.jsonl: where the run started, resumed or
restarted and at which layout (`segments`: marked on every chart).
"""

from __future__ import annotations

from pathlib import Path

from fived.config import ConfigError
from fived.files import read_json, read_json_lines

SERIES = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu")


def read_metrics(run_dir: Path) -> dict[str, list | dict]:
    """Per-step series of metrics.jsonl (and val_loss with its steps, where a record has one; a
    blend's loss per source with its steps)."""
    records = [r for r in read_json_lines(run_dir / "metrics.jsonl") if "step" in r]  # (torn lines: skipped)
    out: dict[str, list | dict] = {"step": [r["step"] for r in records]}
    for key in SERIES:
        out[key] = [r.get(key) for r in records]
    validated = [r for r in records if "val_loss" in r]
    if validated:
        out["val_step"] = [r["step"] for r in validated]
        out["val_loss"] = [r["val_loss"] for r in validated]
    sourced = [r for r in records if isinstance(r.get("loss_by_source"), dict)]
    if sourced:  # (a blend: each source's loss per step, None where a step drew none of its samples)
        out["source_step"] = [r["step"] for r in sourced]
        names = list(dict.fromkeys(name for r in sourced for name in r["loss_by_source"]))
        out["loss_by_source"] = {name: [r["loss_by_source"].get(name) for r in sourced] for name in names}
    return out


def report_data(run_dir: str) -> dict:
    """Everything the report page shows for `run_dir`."""
    path = Path(run_dir)
    if not (path / "metrics.jsonl").is_file():
        raise ConfigError(
            "run_dir", run_dir, "has no metrics.jsonl", "give a `fived train` output directory (train.output_dir)"
        )
    if (path / "run.json").exists() and not (path / "run.json").is_file():
        raise ConfigError("run_dir", run_dir, "its run.json is not a file", "give a `fived train` output directory")
    metrics = read_metrics(path)
    figures = (read_json(path / "run.json") or {}) if (path / "run.json").is_file() else {}
    layout = figures.get("layout", {})
    last = metrics["step"][-1] if metrics["step"] else 0
    parts = segments(path, last)
    said = {"resume": " (resumed)", "restart": " (restarted)"}
    shape = "; ".join(
        f"steps {s['first_step']}-{s['last_step']}{said.get(s['event'], '')}: {s['layout']}" for s in parts
    )
    if not parts:  # (a run directory from before launches.jsonl: run.json's layout)
        shape = "layout " + " ".join(f"{k}={layout[k]}" for k in ("dp", "tp", "pp", "cp", "ep", "zero") if k in layout)
    summary = (
        f"{len(metrics['step'])} steps logged (last {last})"
        + (f"; {shape}" if parts or layout else "")
        + ("" if figures else "; run.json not written yet (the run has not finished): no measured tables")
    )
    diagnosis = None
    if "breakdown" in figures and "config" in figures:  # (fived diagnose's findings, on the page too)
        from fived.tools.diagnose import diagnose, format_diagnosis

        try:
            diagnosis = diagnose(run_dir, warn_torn=False)  # (metrics.jsonl read above: one warning)
            diagnosis["text"] = format_diagnosis(diagnosis)
        except (ConfigError, KeyError, ValueError) as e:  # (a run.json the page can still draw without it)
            diagnosis = None
            summary += f"; no diagnosis ({e})"
    return {
        "summary": summary,
        "metrics": metrics,
        "state": figures.get("state", []),
        "comm": figures.get("comm", []),
        "timeline": figures.get("timeline", []),
        "bubble_line": figures.get("bubble_line", ""),
        "expert_load": figures.get("expert_load", {}),
        "layout": layout,
        "diagnosis": diagnosis,
        "segments": parts,
    }


def segments(run_dir: Path, last_step: int) -> list[dict]:
    """The stretches of steps each launch trained that the metrics still hold, from launches.jsonl:
    where each started (a resume or a restart continues after its checkpoint's step, and later steps of
    earlier launches were superseded), its event and world size, its layout in the planner's words,
    and whether that layout differs from the previous stretch's."""
    path = run_dir / "launches.jsonl"
    records = read_json_lines(path) if path.is_file() else []
    out: list[dict] = []
    for record in records:
        first = checkpoint_step(record.get("resume_from")) + 1
        out = [s for s in out if s["first_step"] < first]
        layout = describe_layout(record)
        out.append(
            {
                "first_step": first,
                "event": record.get("event", "start"),
                "world": record.get("world_size"),
                "layout": layout,
                "changed": bool(out) and out[-1]["layout"] != layout,
            }
        )
    for here, after in zip(out, out[1:] + [None]):
        here["last_step"] = after["first_step"] - 1 if after else last_step
    return [s for s in out if s["first_step"] <= s["last_step"]]


def checkpoint_step(checkpoint: str | None) -> int:
    """The step of a checkpoint directory (…/checkpoints/step-N), 0 for none."""
    name = Path(checkpoint).name if checkpoint else ""
    return int(name[len("step-") :]) if name.startswith("step-") and name[len("step-") :].isdigit() else 0


def describe_layout(record: dict) -> str:
    """A launch's layout as the planner describes layouts (fived.layout.Layout.describe)."""
    from fived.config import config_from_dict
    from fived.layout.layout import Layout

    try:
        return Layout.from_config(config_from_dict(record["config"]), record["world_size"]).describe()
    except (ConfigError, KeyError, TypeError):  # (a record another fived version wrote: its sizes)
        return " ".join(f"{k}{v}" for k, v in record.get("layout", {}).items())
