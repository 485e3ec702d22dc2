"""train.tracker: W&B (offline) and MLflow (file store) runs read back with each library's own tools:
every step's loss, the config and layout, the summary, and one tracked run across a resume."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import fived
from fived import ConfigError
from fived.files import LOCK, MANIFEST
from fived.testing import tiny_config
from fived.training.tracker import BACKENDS, RUN_ID_FILE, Tracker, flat_numbers, open_tracker


def _config(run_dir: Path, tracker: str):
    cfg = tiny_config(**{"train.steps": 2, "train.tracker": tracker, "train.breakdown": False})
    cfg.train.output_dir = str(run_dir)
    return cfg


def _train_and_resume(run_dir: Path, tracker: str) -> list[dict]:
    """2 steps, then a resume to 4 (in-process launches, one rank); metrics.jsonl's records."""
    cfg = _config(run_dir, tracker)
    fived.train(cfg, nproc=1, progress=False)
    cfg.train.steps = 4
    fived.train(cfg, nproc=1, resume=str(run_dir), progress=False)
    fiveds = {MANIFEST, LOCK, "checkpoints", *(run_dir / MANIFEST).read_text().splitlines()[1:]}
    assert {p.name for p in run_dir.iterdir()} <= fiveds  # (the tracker wrote nothing else there)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_missing_package_is_one_line_naming_the_extra_before_any_rank(monkeypatch, tmp_path):
    import fived.launch.ranks

    monkeypatch.setattr(fived.launch.ranks, "run_ranks", lambda *a, **k: pytest.fail("a rank was started"))
    monkeypatch.setitem(sys.modules, "wandb", None)  # (importlib finds no such module)
    with pytest.raises(ConfigError) as refused:
        fived.train(_config(tmp_path / "run", "wandb"), nproc=1)
    assert str(refused.value) == (
        "train.tracker=wandb: needs the wandb package, which is not installed; pip install 'fived[wandb]'"
    )


def test_a_tracker_error_is_one_warning_and_never_raises(capsys, monkeypatch, tmp_path):
    class Broken:
        def log(self, step, metrics):
            raise RuntimeError("server gone\nmore")

    tracker = Tracker("wandb", Broken())
    for step in (1, 2):
        tracker.log({"step": step, "loss": 1.0})
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "fived: warning: train.tracker=wandb: logging metrics failed (RuntimeError: server gone); training goes on"
    ]

    # a tracker that cannot start (not logged in, no server): a warning, no tracked run, no tracker.json
    def no_server(run_id, config):
        raise ConnectionError("tracking server unreachable")

    monkeypatch.setitem(BACKENDS, "mlflow", no_server)
    (tmp_path / "run").mkdir()
    assert open_tracker(_config(tmp_path / "run", "mlflow"), 1).backend is None
    assert "starting the tracked run failed" in capsys.readouterr().err
    assert not (tmp_path / "run" / RUN_ID_FILE).exists()


def test_records_are_tracked_by_their_numbers_whatever_their_keys():
    record = {"step": 3, "loss": 2.5, "note": "x", "flag": True, "loss_by_source": {"/data/web.bin": 2.0, "a?b": 1}}
    assert flat_numbers(record) == {"loss": 2.5, "loss_by_source/data/web.bin": 2.0, "loss_by_source/a_b": 1.0}


def test_mlflow_file_store_holds_every_step_the_config_and_one_run_across_a_resume(monkeypatch, tmp_path):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # (MLflow 3 asks file stores to opt in)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "fived-test")
    records = _train_and_resume(tmp_path / "run", "mlflow")
    run_id = json.loads((tmp_path / "run" / RUN_ID_FILE).read_text())["run_id"]
    client = MlflowClient()
    experiment = client.get_experiment_by_name("fived-test")  # (the library's own setting, honoured)
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss"))
    assert history == [(r["step"], r["loss"]) for r in records] and len(history) == 4
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    params, tags = run.data.params, run.data.tags
    assert params["train.lr"] == str(_config(tmp_path, "mlflow").train.lr)
    assert params["train.steps"] == "2" and tags["resumed.train.steps"] == "4"  # (params never change)
    assert params["layout.dp"] == "1" and params["model.name"] == "tiny"
    assert run.data.metrics["summary/loss_last"] == records[-1]["loss"]


def test_wandb_offline_run_holds_every_step_the_config_and_one_run_across_a_resume(monkeypatch, tmp_path):
    import wandb  # noqa: F401  (imported once here, not again by the forked rank and the launcher)

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    records = _train_and_resume(tmp_path / "run", "wandb")
    run_id = json.loads((tmp_path / "run" / RUN_ID_FILE).read_text())["run_id"]
    logs = sorted((tmp_path / "wandb").glob("offline-run-*/*.wandb"))
    assert logs and {log.name for log in logs} == {f"run-{run_id}.wandb"}  # one tracked run, every launch
    logged = [record for records_of_one in _inspect(logs) for record in records_of_one]
    history = sorted((r["history"]["step"]["num"], r["history"]["item"]["loss"]) for r in logged if "history" in r)
    assert history == [(r["step"], r["loss"]) for r in records] and len(history) == 4
    configs = [r["config"]["update"] for r in logged if r["type"] == "config" and "train" in r["config"]["update"]]
    assert sorted(c["train"]["steps"] for c in configs) == [2, 4]  # (the first launch's, the resume's)
    assert configs[-1]["layout"]["dp"] == 1 and configs[-1]["model"]["name"] == "tiny"
    summaries = [r["summary"]["update"] for r in logged if r["type"] == "summary"]
    assert any(s.get("summary/loss_last") == records[-1]["loss"] for s in summaries)


def _inspect(logs: list[Path]) -> list[list[dict]]:
    """The records of offline runs' transaction logs, as W&B's own reader prints them (all at once)."""
    readers = [
        subprocess.Popen(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for log in logs
    ]
    out = []
    for reader in readers:
        stdout, stderr = reader.communicate(timeout=120)
        assert reader.returncode == 0, stderr
        out.append([json.loads(line) for line in stdout.splitlines() if line.startswith("{")])
    return out
