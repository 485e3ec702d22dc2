"""Hugging Face import: tiny random Llama (GQA), Llama 3.1 (rope scaling), Mixtral and Qwen3-MoE
models built with transformers and saved locally give fived the same logits as transformers; under
tp2 x pp2 and ep2 x dp2 the first step's loss after --init-from equals the one-process loss;
architectures fived cannot express are refused in one line."""

import dataclasses
import json

import pytest
import torch
from hf_models import hf_logits, save_hf_model

from fived.cli.main import main
from fived.hf.config_map import model_config_from_hf, read_config
from fived.hf.init import configure_init_from, whole_state
from fived.model.transformer import build_model
from fived.testing import EXACT, run_on_ranks, tiny_config
from fived.training.trainer import run_training

pytest.importorskip("transformers")

KINDS = ["llama", "llama3.1", "mixtral", "qwen3_moe"]
TOLERANCE = {torch.float64: EXACT, torch.float32: 1e-4}  # (of the largest logit: relative)


def fived_model(directory, dtype):
    cfg = model_config_from_hf(read_config(directory), str(directory))
    model = build_model(cfg, "cpu", dtype)
    missing, unexpected = model.load_state_dict(whole_state(directory, cfg, dtype), strict=False)
    assert not unexpected and all(name.endswith("router_bias") for name in missing)  # (buffers start at 0)
    return model.eval(), cfg


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("kind", KINDS)
def test_logits_equal_transformers(kind, dtype, tmp_path):
    reference = save_hf_model(kind, tmp_path, dtype=dtype)
    model, cfg = fived_model(tmp_path, dtype)
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids)
    expected = hf_logits(reference, ids)
    assert expected.abs().max().item() > 1.0  # (logits far from zero: the comparison is not vacuous)
    assert (logits - expected).abs().max().item() <= TOLERANCE[dtype] * expected.abs().max().item()
    if kind == "llama3.1":  # the scaling matters at these positions: without it the logits differ
        cfg = dataclasses.replace(cfg, rope_scaling="none")
        plain = build_model(cfg, "cpu", dtype)
        plain.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert (plain(ids) - expected).abs().max().item() > 1e-3


def _first_loss(world: int, directory, **layout):
    cfg = tiny_config("tiny", train__steps=1, train__init_from=str(directory), **layout)
    configure_init_from(cfg, {})
    return run_on_ranks(world, run_training, cfg, False, False)[0].metrics[0]["loss"], cfg


