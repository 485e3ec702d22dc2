"""Writes that the machine refuses (a full disk, a read-only filesystem, a permission, a quota): one
line naming the path and the cause, wherever fived writes (checkpoints, metrics, export,
prepare-data), instead of whatever a library makes of it (DCP reports a full disk as
`enforce fail ... unexpected pos`)."""

from __future__ import annotations

import contextlib
import errno
import os

CAUSES = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only filesystem",
    errno.EACCES: "permission denied",
    errno.EPERM: "not permitted",
    errno.EIO: "input/output error",
}


def os_error_in(error: BaseException | None, depth: int = 0) -> OSError | None:
    """The OSError behind `error`: itself, its cause or context, or one of DCP's per-rank failures."""
    if error is None or depth > 8:
        return None
    if isinstance(error, OSError) and error.errno is not None:
        return error
    for failure in (getattr(error, "failures", None) or {}).values():  # DCP's CheckpointException
        found = os_error_in(failure[0] if isinstance(failure, tuple) else failure, depth + 1)
        if found is not None:
            return found
    return os_error_in(error.__cause__, depth + 1) or os_error_in(error.__context__, depth + 1)


def describe(error: OSError, fallback_path: str | os.PathLike = "") -> str:
    """'<path>: <cause>' for an OSError."""
    cause = CAUSES.get(error.errno, error.strerror or str(error)) if error.errno is not None else str(error)
    return f"{error.filename or fallback_path}: {cause}"


class WriteFailed(RuntimeError):
    """A write the machine refused, on a rank; `summary()` travels to the launcher."""

    def __init__(self, what: str, error: OSError, fallback_path: str | os.PathLike = ""):
        self.what, self.where = what, describe(error, fallback_path)
        super().__init__(f"{what} failed: {self.where}")

    def summary(self) -> dict:
        return {"kind": "write_failed", "line": str(self)}


def refused_write_summary(error: BaseException) -> dict | None:
    """A rank's summary for any failure that is, underneath, a write the machine refused."""
    found = os_error_in(error)
    if found is None or found.errno not in CAUSES:
        return None
    return {"kind": "write_failed", "line": f"a write failed: {describe(found)}"}


@contextlib.contextmanager
def writing(path: str | os.PathLike):
    """Inside: an OSError without a file name (a write to an open file) gets `path` as its name."""
    try:
        yield
    except OSError as e:
        if e.filename:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from None
