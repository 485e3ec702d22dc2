"""One run per directory: a second `fived train` on a directory in use is refused in one line naming
the holder; the lock goes with the holder however it dies."""
import os
import platform
import signal
import subprocess
import sys

import pytest

from fived.cli import main
from fived.config import ConfigError
from fived.run_lock import RunLock

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
HOLD = "import sys, time; from fived.run_lock import RunLock; RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(120)"


@pytest.fixture
def holder(tmp_path):
    """Another process holding the lock on tmp_path/run."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True, env=ENV)
    assert proc.stdout.readline().strip() == "held"
    yield proc
    proc.kill()
    proc.wait()


def test_a_second_run_on_a_directory_in_use_is_refused_naming_the_holder(tmp_path, holder, capsys):
    code = main(["train", "--nproc", "1", "--steps", "2", "--train.warmup_steps", "1", "--train.output_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0, err
    assert f"pid {holder.pid} on host {platform.node()}" in err and "one run per directory" in err
    assert not (tmp_path / "run" / "launches.jsonl").exists()  # nothing of the second run was written


def test_the_lock_goes_with_its_holder_even_on_sigkill(tmp_path, holder):
    with pytest.raises(ConfigError, match="is in use"):
        RunLock(tmp_path / "run").acquire()
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with RunLock(tmp_path / "run") as lock:  # the file is still there; the lock is not
        assert f"pid {os.getpid()}" in lock.path.read_text()
    with RunLock(tmp_path / "run"):  # released on exit
        pass
