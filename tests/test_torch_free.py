"""The front needs no torch: importing fived (its API, CLI, every module of the planner and explore's
pricing), `fived plan --help`, a plan
and `fived config` run with torch made unimportable; the runtime's commands import it when they run."""

import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).parents[1] / "src")

FRONT = """
import sys; sys.modules['torch'] = None  # any `import torch` now raises ImportError
import fived, fived.api, fived.cli, fived.cli.main, fived.planner, fived.errors
import importlib, pkgutil
for info in pkgutil.walk_packages(fived.planner.__path__, 'fived.planner.'):  # every planner module, imported
    importlib.import_module(info.name)
import fived.tools.explore  # (`fived explore` prices with the planner alone)
from fived.cli.main import main
try:
    main(['plan', '--help'])
except SystemExit as e:
    assert e.code == 0, e.code
assert main(['plan', '--model', 'llama3-8b', '--gpus', '16', '--seq', '8192', '--global-batch-tokens', '1048576',
             '--top', '1']) == 0
for schedule in ('zbv', 'dualpipev', 'interleaved-1f1b'):  # (priced by fived.layout.schedule_orders)
    assert main(['plan', '--model', 'llama3-8b', '--gpus', '16', '--seq', '8192', '--global-batch-tokens',
                 '1048576', '--layout', f'--pp 4 --dp 4 --pp-schedule {schedule} --microbatches 8']) == 0
assert main(['config', '--tp', '2', '--pp', '2']) == 0
assert main(['config', '--tp', 'x']) == 2  # a bad value: the one-line error, still no torch
try:
    fived.plan('llama3-8b', gpus=0, seq_len=8192, global_batch_tokens=2**20)
except fived.ConfigError as e:
    assert str(e).startswith('--gpus=0: must be >= 1'), e
print('no torch')
"""


def _run(code: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_the_api_cli_and_planner_run_without_torch():
    out = _run(FRONT)
    assert out.returncode == 0 and out.stdout.strip().endswith("no torch"), out.stderr[-3000:]
    assert "tp=x" in out.stderr or "parallel.tp" in out.stderr
    # (the check can fail: a command that needs torch does not run)
    blocked = _run("import sys; sys.modules['torch'] = None\nfrom fived.cli.main import main\nmain(['--version'])")
    assert blocked.returncode != 0 and "torch" in blocked.stderr


def test_plan_loads_no_numpy_either():
    """`fived plan` (its parser and its search) imports neither torch nor numpy (each ~0.1-0.5 s of a
    plan's start: the parser once read prepare-data's formats from the numpy reader of indexed datasets)."""
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['numpy'] = None\n"
        "from fived.cli.main import main\n"
        "assert main(['plan', '--model', 'llama3-8b', '--gpus', '8', '--seq', '4096',"
        " '--global-batch-tokens', '1048576', '--top', '1']) == 0\n"
        "print('no numpy')"
    )
    out = _run(code)
    assert out.returncode == 0 and out.stdout.strip().endswith("no numpy"), out.stderr[-3000:]


def test_the_executable_s_quick_exit_keeps_the_output_and_the_exit_code(capsys):
    """`python -m fived plan` (the executable's `console`) ends without tearing its objects down
    (`os._exit`): what it printed still arrives whole through a pipe (block-buffered: a few KB that
    only the flush before the exit writes), the exit code is the command's (1: nothing fits), an error
    is the one line with its code, output the machine refuses (a full disk) is said and exits 1, a
    closed stdout is no error. A command that is not quick exits as before."""
    import os

    from fived.cli.main import main

    env = {"PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}  # (no PYTHONUNBUFFERED)
    plan = ["plan", "--model", "llama3-8b", "--gpus", "16", "--seq", "8192", "--global-batch-tokens", "1048576"]
    no_fit = ["plan", "--model", "llama3-70b", "--gpus", "8", "--seq", "131072", "--global-batch-tokens", "1048576"]

    def fived(*args: str, **how) -> subprocess.CompletedProcess:
        how.setdefault("stdout", subprocess.PIPE)
        command = [sys.executable, "-m", "fived", *args]
        return subprocess.run(command, stderr=subprocess.PIPE, text=True, env=env, timeout=300, **how)

    for args, code in (([*plan, "--top", "1"], 0), (no_fit, 1)):
        out = fived(*args)
        assert main(args) == code
        assert (out.returncode, out.stdout) == (code, capsys.readouterr().out) and len(out.stdout) > 300, out.stderr
    bad = fived(*plan, "--top", "0")
    assert (bad.returncode, bad.stdout, bad.stderr) == (2, "", "fived: error: --top=0: must be >= 1; e.g. 5\n")
    with open("/dev/full", "w") as full:
        refused = fived(*plan, stdout=full)
    assert (refused.returncode, refused.stderr) == (
        1,
        "fived: error: the standard output: no space left on the device\n",
    )
    closed = fived(*plan, stdout=None, preexec_fn=lambda: os.close(1))
    assert (closed.returncode, closed.stderr) == (0, "")
    config = fived("config", "--tp", "x")
    assert config.returncode == 2 and config.stderr.count("\n") == 1
