"""`fived export RUN_OR_CHECKPOINT --output DIR`: a Hugging Face model directory that
`transformers.AutoModelForCausalLM.from_pretrained` loads as it is.

Writes config.json (Llama, Qwen3, Mixtral, Qwen3-MoE, DeepSeek-V3, GPT-OSS or Gemma 3: whichever computes
what the run's model computes), model.safetensors (or shards of at most `max_shard_bytes` with
model.safetensors.index.json), generation_config.json and the tokenizer (the run's tokenizer.json,
or one that reproduces fived's byte tokenizer). Streams: one whole tensor is read from the
checkpoint (whatever layout wrote it; small ones together, up to the largest one's bytes), converted
and written before the next is read (GPT-OSS's gate and up, interleaved in one tensor: both, once).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from fived.config import ConfigError
from fived.hf.config_map import export_kind, hf_config_from_model
from fived.hf.names import INTERLEAVED_PARTNER, fived_to_hf, has_hf_source, hf_source, mtp_copies
from fived.hf.safetensors_out import StreamingSafetensorsWriter

SHARD_BYTES = 5 * 10**9  # transformers' own default shard size


def _hf_entries(name: str, shape: tuple[int, ...], cfg, kind: str) -> list[tuple[str, tuple[int, ...]]]:
    source = hf_source(name, kind, cfg.n_layers)
    if source.columns is not None:  # (one tensor, written with the gate's: the up's has no entry)
        offset, step = source.columns
        return [] if offset else [(source.name, (*shape[:-1], shape[-1] * step))]
    if source.name:
        return [(hf, shape) for hf in [source.name, *mtp_copies(name, cfg, kind)]]
    return [(hf, (shape[2], shape[1])) for hf in source.expert_names(cfg.n_experts)]


def _checkpoint_names(name: str, cfg, kind: str) -> list[str]:
    """The fived tensors the Hugging Face tensors of `name` are made from (GPT-OSS's gate: with its up)."""
    source = hf_source(name, kind, cfg.n_layers)
    if source.columns is None:
        return [name]
    base, leaf = name.rsplit(".", 1)
    return [name, f"{base}.{INTERLEAVED_PARTNER[leaf]}"]


def _hf_tensors(whole: dict[str, torch.Tensor], name: str, cfg, kind: str) -> list[tuple[str, torch.Tensor]]:
    """The Hugging Face tensors fived tensor `name` becomes, from `whole` (fived name -> whole tensor;
    GPT-OSS's gate with its up partner, interleaved in the columns: gate even, up odd)."""
    source = hf_source(name, kind, cfg.n_layers)
    if source.columns is not None:
        gate, up = (whole[n] for n in _checkpoint_names(name, cfg, kind))
        return [(source.name, torch.stack([gate, up], dim=-1).flatten(-2))]
    return fived_to_hf(name, whole[name], cfg, kind)


def _shards(tensors: list[tuple[str, list, int]], max_bytes: int) -> list[list]:
    """Consecutive fived tensors grouped into files of at most max_bytes (a larger tensor alone)."""
    shards: list[list] = [[]]
    size = 0
    for entry in tensors:
        if shards[-1] and size + entry[2] > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry[2]
    return shards


def export(source: str, output: str, max_shard_bytes: int = SHARD_BYTES) -> Path:
    from fived.checkpoint.checkpointer import find_checkpoint, saved_config

    checkpoint = find_checkpoint(source, "source") if Path(source).is_dir() else None
    if checkpoint is None:
        raise ConfigError(
            "source",
            source,
            "holds no complete fived checkpoint (checkpoints/step-<N>/COMPLETE)",
            "give a run directory or one of its checkpoints",
        )
    from fived.files import new_directory

    cfg = saved_config(checkpoint, "source")[1]
    # Built in a new temporary sibling and renamed at the end (as checkpoints): a failure or a kill
    # leaves no partial output that a retry would then refuse.
    try:
        with new_directory(output, "--output") as tmp:
            _write_model(checkpoint, cfg, tmp, max_shard_bytes)
    except OSError as e:
        raise ConfigError(
            "--output",
            output,
            f"cannot be written ({e.strerror or e}: {e.filename or output})",
            "free some space or choose a writable directory",
        ) from None
    return Path(output)


def _write_model(checkpoint: Path, cfg, out: Path, max_shard_bytes: int) -> None:
    """The safetensors shards (in memory: a group of tensors up to the largest one's bytes), tokenizer
    and configs into `out`."""
    from fived.checkpoint import dcp_io
    from fived.model.transformer import build_model, canonical_name

    kind = export_kind(cfg.model)
    if cfg.model.mtp_depth and kind != "deepseek_v3":
        raise ConfigError(
            "model.mtp_depth",
            cfg.model.mtp_depth,
            f"a {kind} checkpoint has no multi-token prediction layers (DeepSeek-V3's do)",
            "export a run trained with --model.mtp_depth 0",
        )
    dtype = torch.float64 if cfg.train.dtype == "float64" else torch.float32  # (bf16 checkpoints hold float32 masters)
    tensors = []
    model = build_model(cfg.model)
    # (buffers a Hugging Face checkpoint holds too: DeepSeek-V3's routing biases)
    held = [
        *model.named_parameters(),
        *((n, b) for n, b in model.named_buffers() if has_hf_source(canonical_name(n), kind, cfg.model.n_layers)),
    ]
    for raw, param in held:
        name = canonical_name(raw)
        entries = _hf_entries(name, tuple(param.shape), cfg.model, kind)
        if entries:
            tensors.append((name, entries, sum(math.prod(shape) for _, shape in entries) * dtype.itemsize))
    shards = _shards(tensors, max_shard_bytes)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        writer = StreamingSafetensorsWriter(
            out / file, [(hf, shape, dtype) for _, entries, _ in shard for hf, shape in entries]
        )
        # tensors read together up to the largest one's bytes (one read of the checkpoint's index each)
        for group in _shards(shard, max(size for _, _, size in tensors)):
            names = [n for name, _, _ in group for n in _checkpoint_names(name, cfg.model, kind)]
            read = dcp_io.read_whole(checkpoint, [f"model.{n}" for n in names])
            whole = {n: read.pop(f"model.{n}").to(dtype) for n in names}
            for name, _, _ in group:
                for hf, tensor in _hf_tensors(whole, name, cfg.model, kind):
                    writer.write(hf, tensor)
                    weight_map[hf] = file
            del read, whole
        writer.close()
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(size for _, _, size in tensors)}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    _write_tokenizer(cfg.data.tokenizer, out)
    special = run_special_tokens(cfg)
    config = hf_config_from_model(cfg.model, str(dtype).removeprefix("torch."), special)
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    generation = {"do_sample": False, **special}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=1) + "\n")


def run_special_tokens(cfg) -> dict:
    """bos/eos/pad ids of a run that started from a Hugging Face directory with its tokenizer (the
    byte tokenizer has none)."""
    from fived.hf.config_map import special_token_ids
    from fived.hf.init import is_hf_directory

    source = cfg.train.init_from
    if source and is_hf_directory(source) and Path(cfg.data.tokenizer).parent == Path(source):
        return special_token_ids(source)
    return {}


def _write_tokenizer(tokenizer: str, out: Path) -> None:
    """tokenizer.json (+ tokenizer_config.json) in `out`."""
    target = out / "tokenizer.json"
    if tokenizer == "byte":
        try:
            byte_tokenizer().save(str(target))
        except ImportError:
            import sys

            print(
                "fived export: tokenizer.json not written (the byte tokenizer's needs the tokenizers package: "
                "pip install tokenizers)",
                file=sys.stderr,
            )
            return
    else:
        shutil.copyfile(tokenizer, target)
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}) + "\n")


def byte_to_char() -> dict[int, str]:
    """Each byte as a printable character (the byte-level alphabet: printable Latin-1 bytes stand for
    themselves, the others are moved to code points 256 and up, in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer():
    """A Hugging Face tokenizer whose ids are UTF-8 bytes: fived's byte tokenizer, for other tools."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: b for b, char in byte_to_char().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok
