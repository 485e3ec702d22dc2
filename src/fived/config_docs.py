"""The config fields described, from one source (each field's `option` description in fived.config
and its annotation's allowed values): the groups of `fived train --help`, the README's field table
(`fived config --markdown`) and the comments of a TOML config (a run directory's config.toml,
`fived config`).
"""

from __future__ import annotations

from typing import Any

from fived.config import PRESETS, SECTION_TYPES, Config, FieldInfo, config_fields

SECTION_DOCS = {
    "model": "the model's shape (a preset, then any field)",
    "parallel": "the layout: how the ranks split the work",
    "train": "the optimizer, its schedule, precision, logging, faults",
    "data": "training and validation tokens",
    "checkpoint": "saves in <output_dir>/checkpoints/step-<N>/",
}


def allowed_values(f: FieldInfo) -> str:
    """What a field accepts, in words: its choices, or its type."""
    if f.choices is not None:
        return ", ".join(str(c) for c in f.choices)
    if (f.section, f.key) == ("model", "name"):
        return "a preset: " + ", ".join(PRESETS)
    return {"bool": "true, false", "int": "an integer", "float": "a number", "str": "a string"}[f.kind]


def shown(value: Any) -> str:
    """A value as it is typed on the command line."""
    if isinstance(value, bool):
        return str(value).lower()
    return '""' if value == "" else str(value)


def help_text(f: FieldInfo) -> str:
    """The flag's line in `fived train --help`."""
    return f"{f.doc} (default {shown(f.default)})".replace("%", "%%")  # (argparse formats help with %)


def metavar(f: FieldInfo) -> str:
    return "{" + ",".join(str(c) for c in f.choices) + "}" if f.choices is not None else f.kind.upper()


def markdown_table() -> str:
    """The README's table of every config field (between its `<!-- fields -->` markers)."""
    lines = ["| field | default | values | description |", "|---|---|---|---|"]
    for f in config_fields():
        cells = (f"`{f.section}.{f.key}`", f"`{shown(f.default)}`", allowed_values(f), f.doc)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def commented_toml(cfg: Config) -> str:
    """`cfg` as a TOML file: every field with its value and, as a comment, its description and
    allowed values (TOML readers ignore the comments: the file reads back to `cfg`)."""
    import tomli_w

    values = cfg.to_dict()
    out: list[str] = []
    for section in SECTION_TYPES:
        out += ([""] if out else []) + [f"[{section}]  # {SECTION_DOCS[section]}"]
        for f in (f for f in config_fields() if f.section == section):
            line = tomli_w.dumps({f.key: values[section][f.key]}).strip()
            note = f.doc if f.choices is None else f"{f.doc} [{allowed_values(f)}]"
            out.append(f"{line}  # {note}")
    return "\n".join(out) + "\n"
