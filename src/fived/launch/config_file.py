"""A run directory's config.toml: what fived wrote there, and whether the user has edited it since.

fived rewrites config.toml at every launch (the resolved config, so `fived train --config DIR/config.toml`
runs it again). A resumed run takes its settings from the checkpoint and the command line, so a hand
edit to the file would be silently ignored and then overwritten: each launch's record in launches.jsonl
holds the digest of the text it wrote, and a resume into a directory whose config.toml matches none of
them is refused, naming what changed and the flag that would change it."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from fived.config import tomllib
from fived.errors import ConfigError
from fived.files import read_json_lines

DIGEST_KEY = "config_toml_sha256"  # (in each launches.jsonl record: the config.toml that launch wrote)


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def check_config_unedited(run_dir: str | Path) -> None:
    """Refuse (one line) a resume whose run directory's config.toml is not a text fived wrote there.
    A run from before the digests were recorded, or without a config.toml, is not checked."""
    run_dir = Path(run_dir)
    path, launches = run_dir / "config.toml", run_dir / "launches.jsonl"
    if not path.is_file() or path.is_symlink() or not launches.is_file():
        return
    records = [r for r in read_json_lines(launches) if isinstance(r, dict)]
    written = {r[DIGEST_KEY] for r in records if DIGEST_KEY in r}
    text = path.read_text(errors="replace")
    if not written or digest(text) in written:
        return
    changes = _changes(text, records[-1].get("config") or {})
    raise ConfigError(
        "--resume",
        str(path),
        f"was edited since fived wrote it ({changes}); a resumed run takes its settings from the "
        "checkpoint and the command line, and would overwrite this file",
        _way_out(text, records[-1].get("config") or {}),
    )


def _edited_fields(text: str, saved: dict[str, Any]) -> list[tuple[str, Any, Any]] | None:
    """(section.name, fived's value, the file's value) for each field that differs; None: not TOML."""
    try:
        edited = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return None
    out = []
    for section in sorted(set(saved) | set(edited)):
        mine, theirs = saved.get(section), edited.get(section)
        if not isinstance(mine, dict) or not isinstance(theirs, dict):
            if mine != theirs:
                out.append((section, mine, theirs))
            continue
        for name in sorted(set(mine) | set(theirs)):
            if name not in theirs and mine.get(name) is None:
                continue  # (TOML has no null: a field at None is written as a comment)
            if mine.get(name) != theirs.get(name):
                out.append((f"{section}.{name}", mine.get(name, "(absent)"), theirs.get(name, "(absent)")))
    return out


def _changes(text: str, saved: dict[str, Any]) -> str:
    fields = _edited_fields(text, saved)
    if fields is None:
        return "it is no longer valid TOML"
    if not fields:
        return "comments or layout only"
    shown = ", ".join(f"{key} {old!r} -> {new!r}" for key, old, new in fields[:3])
    return shown + (f" and {len(fields) - 3} more" if len(fields) > 3 else "")


def _way_out(text: str, saved: dict[str, Any]) -> str:
    fields = [f for f in (_edited_fields(text, saved) or []) if f[2] != "(absent)"]
    if fields:
        flags = " ".join(f"--{key} {new}" for key, _, new in fields[:3])
        return f"pass the change as flags ({flags}) and remove the file (each launch writes it again)"
    return "remove the file (each launch writes it again; launches.jsonl holds every launch's config)"