def _transformers_loss(reference, cfg) -> float:
    """transformers' mean cross-entropy on the batch of fived's first step."""
    from fived.data.loader import GlobalBatchSampler, check_data

    t = cfg.train
    batch = GlobalBatchSampler(check_data(cfg), t.seq_len, t.global_batch, t.seed).global_batch_at(0)
    logits = hf_logits(reference, batch[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()


LAYOUTS = {  # name: (kind, transformers config changes, layout)
    "llama-tp2-pp2": ("llama", {}, dict(parallel__tp=2, parallel__pp=2, parallel__dp=1, train__microbatches=2)),
    "llama3.1-tp2-sp-pp2": (
        "llama3.1",
        {},
        dict(parallel__tp=2, parallel__pp=2, parallel__dp=1, train__microbatches=2, parallel__sp=True),
    ),
    "mixtral-ep2-dp2": ("mixtral", {}, dict(parallel__ep=2, parallel__dp=4)),  # (ep shards dp: 2 x 2)
    "qwen3moe-ep2-dp2-zero3": ("qwen3_moe", {}, dict(parallel__ep=2, parallel__dp=4, parallel__zero=3)),
    "mixtral-tp2-ep2": ("mixtral", {}, dict(parallel__tp=2, parallel__ep=2, parallel__dp=2)),
    "llama-tp4-padded-vocab": (
        "llama",
        {"vocab_size": 258, "num_key_value_heads": 1},
        dict(parallel__tp=4, parallel__dp=1),
    ),
    "llama-tp2-zero2": ("llama", {}, dict(parallel__tp=2, parallel__dp=2, parallel__zero=2)),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_first_step_loss_is_layout_independent(name, tmp_path):
    kind, changes, layout = LAYOUTS[name]
    reference = save_hf_model(kind, tmp_path, dtype=torch.float64, **changes)
    one, cfg = _first_loss(1, tmp_path, parallel__dp=1)
    many, _ = _first_loss(4, tmp_path, **layout)
    assert abs(many - one) <= EXACT * abs(one)
    assert abs(one - _transformers_loss(reference, cfg)) <= EXACT * abs(
        one
    )  # (the imported model's loss, not fived's init)


def test_qwen3_q_k_norm_gradients_sum_over_tp(tmp_path):
    """q/k norms are replicated over tp but each rank's heads give part of their gradient: three
    steps under tp2 equal one process."""
    save_hf_model("qwen3_moe", tmp_path, dtype=torch.float64)
    cfg = tiny_config("tiny", train__steps=3, train__init_from=str(tmp_path), parallel__dp=1)
    configure_init_from(cfg, {})
    one = run_on_ranks(1, run_training, cfg, False, False)[0].metrics
    cfg.parallel.tp = 2
    two = run_on_ranks(2, run_training, cfg, False, False)[0].metrics
    for a, b in zip(one, two):
        assert abs(a["loss"] - b["loss"]) <= EXACT * abs(a["loss"])


def _refusal(capsys, directory, *flags):
    capsys.readouterr()  # (transformers' save progress)
    code = main(["train", "--init-from", str(directory), "--steps", "1", "--nproc", "1", *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "change,named",
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"model_type": "gpt2"}, "model_type"),
        ({"sliding_window": 32, "model_type": "mixtral"}, "sliding_window"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type"),
    ],
)
def test_architectures_fived_cannot_express_are_refused(change, named, tmp_path, capsys):
    save_hf_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert named in _refusal(capsys, tmp_path)


def test_flags_that_contradict_config_json_are_refused(tmp_path, capsys):
    save_hf_model("llama", tmp_path)
    assert "model.dim" in _refusal(capsys, tmp_path, "--model.dim", "128")


def test_init_from_fived_checkpoint_takes_weights_not_optimizer(tmp_path):
    """A fived run as --init-from (at another layout): its weights, a new step count and learning-rate
    schedule (fine-tuning); the first loss is the trained weights' loss on the new run's batch."""
    from fived.checkpoint import dcp_io
    from fived.checkpoint.checkpointer import find_checkpoint
    from fived.data.loader import GlobalBatchSampler, check_data
    from fived.parallel import lm_loss_sum

    cfg = tiny_config("tiny", train__steps=2, train__output_dir=str(tmp_path / "base"))
    base = run_on_ranks(2, run_training, cfg, True, False)[0]
    tuned = tiny_config(
        "tiny", train__steps=1, train__init_from=str(tmp_path / "base"), parallel__tp=2, parallel__dp=1, train__seed=7
    )
    configure_init_from(tuned, {})
    result = run_on_ranks(2, run_training, tuned, False, False)[0].metrics[0]
    assert result["step"] == 1 and result["lr"] == base.metrics[0]["lr"]  # a new run, a new schedule

    checkpoint = find_checkpoint(tmp_path / "base")
    model = build_model(tuned.model, "cpu", torch.float64)
    names = [name for name, _ in model.named_parameters()]
    weights = dcp_io.read_whole(checkpoint, [f"model.{n}" for n in names])
    model.load_state_dict({n: weights[f"model.{n}"] for n in names}, strict=False)
    t = tuned.train
    batch = GlobalBatchSampler(check_data(tuned), t.seq_len, t.global_batch, t.seed).global_batch_at(0)
    with torch.no_grad():
        expected = lm_loss_sum(model(batch[:, :-1]), batch[:, 1:]).item() / batch[:, 1:].numel()
    assert abs(result["loss"] - expected) <= EXACT * expected


def test_bf16_masters_start_from_the_source_on_every_layout(tmp_path):
    """train.dtype=bfloat16 --init-from a float32 source: the float32 masters get the source's values
    exactly (not rounded through the bf16 weights), under ZeRO-1's flat slices as under ZeRO-3's rows."""
    cfg = tiny_config("tiny", train__steps=2, train__dtype="float32", train__output_dir=str(tmp_path / "base"))
    base = run_on_ranks(2, run_training, cfg, True, False, True)[0].state
    assert any(not torch.equal(v, v.bfloat16().float()) for v in base.values())  # (more than bf16 holds)
    for zero in (1, 3):
        tuned = tiny_config(
            "tiny",
            train__steps=1,
            train__init_from=str(tmp_path / "base"),
            train__dtype="bfloat16",
            train__lr=1e-30,
            train__weight_decay=0.0,
            parallel__dp=2,
            parallel__zero=zero,
        )
        configure_init_from(tuned, {})
        state = run_on_ranks(2, run_training, tuned, False, False, True)[0].state  # (lr 1e-30: masters stay)
        for name, value in base.items():
            assert torch.equal(state[name], value), (zero, name)


def test_train_export_generate_never_import_transformers(tmp_path):
    """transformers is a test/bench extra: fived's own commands work without it."""
    import subprocess
    import sys

    save_hf_model("llama", tmp_path / "hf")
    script = f"""
import sys
from fived.cli.main import main
assert main(["train", "--init-from", "{tmp_path / "hf"}", "--steps", "2", "--nproc", "1",
             "--train.output_dir", "{tmp_path / "run"}", "--train.seq_len", "32", "--global-batch", "4"]) == 0
assert main(["export", "{tmp_path / "run"}", "--output", "{tmp_path / "out"}"]) == 0
assert main(["generate", "{tmp_path / "out"}", "--prompt", "hi", "--max-new-tokens", "3"]) == 0
assert "transformers" not in sys.modules, "transformers was imported"
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_directory_tokenizer_becomes_the_runs(tmp_path, capsys):
    from fived.hf.export import byte_tokenizer

    save_hf_model("llama", tmp_path)
    byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
    cfg = tiny_config("tiny", train__init_from=str(tmp_path))
    configure_init_from(cfg, {})
    assert cfg.data.tokenizer == str(tmp_path / "tokenizer.json") and cfg.model.name == "hf-llama"
    assert "data.tokenizer" in _refusal(capsys, tmp_path, "--data.tokenizer", "byte")


def test_a_tensor_fived_has_no_place_for_is_refused(tmp_path, capsys):
    """A bias in the files (whatever config.json says) is an architecture difference, refused by name."""
    from safetensors.torch import load_file, save_file

    save_hf_model("llama", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert "model.layers.0.self_attn.q_proj.bias" in _refusal(capsys, tmp_path)
    del tensors["model.layers.0.self_attn.q_proj.bias"], tensors["model.norm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert "model.norm.weight is missing" in _refusal(capsys, tmp_path)
