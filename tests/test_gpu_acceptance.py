"""benchmarks/gpu_acceptance.py where there is no GPU: the default run says so in one line and exits
0; the CPU smoke run (`--device cpu`) goes through every check at tiny sizes and writes both reports.
(CUDA is hidden from both runs, so that on a GPU host this test does not start the GPU run.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_acceptance.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def acceptance(*args, cwd, timeout=300):  # (minutes only on a machine loaded by others)
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=ENV, cwd=cwd, timeout=timeout
    )


def test_without_cuda_one_line_and_exit_0(tmp_path):
    done = acceptance(cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [done.stdout.strip()] and "CUDA is absent" in done.stdout
    assert "nothing was measured" in done.stdout
    assert not list(tmp_path.iterdir())  # no reports: nothing was measured


def test_cpu_smoke_run_writes_the_reports(tmp_path):
    pytest.importorskip("transformers")
    done = acceptance("--device", "cpu", "--out", str(tmp_path / "reports"), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    report = json.loads((tmp_path / "reports" / "gpu_acceptance.json").read_text())
    status = {check["name"]: check["status"] for check in report["checks"]}
    # Every check ran; only the planner's limits (calibrated for CUDA) are skipped on CPU.
    assert len(status) == 14, status
    assert {name for name, s in status.items() if s != "PASS"} == {"planner vs measured (fived eager)"}, status
    assert status["planner vs measured (fived eager)"] == "SKIP"
    speeds = [c for c in report["checks"] if c["name"].startswith("speed:")]
    assert len(speeds) == 4 and all(c["figures"]["tokens_per_s"] > 0 for c in speeds)
    markdown = (tmp_path / "reports" / "gpu_acceptance.md").read_text()
    summary = done.stdout.strip().splitlines()[-1]
    assert summary == report["summary"] and summary in markdown
    assert summary.startswith("gpu_acceptance: ACCEPTED: 13 PASS, 0 FAIL, 1 SKIP")
    fp8 = next(c for c in report["checks"] if c["name"] == "fp8 vs bf16 (torchao)")
    assert "emulated; not a speed figure" in fp8["note"] and not fp8["figures"]["real_fp8"]
    assert "| ring attention blocks vs reference | **PASS** |" in markdown


@pytest.mark.parametrize("theirs", [None, "0"])
def test_importing_fived_keeps_cudas_availability_check_from_poisoning_fork(theirs):
    """CPU ranks fork from the launcher; torch.cuda.is_available() initialised CUDA's driver there (on an
    H200 the forked ranks then failed at their optimizer step) unless NVML answers it. A user's own
    setting stands."""
    env = {k: v for k, v in ENV.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    if theirs is not None:
        env["PYTORCH_NVML_BASED_CUDA_CHECK"] = theirs
    code = "import os, fived; print(os.environ.get('PYTORCH_NVML_BASED_CUDA_CHECK'))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout.strip() == (theirs or "1"), done.stderr


def test_layouts_priced_again_from_recorded_measurements_without_a_gpu(tmp_path):
    """gpu_layouts.py --priced-from: the H200's recorded measurements (benchmarks/results/) priced by
    today's planner, the catalogue's and the stored profile's, one row per trial, the measurements kept."""
    results = SCRIPT.parent / "results" / "h200-2026-11-29"

    def priced(out: Path) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(SCRIPT.parent / "gpu_layouts.py"), "--priced-from", str(results / "gpu_layouts.json")]
            + ["--machine", str(results / "h200-profile.json"), "--out", str(out)],
            capture_output=True,
            text=True,
            env=ENV,
            timeout=300,
        )

    for _ in range(2):  # (the second run replaces the first's reports: its own)
        done = priced(tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
    mine = tmp_path / "user" / "gpu_layouts.md"
    mine.parent.mkdir()
    mine.write_text("my notes")
    refused = priced(mine.parent)
    assert (
        refused.returncode == 2 and "fived did not write it" in refused.stderr and len(refused.stderr.splitlines()) == 1
    )
    assert mine.read_text() == "my notes" and not (mine.parent / "gpu_layouts.json").exists()
    recorded = json.loads((results / "gpu_layouts.json").read_text())["rows"]
    rows = json.loads((tmp_path / "gpu_layouts.json").read_text())["rows"]
    assert [r["measured"] for r in rows] == [r["measured"] for r in recorded] and len(rows) == 5
    for row in rows:
        assert row["catalogue"]["hardware"] == "h200" and row["profile"]["hardware"] == "profile:h200-profile.json"
        assert row["catalogue"]["step_s"] > 0 and row["profile"]["step_s"] > 0
    table = (tmp_path / "gpu_layouts.md").read_text()
    assert all(f"| {r['name']} | {r['measured']['step_s']:.4f} |" in table for r in rows)


def test_only_and_skip_choose_checks_by_name():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from gpu_acceptance import chosen
    finally:
        sys.path.remove(str(SCRIPT.parent))
    name = "speed: fived compiled (llama-1b, seq 4096)"
    assert chosen(name, [], []) and chosen(name, ["compiled"], []) and not chosen(name, [], ["compiled"])
    assert not chosen(name, ["train tiny"], []) and not chosen(name, ["compiled"], ["fived"])
