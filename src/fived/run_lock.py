"""One run per directory: `fived train` holds an exclusive lock on `<output_dir>/.fived.lock` for the
run's lifetime, so two runs never interleave their metrics or checkpoints in one directory.

The lock is `fcntl.flock` on an open file: the kernel releases it when the last descriptor closes,
i.e. whenever the process holding it dies, however it dies (SIGKILL included); a lock file left
behind by a dead run locks nothing. Forked ranks inherit the descriptor, so the lock lasts while any
of them lives. The file records the holder's PID and host, which a refused run names. Under torchrun
global rank 0 holds it; a torchrun restart's new rank 0 takes it again once the old one is gone.
"""
from __future__ import annotations

import fcntl
import os
import platform
from pathlib import Path

from fived.config import ConfigError

LOCK_NAME = ".fived.lock"


class RunLock:
    """An exclusive, non-blocking lock on a run directory (a context manager)."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise a one-line ConfigError naming the run that holds it."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 256).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise ConfigError("train.output_dir", str(self.run_dir), f"is in use by a running fived train ({holder}); "
                              "one run per directory", "wait for it to end, or choose another --train.output_dir") from None
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on host {platform.node()}\n".encode())
        except OSError as e:  # (a full disk: said by the command line, naming the file)
            os.close(fd)
            raise OSError(e.errno, e.strerror, str(self.path)) from None
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # (the kernel drops the lock with the last descriptor)
            self.fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
