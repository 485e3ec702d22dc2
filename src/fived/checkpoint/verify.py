"""Is a complete checkpoint intact? Checked before one is trusted (resume, restarts, export, generate,
--init-from), so a truncated, deleted or altered file sends the run to the newest intact checkpoint
instead of into DCP's tracebacks.

At save, every rank digests (size and CRC-32) the files it wrote itself, DCP's `__<rank>_*.distcp`
(rank 0 also DCP's `.metadata`), right after writing them, and rank 0 records them all in the manifest
(`files`). Each rank reads back only its own bytes: from the page cache when they are still there,
from storage when not (a shard larger than the free memory, or evicted meanwhile). Before a load:
  - the manifest parses, is fived's format, and its `step` is the directory's step number;
  - DCP's `.metadata` reads (through fived's restricted unpickler);
  - every shard file the metadata names exists and is long enough for every piece it locates there;
  - every file recorded at save has its size and CRC-32 (checkpoints from before this check have no
    record: the first three checks still apply).
CRC-32 finds accidental damage (truncation, bit rot, a partial copy), not deliberate forgery.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from pathlib import Path

FORMAT = "fived-checkpoint-v1"
MANIFEST = "fived.json"
MARKER = "COMPLETE"
CHUNK = 8 << 20


def crc32_of(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def file_digests(directory: Path, rank: int | None = None) -> dict[str, dict]:
    """{file name: {"bytes", "crc32"}} of every file DCP wrote into `directory`; with `rank`, only
    those that rank wrote (`__<rank>_*`; rank 0 also the files no rank prefix names: the index)."""
    out = {}
    for p in sorted(directory.iterdir()):
        if not p.is_file() or p.name in (MANIFEST, MARKER):
            continue
        owner = re.match(r"__(\d+)_", p.name)
        if rank is None or (int(owner.group(1)) if owner else 0) == rank:
            out[p.name] = {"bytes": p.stat().st_size, "crc32": crc32_of(p)}
    return out


def _manifest_damage(checkpoint: Path) -> tuple[str | None, dict]:
    try:
        with open(checkpoint / MANIFEST) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        return f"{checkpoint / MANIFEST} is unreadable ({e})", {}
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return f"{checkpoint / MANIFEST} is not a {FORMAT} manifest", {}
    step, name = manifest.get("step"), checkpoint.name[len("step-") :]
    if type(step) is not int or (name.isdigit() and step != int(name)):
        return f"{checkpoint / MANIFEST} gives step {step!r}, not the step number {name}", {}
    return None, manifest


def _shard_damage(checkpoint: Path) -> str | None:
    """Every file DCP's metadata points into exists and is long enough."""
    from fived.checkpoint.dcp_io import CheckpointError, SafeReader

    try:
        metadata = SafeReader(str(checkpoint)).read_metadata()
    except CheckpointError as e:
        return str(e)
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, length in sorted(needed.items()):
        path = checkpoint / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size < length:
            return f"{path} is truncated ({path.stat().st_size} bytes, the index needs {length})"
    return None


def damage(checkpoint: str | Path, crc: bool = True) -> str | None:
    """What is wrong with a complete checkpoint (one phrase naming the file), or None if intact.
    `crc=False`: the manifest, index and sizes only (no file is read whole)."""
    checkpoint = Path(checkpoint)
    problem, manifest = _manifest_damage(checkpoint)
    if problem:
        return problem
    problem = _shard_damage(checkpoint)
    if problem:
        return problem
    for name, want in sorted((manifest.get("files") or {}).items()):
        path = checkpoint / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != want.get("bytes"):
            return f"{path} has {path.stat().st_size} bytes, {want.get('bytes')} were saved"
        got = crc32_of(path) if crc else None
        if got is not None and got != want.get("crc32"):
            return f"{path} has changed since it was saved (CRC-32 {got}, saved {want.get('crc32')})"
    return None


_verdicts: dict[tuple, str | None] = {}


def cached_damage(checkpoint: Path, crc: bool = True) -> str | None:
    """damage(), once per state of a checkpoint's files (names, sizes, times) in this process."""
    try:
        key = (
            str(checkpoint.resolve()),
            crc,
            *sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(checkpoint)),
        )
    except OSError:
        return damage(checkpoint, crc)
    if key not in _verdicts:
        _verdicts[key] = damage(checkpoint, crc)
    return _verdicts[key]
