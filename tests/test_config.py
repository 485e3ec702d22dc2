import pytest

from fived.config import PRESETS, ConfigError, ModelConfig, build_config, model_preset
from fived.model.transformer import count_params


def test_defaults_presets_toml_and_cli_precedence(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('[model]\nname = "tiny-moe"\ndim = 96\n[train]\nsteps = 7\nlr = 0.5\n[parallel]\ndp = 2\n')
    cfg = build_config(toml, {"train.lr": "0.25", "parallel.sp": "true"})
    assert cfg.model.name == "tiny-moe" and cfg.model.n_experts == PRESETS["tiny-moe"]["n_experts"]  # preset
    assert cfg.model.dim == 96  # file beats preset
    assert cfg.train.steps == 7 and cfg.parallel.dp == 2
    assert cfg.train.lr == 0.25 and cfg.parallel.sp is True  # command line beats file, typed
    assert cfg.train.seed == 0  # untouched default


def test_a_files_section_written_as_a_value_is_refused_in_one_line(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("train = 5\n")  # (a table's name used as a key: it once suggested 'train' for 'train')
    with pytest.raises(ConfigError, match=r": train=5: is a section, not a value; write \[train\], then its keys$"):
        build_config(toml)


def test_cli_model_choice_beats_file(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('[model]\nname = "tiny-moe"\n')
    assert build_config(toml, {"model.name": "tiny"}).model.n_experts == 0


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"train.stepz": 3}, "train.stepz"),
        ({"training.steps": 3}, "training.steps"),
        ({"train.steps": "many"}, "train.steps"),
        ({"parallel.sp": "maybe"}, "parallel.sp"),
        ({"model.name": "llama9"}, "model.name"),
    ],
)
def test_bad_fields_are_named(overrides, field):
    with pytest.raises(ConfigError) as e:
        build_config(overrides=overrides)
    assert e.value.field == field
    assert "\n" not in str(e.value)


def test_unknown_field_suggests_the_close_one():
    with pytest.raises(ConfigError, match="did you mean 'steps'"):
        build_config(overrides={"train.stepz": 3})


# Published parameter counts (billions) of the real shapes; built on the meta device, no memory.
@pytest.mark.parametrize(
    "name, billions, tol",
    [
        ("llama3-8b", 8.03, 0.01),
        ("llama3-70b", 70.55, 0.01),
        ("llama3-405b", 405.85, 0.01),
        ("mixtral-8x7b", 46.70, 0.01),
        ("gemma-3-27b", 27.0, 0.01),  # (the language model; the published 27.4B holds its 0.4B vision tower)
    ],
)
def test_real_presets_have_published_sizes(name, billions, tol):
    assert count_params(model_preset(name)) / 1e9 == pytest.approx(billions, rel=tol)


def test_moe_active_parameters():
    cfg = model_preset("mixtral-8x7b")
    assert count_params(cfg, active=True) / 1e9 == pytest.approx(12.9, rel=0.01)
    assert count_params(model_preset("deepseek-v3-like")) > 500e9


def test_head_dim():
    assert ModelConfig(dim=64, n_heads=4).head_dim == 16
