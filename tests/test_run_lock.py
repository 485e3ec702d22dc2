"""One run per directory: a second `fived train` on a directory in use is refused in one line naming
the holder; the lock goes with the holder however it dies."""

import os
import platform
import signal
import subprocess
import sys

import pytest

from fived.cli.main import main
from fived.config import ConfigError
from fived.launch.run_lock import RunLock

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
HOLD = "import sys, time; from fived.launch.run_lock import RunLock; RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(120)"


@pytest.fixture
def holder(tmp_path):
    """Another process holding the lock on tmp_path/run."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True, env=ENV
    )
    assert proc.stdout.readline().strip() == "held"
    yield proc
    proc.kill()
    proc.wait()


def test_a_second_run_on_a_directory_in_use_is_refused_naming_the_holder(tmp_path, holder, capsys):
    code = main(
        [
            "train",
            "--nproc",
            "1",
            "--steps",
            "2",
            "--train.warmup_steps",
            "1",
            "--train.output_dir",
            str(tmp_path / "run"),
        ]
    )
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


@pytest.mark.parametrize("code", ["ENOSYS", "ENOLCK", "EOPNOTSUPP"])
def test_a_filesystem_without_flock_warns_once_and_runs_unlocked(code, tmp_path, monkeypatch, capsys):
    """Lustre without `flock`, some NFS: flock itself fails. The run goes on, said in one line."""
    import errno
    import fcntl

    def no_flock(fd, op):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with RunLock(tmp_path / "run") as lock:
        assert f"pid {os.getpid()}" in lock.path.read_text()
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "does not support flock" in err and "without the one-run-per-directory lock" in err


def test_under_torchrun_an_unlockable_directory_is_a_line_for_every_rank(tmp_path):
    """Rank 0's lock failing with an OSError (here: output_dir is a file) is returned as one line,
    which the torchrun path broadcasts, instead of an exception on rank 0 that leaves the others waiting."""
    from fived.launch.training_run import lock_on_rank0
    from fived.testing import run_on_ranks

    afile = tmp_path / "afile"
    afile.write_text("")
    (line, none) = run_on_ranks(2, lock_on_rank0, str(afile / "run"))
    assert none is None and "cannot lock the run directory" in line and "\n" not in line
