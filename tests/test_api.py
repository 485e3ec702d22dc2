"""The Python API (`from fived import Config, train, verify, plan`): documented keyword-only
signatures, no torch on import, the README's example run as written, the same checks as the CLI."""

import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fived
from fived import Config, ConfigError, TrainingFailed
from fived.testing import run_forked

README = Path(__file__).parents[1] / "README.md"
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src"), "OMP_NUM_THREADS": "1"}


def test_help_shows_a_documented_signature_and_import_needs_no_torch():
    out = subprocess.run(
        [sys.executable, "-c", "import sys, fived; help(fived.train); print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        env={**ENV, "PAGER": "cat"},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "train(config: 'Config | None' = None, *, nproc: 'int | None' = None, resume: 'str | None' = None" in text
    assert "Train `config` (default: the embedded tiny run) as `fived train` does" in text
    assert text.strip().splitlines()[-1] == "False"  # importing fived (and reading its help) imported no torch


def test_every_option_is_keyword_only():
    for function in (fived.train, fived.verify, fived.plan):
        params = list(inspect.signature(function).parameters.values())
        assert params[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, function
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[1:]), function
        assert function.__doc__ and len(function.__doc__.splitlines()) > 3, function
    with pytest.raises(TypeError):
        fived.train(Config(), 2)  # type: ignore[misc]  (a positional option is refused, not guessed)


def test_a_bad_config_raises_the_clis_line_before_any_rank(monkeypatch, tmp_path):
    import fived.launch.ranks

    monkeypatch.setattr(fived.launch.ranks, "run_ranks", lambda *a, **k: pytest.fail("a rank was started"))
    cfg = Config()
    cfg.parallel.tp, cfg.train.output_dir = 3, str(tmp_path / "run")
    with pytest.raises(ConfigError, match=r"^parallel.tp=3: must divide model.n_heads=4; e.g. --tp 2$"):
        fived.train(cfg, nproc=3)
    with pytest.raises(ConfigError, match=r"^model.name=llama9: unknown preset"):
        fived.train(Config(model=fived.config.ModelConfig(name="llama9")))
    with pytest.raises(ConfigError, match=r"^--gpus=0: must be >= 1"):
        fived.plan("llama3-8b", gpus=0, seq_len=8192, global_batch_tokens=2**22)


def test_the_readme_example_runs(tmp_path):
    code = re.search(r"<!-- api example: run by tests/test_api.py -->\n```python\n(.*?)```", README.read_text(), re.S)
    assert code, "the README's API example is missing"
    assert len(code.group(1).strip().splitlines()) <= 12
    # (a forked child of this process, as a new script's own namespace: no second import of torch)
    out = run_forked(_run_as_a_script, code.group(1), tmp_path, timeout_s=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert re.fullmatch(r"loss 5\.\d\d -> \d\.\d\d at [\d,]+ tokens/s", lines[-2]), lines[-2]
    assert re.search(r" s/step: --parallel\.dp \d+ ", lines[-1]), lines[-1]
    run = tmp_path / "runs" / "default"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 46))
    floor = 3e-3 * 0.1  # wsd planned over the first launch's 30 steps: the extension trains at its floor
    assert records[28]["lr"] > floor and [r["lr"] for r in records[30:]] == [pytest.approx(floor, rel=1e-12)] * 15
    resumed = [json.loads(line) for line in (run / "launches.jsonl").read_text().splitlines()][-1]
    assert resumed["event"] == "resume" and resumed["config"]["train"]["decay_steps"] == 30


def _run_as_a_script(code: str, cwd: Path) -> int:
    """`code` as `python -c` runs it from `cwd`: a fresh __main__ namespace (its imports its own)."""
    os.chdir(cwd)
    exec(compile(code, "<README api example>", "exec"), {"__name__": "__main__"})
    return 0


def test_a_diverging_run_raises_with_the_clis_exit_code(tmp_path):
    cfg = Config()
    cfg.train.steps, cfg.train.lr, cfg.train.warmup_steps, cfg.train.grad_clip = 8, 1e4, 1, 0.0
    cfg.train.output_dir = str(tmp_path / "run")
    with pytest.raises(TrainingFailed) as failed:
        fived.train(cfg, nproc=1, progress=False)
    assert failed.value.code == 65 and "diverged" in failed.value.line, failed.value.line
