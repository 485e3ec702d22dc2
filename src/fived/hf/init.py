"""`fived train --init-from SOURCE`: start from a Hugging Face model directory or a fived
checkpoint (weights only; the optimizer starts fresh: fine-tuning).

Before any rank starts, `configure_init_from` takes the model config from the source (and its
tokenizer), refusing flags that contradict it. On each rank, after the model is built and
initialised and its optimizer built, `load_initial_weights` fills what the rank holds, as a resume
does (in bf16 runs the float32 masters, so every layout starts from the same values): from a
Hugging Face directory each box of its placement (tp/ep slice, ZeRO-3 rows, ZeRO-1/2 flat range,
padding left out) is read with safetensors slices, so no rank reads more than its share of a
tensor; from a fived checkpoint DCP reads the model's entries by the same placements.
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from pathlib import Path

import torch

from fived.config import ConfigError, ModelConfig
from fived.hf.config_map import model_config_from_hf, read_config
from fived.hf.names import deinterleaved_rows, has_hf_source, hf_source
from fived.hf.reader import HfCheckpoint

# Model fields that do not change what the imported weights compute: a run may still set them.
TRAINING_ONLY = {"init_std", "aux_loss_coef", "router_bias_rate", "capacity_factor"}


def is_hf_directory(path: str | Path) -> bool:
    return (Path(path) / "config.json").is_file()


def source_model(source: str) -> tuple[ModelConfig, str | None]:
    """(model config, tokenizer path or None) of an --init-from source; ConfigError if unusable."""
    from fived.checkpoint.checkpointer import find_checkpoint, saved_config

    if is_hf_directory(source):
        model = model_config_from_hf(read_config(source), source)
        tokenizer = Path(source) / "tokenizer.json"
        return model, str(tokenizer) if tokenizer.is_file() else None
    checkpoint = find_checkpoint(source, "train.init_from") if Path(source).is_dir() else None
    if checkpoint is None:
        raise ConfigError(
            "--init-from",
            source,
            "is neither a Hugging Face model directory (config.json) nor a "
            "fived run or checkpoint (checkpoints/step-<N>/COMPLETE)",
            "give one of those",
        )
    saved = saved_config(checkpoint, "--init-from")[1]
    return saved.model, saved.data.tokenizer


def configure_init_from(cfg, given: dict) -> None:
    """cfg.model (and data.tokenizer) from cfg.train.init_from; given flags that contradict it are refused."""
    source = cfg.train.init_from
    model, tokenizer = source_model(source)
    for key, value in given.items():
        section, _, name = key.partition(".")
        if section != "model" or name in TRAINING_ONLY:
            continue
        field = "model.name" if name == "name" else key
        mine = getattr(model, name, None)
        if name == "name" or getattr(cfg.model, name) != mine:
            raise ConfigError(
                field, value, f"the model comes from --init-from {source} ({name}={mine})", "drop the flag"
            )
    cfg.model = replace(model, **{name: getattr(cfg.model, name) for name in TRAINING_ONLY})
    if is_hf_directory(source):
        check_hf_names(source, model, read_config(source)["model_type"])
    else:
        from fived.checkpoint.checkpointer import check_model_shapes, find_checkpoint

        checkpoint = find_checkpoint(source)
        assert checkpoint is not None  # (is_hf_directory or a fived run/checkpoint: checked by its caller)
        check_model_shapes(cfg, checkpoint)
    if tokenizer:
        if "data.tokenizer" in given and given["data.tokenizer"] != tokenizer:
            raise ConfigError(
                "data.tokenizer",
                given["data.tokenizer"],
                f"the tokenizer comes from --init-from {source} ({tokenizer})",
                "drop the flag",
            )
        cfg.data.tokenizer = tokenizer


@torch.no_grad()
def fill_from_hf(directory: str | Path, kind: str, values: dict) -> None:
    """values: canonical name -> this rank's boxes of it (a `dcp_io.ShardedValue`: tp/ep slices,
    ZeRO-3 rows, ZeRO-1/2 flat ranges, padding left out); each box is read from the files."""
    checkpoint = HfCheckpoint(directory)
    hf = read_config(directory)
    interleaved = kind == "deepseek_v3" and hf.get("rope_interleave", True)
    n_layers = hf["num_hidden_layers"]
    cfg = model_config_from_hf(hf, str(directory)) if interleaved else None
    for name, value in values.items():
        source = hf_source(name, kind, n_layers)
        if cfg is not None:
            source = dataclasses.replace(source, rows=deinterleaved_rows(name, cfg))
        for box, view in value.boxes:
            if view.numel():
                view.copy_(checkpoint.read_box(source, box.offsets, box.sizes))


def check_hf_names(directory: str | Path, cfg: ModelConfig, kind: str, field: str = "--init-from") -> None:
    """Every tensor the model needs is in the files with its shape, and nothing else is (one line)."""
    from fived.model.transformer import build_model, canonical_name

    checkpoint = HfCheckpoint(directory, field=field)
    checkpoint.check_has_weights()
    expected = {}
    model = build_model(cfg)
    for raw, param in [
        *model.named_parameters(),
        *((n, b) for n, b in model.named_buffers() if has_hf_source(canonical_name(n), kind, cfg.n_layers)),
    ]:
        source = hf_source(canonical_name(raw), kind, cfg.n_layers)
        if source.name and source.columns is not None:  # (GPT-OSS's gate and up, interleaved)
            expected[source.name] = (*param.shape[:-1], param.shape[-1] * source.columns[1])
        elif source.name:
            expected[source.name] = tuple(param.shape)
        else:
            for hf in source.expert_names(cfg.n_experts):
                expected[hf] = tuple(param.shape[2:0:-1])
    have = checkpoint.names()
    for name, shape in expected.items():
        if name not in have or checkpoint.shape(name) != shape:
            found = "missing" if name not in have else f"of shape {list(checkpoint.shape(name))}"
            raise ConfigError(
                field,
                str(directory),
                f"tensor {name} is {found}; config.json implies {list(shape)}",
                "give a complete model directory",
            )
    # DeepSeek-V3's multi-token-prediction layers follow the model's (transformers skips them too)
    mtp = {
        n
        for n in have
        if kind == "deepseek_v3" and n.startswith("model.layers.") and int(n.split(".")[2]) >= cfg.n_layers
    }
    extra = sorted(have - set(expected) - mtp - ({"lm_head.weight"} if cfg.tie_embeddings else set()))
    if extra:
        raise ConfigError(
            field,
            str(directory),
            f"tensor {extra[0]} has no place in fived's model (an architecture difference)",
            "fived imports Llama, Qwen3, Mixtral and Qwen3-MoE",
        )


def load_initial_weights(source: str, values: dict, buffers: set[str]) -> None:
    """Fill `values` (what a resume fills: `ModelState.tensors(for_load=True)`, each parameter's boxes
    this rank holds, in bf16 runs their float32 masters, and the buffers, named in `buffers`) from
    `source`; every rank calls this once the optimizer exists."""
    if is_hf_directory(source):
        hf = read_config(source)
        kind, n_layers = hf["model_type"], hf["num_hidden_layers"]
        # (buffers a checkpoint holds: DeepSeek-V3's routing biases; others start at zero)
        params = {
            name: value for name, value in values.items() if name not in buffers or has_hf_source(name, kind, n_layers)
        }
        fill_from_hf(source, kind, params)
        return
    from fived.checkpoint import dcp_io
    from fived.checkpoint.checkpointer import find_checkpoint

    checkpoint = find_checkpoint(source)
    assert checkpoint is not None  # (configure_init_from found it)
    dcp_io.load({f"model.{name}": value for name, value in values.items()}, checkpoint)


def whole_state(directory: str | Path, cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """Every parameter of the model in `directory`, whole, by fived name (one process: generation, tests)."""
    from fived.checkpoint.dcp_io import ShardedValue
    from fived.layout.placement import Box
    from fived.model.transformer import build_model, canonical_name

    kind = read_config(directory)["model_type"]
    check_hf_names(directory, cfg, kind, field="source")
    out, values = {}, {}
    model = build_model(cfg)
    buffers = [(n, b) for n, b in model.named_buffers() if has_hf_source(canonical_name(n), kind, cfg.n_layers)]
    for raw, param in [*model.named_parameters(), *buffers]:
        name = canonical_name(raw)
        out[name] = torch.empty(param.shape, dtype=dtype)
        values[name] = ShardedValue(
            tuple(param.shape), [(Box((0,) * param.dim(), tuple(param.shape)), out[name])], True, dtype
        )
    fill_from_hf(directory, kind, values)
    return out
