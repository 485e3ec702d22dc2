"""`fived report RUN_DIR`: the page of a training run, from what the run directory holds —
metrics.jsonl (loss, validation loss where logged, lr, grad norm, tokens/s, MFU per step),
config.toml (the layout), and run.json, which `fived train` writes at the end (`fived.report.
write_run_json`: the same measured-vs-planner tables `fived train --report` prints, the executed
pipeline actions of the last step, the MoE expert load per layer, the measured step breakdown beside
the planner's), and `fived diagnose`'s findings.
"""
from __future__ import annotations

import json
from pathlib import Path

from fived.config import ConfigError

SERIES = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu")


def read_metrics(run_dir: Path) -> dict[str, list]:
    """Per-step series of metrics.jsonl (and val_loss with its steps, where a record has one)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    out: dict[str, list] = {"step": [r["step"] for r in records]}
    for key in SERIES:
        out[key] = [r.get(key) for r in records]
    validated = [r for r in records if "val_loss" in r]
    if validated:
        out["val_step"] = [r["step"] for r in validated]
        out["val_loss"] = [r["val_loss"] for r in validated]
    return out


def report_data(run_dir: str) -> dict:
    """Everything the report page shows for `run_dir`."""
    path = Path(run_dir)
    if not (path / "metrics.jsonl").is_file():
        raise ConfigError("run_dir", run_dir, "has no metrics.jsonl", "give a `fived train` output directory (train.output_dir)")
    metrics = read_metrics(path)
    figures = json.loads((path / "run.json").read_text()) if (path / "run.json").is_file() else {}
    layout = figures.get("layout", {})
    last = metrics["step"][-1] if metrics["step"] else 0
    shape = " ".join(f"{k}={layout[k]}" for k in ("dp", "tp", "pp", "cp", "ep", "zero") if k in layout)
    summary = (f"{len(metrics['step'])} steps logged (last {last})" + (f", layout {shape}" if shape else "")
               + ("" if figures else "; run.json not written yet (the run has not finished): no measured tables"))
    diagnosis = None
    if "breakdown" in figures and "config" in figures:  # (fived diagnose's findings, on the page too)
        from fived.diagnose import diagnose, format_diagnosis

        try:
            diagnosis = diagnose(run_dir)
            diagnosis["text"] = format_diagnosis(diagnosis)
        except (ConfigError, KeyError, ValueError) as e:  # (a run.json the page can still draw without it)
            diagnosis = None
            summary += f"; no diagnosis ({e})"
    return {"summary": summary, "metrics": metrics, "state": figures.get("state", []), "comm": figures.get("comm", []),
            "timeline": figures.get("timeline", []), "bubble_line": figures.get("bubble_line", ""),
            "expert_load": figures.get("expert_load", {}), "layout": layout, "diagnosis": diagnosis}
