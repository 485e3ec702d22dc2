"""The one writer: every file fived writes in a run directory (and `fived prepare-data`'s outputs)
goes through here, so that fived never loses a byte it did not write.

- A run directory is fived's when it holds `.fived-run`, the manifest of the files fived created in
  it (one relative path a line). fived claims a directory only if it is absent or empty; a non-empty
  directory without the manifest is someone else's and is refused (`check_run_dir`, before any rank
  starts).
- A file is replaced or appended to only if the manifest names it: fived never writes over a file it
  did not create, even inside its own run directory.
- Nothing is opened through a symbolic link (O_NOFOLLOW on the file, lstat on every directory below
  the run directory): a link inside the run would lead a write out of it.
- Whole files are written to a temporary file, fsynced and renamed into place (`write_file`); logs
  get whole lines only, after a torn last line (a crash, a full disk) is ended (`open_log`).
- A new file outside a run directory (prepare-data's) appears by a hard link, which fails rather than
  replace an existing file (`publish`).

Every refusal is a `Refused`: one line naming the path, the rule and the way out (a ConfigError, so
the command line prints it as one; a rank sends it to the launcher as its summary line).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import sys
from pathlib import Path

from fived.config import ConfigError

MANIFEST = ".fived-run"
LOCK = ".fived.lock"  # (fived.launch.run_lock)
_UNLINK = "remove the link (the run directory holds only fived's files)"
_HEADER = "# fived run directory: the files fived created here, one a line (fived writes only these)\n"


class Refused(ConfigError):
    """fived will not write `path`: `<path>: <rule>; <way out>`."""

    def __init__(self, path: str | os.PathLike, rule: str, hint: str):
        super().__init__(str(path), "", rule, hint)
        self.args = (f"{path}: {rule}; {hint}",)

    def __str__(self) -> str:
        return self.args[0]

    def summary(self) -> dict:  # (a rank's refusal: the launcher's one line, fived.launch.ranks)
        return {"kind": "write_failed", "line": str(self)}


def is_fived_dir(run_dir: str | os.PathLike) -> bool:
    manifest = Path(run_dir) / MANIFEST
    return manifest.is_file() and not manifest.is_symlink()


def check_run_dir(run_dir: str | os.PathLike, field: str = "train.output_dir") -> None:
    """Refuse a directory fived may not write: not a directory, or non-empty and not made by fived."""
    path = Path(run_dir)
    if str(run_dir) == "":
        raise ConfigError(field, '""', "names no directory", "e.g. --train.output_dir runs/default")
    if path.exists() and not path.is_dir():
        raise ConfigError(field, str(run_dir), "is a file, not a directory", "choose a new directory")
    links = [p for p in path.iterdir() if p.is_symlink()] if is_fived_dir(path) else []
    if links:
        raise Refused(links[0], "is a symbolic link inside the run directory; fived never writes through one", _UNLINK)
    folders = [path / name for name in _OLDER_RUN_FILES if (path / name).is_dir()] if is_fived_dir(path) else []
    if folders:  # (a rank would fail on it in a traceback)
        raise Refused(folders[0], "is a directory where fived keeps one of its files", "move it away")
    others = sorted(p.name for p in path.iterdir() if not p.name.startswith(".fived")) if path.is_dir() else []
    if others and not is_fived_dir(path) and not _older_run(path):  # (.fived*: a lock, or another rank's probe)
        example = others[0]
        raise ConfigError(
            field,
            str(run_dir),
            f"holds files fived did not write (e.g. {example}); fived writes only into a directory it made",
            "choose a new or empty directory",
        )


def claim_run_dir(run_dir: str | os.PathLike, field: str = "train.output_dir") -> Path:
    """Make `run_dir` fived's (create it, or adopt it empty) or refuse it in one line."""
    check_run_dir(run_dir, field)
    path = Path(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    adopted = [p.name for p in path.iterdir() if p.name in _OLDER_RUN_FILES] if _older_run(path) else []
    with contextlib.suppress(FileExistsError):  # (already fived's)
        fd = os.open(path / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(_HEADER + "".join(f"{name}\n" for name in sorted(adopted)))
    return path


# The files an older fived (before the manifest) wrote in a run directory, which it adopts: a directory
# with launches.jsonl and checkpoints/ and no manifest is such a run (its own names; nothing else).
_OLDER_RUN_FILES = (
    LOCK,
    "config.toml",
    "launches.jsonl",
    "metrics.jsonl",
    "metrics.superseded.jsonl",
    "rollbacks.jsonl",
    "run.json",
)


def _older_run(path: Path) -> bool:
    return (
        not (path / MANIFEST).exists()
        and (path / "launches.jsonl").is_file()
        and (path / "checkpoints").is_dir()
        and not any(p.is_symlink() for p in path.iterdir())
    )


def _owned(run_dir: Path) -> set[str]:
    try:
        return set((run_dir / MANIFEST).read_text().splitlines()[1:])
    except FileNotFoundError:
        return set()


def _record(run_dir: Path, name: str) -> None:
    """Add `name` to the manifest (made here if missing: a run directory of the Python API)."""
    if name in _owned(run_dir):
        return
    fd = os.open(run_dir / MANIFEST, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "a") as f:
        f.write(("" if f.tell() else _HEADER) + name + "\n")  # (one write: whole lines from every rank)


def target(run_dir: str | os.PathLike, name: str) -> Path:
    """`run_dir/name`, checked: no link on the way, and not a file fived did not create."""
    root, path = Path(run_dir), Path(run_dir) / name
    for part in [*reversed(path.relative_to(root).parents[:-1]), Path(name)]:
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISLNK(os.lstat(root / part).st_mode):
                raise Refused(
                    root / part,
                    "is a symbolic link inside the run directory; fived never writes through one",
                    _UNLINK,
                )
    if os.path.lexists(path) and name not in _owned(root):
        raise Refused(path, "exists and fived did not write it", "move it away, or choose another directory")
    return path


def write_file(run_dir: str | os.PathLike, name: str, data: str | bytes) -> Path:
    """Write `run_dir/name` whole: a temporary file, fsynced, renamed over it (a crash leaves the old
    file or the new, never a mix)."""
    path = target(run_dir, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    payload = data.encode() if isinstance(data, str) else data
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        return install(run_dir, name, tmp)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def install(run_dir: str | os.PathLike, name: str, tmp: str | os.PathLike) -> Path:
    """Move the finished file `tmp` (fived's, in the run directory) to `run_dir/name`, fsynced first."""
    path = target(run_dir, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    _record(Path(run_dir), name)
    os.replace(tmp, path)
    return path


def open_log(run_dir: str | os.PathLike, name: str):
    """`run_dir/name` open to append whole lines (a text file); a torn last line is ended first, so
    the next record starts on a line of its own (readers skip the torn one)."""
    path = target(run_dir, name)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        _record(Path(run_dir), name)
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            os.write(fd, b"\n")
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "a")


def append_line(run_dir: str | os.PathLike, name: str, line: str) -> None:
    with open_log(run_dir, name) as f:
        f.write(line.rstrip("\n") + "\n")


def own_directory(run_dir: str | os.PathLike, name: str) -> Path:
    """`run_dir/name`, a directory fived's own (made and recorded here; never a link or a user's) for a
    writer that names its own new files in it (TensorBoard's event files)."""
    path = target(run_dir, name)
    path.mkdir(parents=True, exist_ok=True)
    _record(Path(run_dir), name)
    return path


def open_lock(run_dir: str | os.PathLike, name: str) -> int:
    """A descriptor of the lock file `run_dir/name` (created if absent; never through a link)."""
    path = target(run_dir, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    _record(Path(run_dir), name)
    return fd


def publish(tmp: str | os.PathLike, final: str | os.PathLike, hint: str = "name a new output") -> None:
    """Move the finished temporary file `tmp` to `final`, which must not exist (a hard link fails
    rather than replace; where links are not supported, checked just before a rename)."""
    fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)  # (the bytes on disk before the name: a crash never leaves a named, empty file)
    finally:
        os.close(fd)
    try:
        os.link(tmp, final, follow_symlinks=False)
    except FileExistsError:
        raise Refused(final, "exists; fived does not write over a file it did not create", hint) from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        if os.path.lexists(final):
            raise Refused(final, "exists; fived does not write over a file it did not create", hint) from None
        os.rename(tmp, final)
        return
    os.unlink(tmp)


def read_json_lines(path: str | os.PathLike, *, warn: bool = True) -> list[dict]:
    """The records of a JSON-lines file fived wrote; a torn line (a crash, a full disk) is skipped,
    with one warning for the file (`warn=False`: a second reader of a file already read and warned of)."""
    records, torn = [], []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except ValueError:
                torn.append(number)
                continue
            if isinstance(record, dict):
                records.append(record)
            else:
                torn.append(number)
    if torn and warn:
        lines = ", ".join(map(str, torn[:3])) + (" ..." if len(torn) > 3 else "")
        print(f"fived: warning: {path}: line {lines} is torn (not a JSON record); skipped", file=sys.stderr)
    return records


def read_json(path: str | os.PathLike) -> dict | None:
    """A JSON file fived wrote whole (run.json); a torn one (a crash mid-write of an older fived)
    is None, with one warning."""
    try:
        value = json.loads(Path(path).read_bytes())
    except ValueError:
        print(f"fived: warning: {path}: torn (not JSON); ignored", file=sys.stderr)
        return None
    return value if isinstance(value, dict) else None


# Files at a path the user names (a trace, a page, a profile, an export): not in a run directory, so
# no manifest; fived recognises its own by a mark in the file (`ours`) and replaces only those.


def check_output(path: str | os.PathLike, field: str, ours) -> Path:
    """`path` if fived may write there: not a link, and absent or a regular file `ours(path)` says
    fived wrote (`ours` None: absent only, an earlier output is kept); else one line (before any work
    is done)."""
    out = Path(path)
    if str(path) == "":
        raise ConfigError(field, '""', "names no file", "give a file's path")
    if out.is_symlink():
        raise Refused(out, f"({field}) is a symbolic link; fived never writes through one", "name a new file")
    if out.exists() and ours is None:
        raise Refused(out, f"({field}) exists; fived never writes over an earlier output", "name a new file")
    if out.exists() and not (out.is_file() and _readable_mark(out, ours)):
        raise Refused(
            out,
            f"({field}) exists and fived did not write it; fived does not write over a file it did not create",
            "name a new file, or move that one away",
        )
    return out


def _readable_mark(path: Path, ours) -> bool:
    try:
        return bool(ours(path))
    except (OSError, ValueError):
        return False


def starts_with(mark: bytes):
    """An `ours` test: the file's first bytes hold `mark`."""

    def ours(path: Path) -> bool:
        with open(path, "rb") as f:
            return mark in f.read(len(mark) + 4096)

    return ours


def write_output(path: str | os.PathLike, data: str | bytes, field: str, ours) -> Path:
    """Write the file `path` (the user named it) whole: a new temporary file beside it, fsynced, then
    put in place (check_output's rules: a new path by a hard link, which fails rather than replace a
    file made meanwhile; an existing one only if fived wrote it)."""
    out = check_output(path, field, ours)  # (again: it may have changed during the work)
    out.parent.mkdir(parents=True, exist_ok=True)
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")  # (a new name: never a stale one)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # (mkstemp's 0600 would hide the output from the other users)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        if os.path.lexists(out):
            os.replace(tmp, check_output(out, field, ours))  # (fived's own file: replaced in one step)
        else:
            publish(tmp, out, "name a new file, or move that one away")
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return out


@contextlib.contextmanager
def new_directory(path: str | os.PathLike, field: str):
    """A new directory at `path` (absent, or empty and not a link), built inside the block in a new
    temporary sibling (yielded) and renamed into place when the block ends without an error; on an
    error, or a kill, nothing is left at `path`."""
    import shutil
    import tempfile

    out = Path(path)
    if str(path) == "":
        raise ConfigError(field, '""', "names no directory", "e.g. --output exported")
    if out.is_symlink():
        raise Refused(out, f"({field}) is a symbolic link; fived never writes through one", "name a new directory")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "is a file" if not out.is_dir() else "exists and is not empty"
        raise ConfigError(field, str(path), f"{what}; fived does not overwrite", "name a new directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))  # (new: never someone's)
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())
        os.replace(tmp, out)  # (fails over a non-empty directory or a file made meanwhile: never replaces one)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask
