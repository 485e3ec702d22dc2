"""Sharded import: a rank that holds a quarter of the model (ZeRO-3 over 4 ranks) never holds the
whole model in memory while `--init-from` loads it: its peak resident memory during the build and
load grows by less than the model's size (it reads only its rows from the safetensors files)."""

import json
from pathlib import Path

import pytest
import torch

from fived.hf.init import configure_init_from
from fived.hf.reader import HfCheckpoint
from fived.testing import run_on_ranks, tiny_config
from fived.training.trainer import Trainer

DIM, FFN, LAYERS, VOCAB = 512, 1536, 4, 256


def write_llama(directory: Path) -> int:
    """A random Llama in safetensors (two files and an index, as large models ship); returns its bytes."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": (VOCAB, DIM), "model.norm.weight": (DIM,), "lm_head.weight": (VOCAB, DIM)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "self_attn.q_proj.weight": (DIM, DIM),
                p + "self_attn.k_proj.weight": (DIM, DIM),
                p + "self_attn.v_proj.weight": (DIM, DIM),
                p + "self_attn.o_proj.weight": (DIM, DIM),
                p + "mlp.gate_proj.weight": (FFN, DIM),
                p + "mlp.up_proj.weight": (FFN, DIM),
                p + "mlp.down_proj.weight": (DIM, FFN),
                p + "input_layernorm.weight": (DIM,),
                p + "post_attention_layernorm.weight": (DIM,),
            }
        )
    names = sorted(tensors)
    weight_map = {}
    for part, chunk in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        file = f"model-{part + 1:05d}-of-00002.safetensors"
        save_file({n: torch.randn(tensors[n], generator=gen) * 0.02 for n in chunk}, str(directory / file))
        weight_map.update(dict.fromkeys(chunk, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = {
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": DIM,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
    }
    (directory / "config.json").write_text(json.dumps(config))
    return sum(torch.Size(s).numel() for s in tensors.values()) * 4


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _peak_growth(cfg) -> int:
    import gc

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current size
    before = _status_kib("VmRSS")
    trainer = Trainer(cfg, log=False)
    grown = (_status_kib("VmHWM") - before) * 1024
    del trainer
    return grown


ELEMENTS_READ = [0]


def counting_read(read):
    def wrapped(self, name, offsets, sizes):
        ELEMENTS_READ[0] += torch.Size(sizes).numel()
        return read(self, name, offsets, sizes)

    return wrapped


def peak_growth_while_loading(cfg) -> tuple[int, int, int]:
    """Bytes by which this rank's peak resident memory grew while a trainer was built: with the
    import, and without (after a first build, so that lazily imported modules are not counted);
    and the bytes it read from the files."""
    import dataclasses

    plain = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_from=""))
    _peak_growth(plain)
    return _peak_growth(cfg), _peak_growth(plain), ELEMENTS_READ[0] * 4


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc peak reset")
def test_a_rank_holding_a_quarter_never_holds_the_whole_model(tmp_path, monkeypatch):
    monkeypatch.setattr(HfCheckpoint, "read", counting_read(HfCheckpoint.read))  # (the forked ranks inherit it)
    size = write_llama(tmp_path)
    cfg = tiny_config(
        "tiny", train__steps=1, train__dtype="float32", train__init_from=str(tmp_path), parallel__dp=4, parallel__zero=3
    )
    configure_init_from(cfg, {})
    growth = run_on_ranks(4, peak_growth_while_loading, cfg)
    print(
        f"model {size / 2**20:.1f} MiB; peak growth per rank (MiB) building with the import / without: "
        + ", ".join(f"{a / 2**20:.1f}/{b / 2**20:.1f}" for a, b, _ in growth)
    )
    assert [read for _, _, read in growth] == [size // 4] * 4  # each rank read exactly its quarter
    assert max(a for a, _, _ in growth) < size  # (measured: 2.5-19 MiB of 53, as much as without the import)
