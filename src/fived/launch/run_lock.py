"""One run per directory: `fived train` holds an exclusive lock on `<output_dir>/.fived.lock` for the
run's lifetime, so two runs never interleave their metrics or checkpoints in one directory.

The lock is `fcntl.flock` on an open file: the kernel releases it when the last descriptor closes,
i.e. whenever the process holding it dies, however it dies (SIGKILL included); a lock file left
behind by a dead run locks nothing. Without torchrun the launcher process (`fived train` itself, which
starts the ranks and restarts them) holds it for the whole run. The ranks do not depend on it: forked
(CPU) ranks happen to inherit the descriptor, spawned (CUDA) ranks do not (Python's descriptors are
not inheritable across exec), so if the launcher alone is SIGKILLed, spawned ranks still running
no longer hold the directory. The file records the holder's PID and host, which a refused run names.
Under torchrun global rank 0 holds it; a torchrun restart's new rank 0 takes it again once the old one
is gone.

A filesystem without flock (Lustre mounted without `flock`, some NFS setups: ENOSYS, ENOLCK,
EOPNOTSUPP) cannot lock: the run says so in one warning line and goes on unlocked.
"""

from __future__ import annotations

import errno
import fcntl
import os
import platform
import sys
from pathlib import Path

from fived.config import ConfigError
from fived.files import LOCK as LOCK_NAME
from fived.files import claim_run_dir, open_lock

NO_FLOCK = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP)  # the filesystem cannot lock (not: it is locked)


class RunLock:
    """An exclusive, non-blocking lock on a run directory (a context manager)."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise a one-line ConfigError naming the run that holds it."""
        claim_run_dir(self.run_dir)  # (fived's own, or absent/empty: refused in one line otherwise)
        fd = open_lock(self.run_dir, LOCK_NAME)  # (never through a link)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 256).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise ConfigError(
                "train.output_dir",
                str(self.run_dir),
                f"is in use by a running fived train ({holder}); one run per directory",
                "wait for it to end, or choose another --train.output_dir",
            ) from None
        except OSError as e:
            if e.errno not in NO_FLOCK:
                os.close(fd)
                raise OSError(e.errno, e.strerror, str(self.path)) from None
            print(
                f"fived: warning: {self.path}: the filesystem does not support flock ({e.strerror}); running "
                "without the one-run-per-directory lock",
                file=sys.stderr,
                flush=True,
            )
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
