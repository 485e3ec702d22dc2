"""Every config field is described once (`option` in fived.config), and that description reaches
`fived train --help` (grouped by section, with the allowed values), docs/config.md's field table and the
comments of a run's config.toml. A field added without a description fails here, by name."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fived.config import SECTION_TYPES, Config, ConfigError, build_config, config_fields, config_from_dict, tomllib
from fived.config_docs import TABLE_END, TABLE_PAGE, TABLE_START, commented_toml, markdown_table, with_fresh_table
from fived.layout.layout import CHECKPOINTING, COMPILE_BACKENDS, FP8_RECIPES, PP_SCHEDULES, PRECISION_SPECS

TABLE = Path(__file__).parents[1] / TABLE_PAGE  # (the page with the field table)
FIELDS = config_fields()


def train_help() -> str:
    out = subprocess.run(
        [sys.executable, "-m", "fived", "train", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_every_field_has_a_one_line_description():
    undescribed = [f"{f.section}.{f.key}" for f in FIELDS if not f.doc.strip()]
    assert undescribed == [], f"describe these fields with option(default, '...') in fived/config.py: {undescribed}"
    for f in FIELDS:
        assert "\n" not in f.doc and len(f.doc) <= 110, (f.section, f.key, f.doc)
    assert {f.section for f in FIELDS} == set(SECTION_TYPES) and len(FIELDS) > 80


def test_help_groups_every_field_by_section_with_its_description_and_values():
    text = train_help()
    found = {s: re.search(rf"^\[{s}\] ", text, re.M) for s in SECTION_TYPES}
    assert all(found.values()), found
    headers = [m.start() for m in found.values() if m]
    assert headers == sorted(headers)  # model, parallel, train, data, checkpoint
    for f in FIELDS:
        flag = f"--{f.section}.{f.key}"
        at = text.index(flag + " ")
        section_start = max(h for h in headers if h < at)
        assert text[section_start:].startswith(f"[{f.section}]"), flag
        entry = " ".join(text[at:].split("\n  --", 1)[0].split())  # the flag's lines, re-joined
        assert " ".join(f.doc.split()) in entry, (flag, entry)
        if f.choices is not None:
            assert "{" + ",".join(map(str, f.choices)) + "}" in entry, flag
        assert "(default " in entry, flag
    assert "--train.lr_schedule {cosine,wsd,constant,linear}" in text


def test_the_docs_field_table_is_the_generated_one():
    text = TABLE.read_text()
    block = re.search(re.escape(TABLE_START) + r"\n(.*?)\n" + re.escape(TABLE_END), text, re.S)
    assert block, f"{TABLE_PAGE}'s field table markers are missing"
    assert block.group(1) == markdown_table(), (
        f"stale: run .ci/tidy (or paste `fived config --markdown` into {TABLE_PAGE})"
    )
    assert len(block.group(1).splitlines()) == len(FIELDS) + 2
    assert with_fresh_table(text) == text  # what .ci/tidy writes changes nothing


def test_config_toml_is_commented_and_reads_back():
    cfg = build_config(
        overrides={
            "model.name": "tiny-moe",
            "train.lr_schedule": "wsd",
            "checkpoint.async": "true",
            "train.output_dir": 'runs/"quoted"',
        }
    )
    text = commented_toml(cfg)
    assert config_from_dict(tomllib.loads(text)) == cfg
    lines = {line.split(" = ")[0]: line for line in text.splitlines() if " = " in line}
    assert (
        lines["lr_schedule"].endswith("[cosine, wsd, constant, linear]")
        and "# the learning rate" in lines["lr_schedule"]
    )
    assert lines["async"].startswith("async = true  # save in the background")
    assert config_from_dict(tomllib.loads(commented_toml(Config()))) == Config()


def test_choices_are_literals_that_the_layout_and_the_checks_share():
    by_name = {f"{f.section}.{f.key}": f.choices for f in FIELDS}
    assert (
        by_name["parallel.pp_schedule"] == PP_SCHEDULES and by_name["train.activation_checkpointing"] == CHECKPOINTING
    )
    assert by_name["train.fp8"] == FP8_RECIPES and by_name["train.compile_backend"] == COMPILE_BACKENDS
    assert by_name["train.dtype"] == tuple(PRECISION_SPECS) and by_name["parallel.zero"] == (0, 1, 2, 3)
    with pytest.raises(ConfigError, match=r"train.lr_schedule=cosin: must be one of .*did you mean 'cosine'"):
        build_config(overrides={"train.lr_schedule": "cosin"})


def test_a_choice_set_in_python_is_checked_before_launch():
    from fived.layout.rules import check_config

    cfg = Config()
    cfg.train.lr_schedule = "cosin"  # type: ignore[assignment]  (what a typo in a script does)
    with pytest.raises(
        ConfigError,
        match=r"^train.lr_schedule=cosin: must be one of cosine, wsd, constant, linear; "
        r"e.g. --train.lr_schedule cosine$",
    ):
        check_config(cfg, 2)


def test_the_pages_short_flags_and_presets_are_the_codes():
    """docs/config.md's list of short flags is the parser's (`SHORT_FLAGS`, --sp, --dp-shard) and its
    presets bullet names every preset (`PRESETS`): a flag or a model added without its line fails here."""
    from fived.config import PRESETS
    from fived.launch.run_setup import SHORT_FLAGS

    page = TABLE.read_text()
    listed = re.search(r"common ones have short forms: `([^`]+)`", page, re.DOTALL)
    assert listed and set(listed[1].split()) == set(SHORT_FLAGS) | {"--sp", "--dp-shard"}
    presets = page[page.index("- Presets:") : page.index("- A bad configuration")]
    assert [name for name in PRESETS if f"`{name}`" not in presets] == []
