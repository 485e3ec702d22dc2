"""DeepSeek-V3: a random tiny transformers `DeepseekV3ForCausalLM` (latent attention with a query
rank, interleaved rotary weights, YaRN with both mscales, sigmoid group-limited routing with a
routing bias, shared experts, a dense first layer) imported with fived's Hugging Face reader gives
transformers' logits; FP8 block-scaled weights are dequantised at import."""

import json

import pytest
import torch
from hf_models import hf_logits, save_hf_model

from fived.config import model_preset
from fived.hf.config_map import model_config_from_hf, read_config
from fived.hf.init import check_hf_names, whole_state
from fived.model.transformer import build_model, rope_cos_sin
from fived.testing import EXACT, tiny_config

pytest.importorskip("transformers")


def _imported(directory, dtype):
    cfg = model_config_from_hf(read_config(directory), str(directory))
    check_hf_names(directory, cfg, "deepseek_v3")
    model = build_model(cfg, "cpu", dtype)
    missing, unexpected = model.load_state_dict(whole_state(directory, cfg, dtype), strict=True), None
    assert not unexpected and not missing.missing_keys
    return model.eval(), cfg


def test_tiny_preset_is_the_test_model(tmp_path):
    """The preset and the transformers model of these tests are one shape (so parity speaks for it)."""
    save_hf_model("deepseek_v3", tmp_path)
    cfg = model_config_from_hf(read_config(tmp_path), str(tmp_path))
    preset = model_preset("tiny-deepseek-v3")
    differ = {k for k, v in vars(preset).items() if k != "name" and getattr(cfg, k) != v}
    # (transformers builds no multi-token prediction: its config says num_nextn_predict_layers 0)
    assert differ <= {"init_std", "aux_loss_coef", "mtp_depth"}, differ


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_logits_equal_transformers(dtype, tmp_path):
    reference = save_hf_model("deepseek_v3", tmp_path, dtype=dtype)
    model, cfg = _imported(tmp_path, dtype)
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids)
    expected = hf_logits(reference, ids)
    tolerance = EXACT if dtype == torch.float64 else 1e-4
    assert expected.abs().max().item() > 1.0
    assert (logits - expected).abs().max().item() <= tolerance * expected.abs().max().item()
    assert torch.equal(logits[:, -1].argmax(-1), expected[:, -1].argmax(-1))
    assert all(b.abs().max() > 0 for n, b in model.named_buffers() if n.endswith("router_bias"))  # (imported)
    # each feature matters here: without it the logits differ (the comparison can fail)
    for change in (
        {"rope_scaling": "none"},
        {"routed_scaling": 1.0},
        {"n_expert_groups": 1},
        {"rope_mscale_all_dim": 0.0},
    ):
        changed = build_model(type(cfg)(**{**vars(cfg), **change}), "cpu", dtype)
        changed.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert (changed(ids) - expected).abs().max().item() > 1e-3, change


def test_fp8_block_scaled_weights_are_dequantised(tmp_path):
    """A checkpoint written as the released ones are (2-d weights in float8 e4m3, one float32
    `weight_scale_inv` per block; 16 x 16 blocks here so that edge blocks are partial): every box
    fived reads equals weight x its block's scale, and the whole import is the dequantised model."""
    from safetensors.torch import load_file, save_file

    from fived.hf.names import Source
    from fived.hf.reader import HfCheckpoint

    save_hf_model("deepseek_v3", tmp_path)
    tensors, expected = load_file(tmp_path / "model.safetensors"), {}
    block = 16
    for name in [n for n, t in tensors.items() if t.dim() == 2 and "embed" not in n and "lm_head" not in n]:
        w = tensors[name]
        blocks = torch.nn.functional.pad(w, (0, -w.shape[1] % block, 0, -w.shape[0] % block))
        blocks = blocks.unflatten(0, (-1, block)).unflatten(2, (-1, block))  # [R, b, C, b]
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0  # e4m3's largest
        per_element = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[: w.shape[0], : w.shape[1]]
        tensors[name] = (w / per_element).to(torch.float8_e4m3fn)
        tensors[name + "_scale_inv"] = scale
        expected[name] = tensors[name].float() * per_element
    save_file(tensors, tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block]}
    (tmp_path / "config.json").write_text(json.dumps(config))

    checkpoint = HfCheckpoint(tmp_path)
    name = "model.layers.1.self_attn.kv_b_proj.weight"  # [88, 16]: rows end inside a block
    box = checkpoint.read_box(Source(name), (5, 3), (70, 11))
    assert torch.equal(box, expected[name][5:75, 3:14])
    cfg = model_config_from_hf(read_config(tmp_path), str(tmp_path))
    check_hf_names(tmp_path, cfg, "deepseek_v3")  # (scales are no tensors of their own)
    state = whole_state(tmp_path, cfg)
    assert torch.equal(state["layers.1.attention.wo.weight"], expected["model.layers.1.self_attn.o_proj.weight"])
    w1 = expected["model.layers.2.mlp.experts.3.gate_proj.weight"]
    assert torch.equal(state["layers.2.feed_forward.experts.w1"][3], w1.t())


def test_import_train_export_round_trip(tmp_path, caplog):
    """Imported, trained one step at a negligible learning rate on 2 ranks (ep2) and exported: the
    same model to transformers (its logits), and fived's KV-cached greedy ids are transformers'."""
    from test_hf_export import load_exported

    from fived.cli.main import main
    from fived.hf.init import configure_init_from
    from fived.testing import run_on_ranks
    from fived.training.trainer import run_training

    reference = save_hf_model("deepseek_v3", tmp_path / "in", dtype=torch.float32)
    cfg = tiny_config(
        "tiny",
        train__steps=1,
        train__dtype="float32",
        train__lr=1e-9,
        train__init_from=str(tmp_path / "in"),
        train__output_dir=str(tmp_path / "run"),
        parallel__ep=2,
        parallel__dp=2,
    )
    configure_init_from(cfg, {})
    run_on_ranks(2, run_training, cfg, True, False)
    assert main(["export", str(tmp_path / "run"), "--output", str(tmp_path / "out")]) == 0
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["model_type"] == "deepseek_v3" and exported["rope_interleave"] is False
    model = load_exported(tmp_path / "out", caplog)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    assert (hf_logits(model, ids) - hf_logits(reference, ids)).abs().max().item() <= 1e-4


def test_generate_greedy_equals_transformers(tmp_path, capsys):
    """fived's KV-cached greedy decoding of an imported DeepSeek-V3 equals transformers' generate."""
    from test_hf_export import _generate_json

    model = save_hf_model("deepseek_v3", tmp_path)
    got = _generate_json(capsys, tmp_path, "Hello, world", "--max-new-tokens", "12")
    ids = torch.tensor([got["prompt_ids"]])
    expected = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, ids.shape[1] :].tolist()
    assert got["generated_ids"] == expected and len(set(expected)) > 3


def _verify(world, **layout):
    from fived.tools.verification import run_verify

    cfg = tiny_config("tiny-deepseek-v3", train__steps=2, **layout)
    report = run_verify(cfg, world, printer=lambda *_: None)
    assert report.max_relative_difference <= EXACT, report.max_rel


def test_tp_sp_ring_ep_zero1_match_one_device():
    """Heads split by tp (latent down-projections whole, their gradients summed over tp), sequence
    parallel, the ring passing up-projected K/V, experts over ep, ZeRO-1: one device's run."""
    _verify(4, parallel__tp=2, parallel__sp=True, parallel__cp=2, parallel__ep=2, parallel__zero=1)


def test_pp_ulysses_match_one_device():
    """MTP on the last stage (1f1b), its copy of the embedding synced from the first stage and its
    gradient added there; the future tokens cut by Ulysses' chunks."""
    _verify(4, parallel__pp=2, parallel__cp=2, parallel__cp_mode="ulysses", train__microbatches=2)


def test_pp_zbv_mtp_match_one_device():
    """V-shaped: the first and last stages on one rank; the zero-bubble weight pass still reaches the
    MTP embedding's gradient (without it: 8.7e-2 relative)."""
    _verify(2, parallel__pp=2, parallel__pp_schedule="zbv", train__microbatches=2, model__n_layers=4)


def test_mtp_loss_is_the_reference_and_enters_the_gradient():
    """Depth 1 by hand (token t+1's embedding and the main model's normed output h_t -> block -> head
    predicts token t+2; the last position has no target): the loss MTP logs, and the gradient it adds
    to a main-model weight is exactly its weight x that loss's gradient (so it is not zero)."""
    from fived.data.documents import future_tokens

    cfg = model_preset("tiny-deepseek-v3")
    model = build_model(cfg, "cpu", torch.float64).train()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(
                1 + 0.1 * torch.randn(p.shape, generator=gen)
                if "norm" in name
                else 0.1 * torch.randn(p.shape, generator=gen)
            )
    batch = torch.randint(0, cfg.vocab_size, (2, 17), generator=gen)
    inputs, targets, s = batch[:, :-1], batch[:, 1:], batch.shape[1] - 1
    weight = model.layers["0"].attention.wo.weight

    def grad(loss):
        model.zero_grad()
        loss.backward()
        return weight.grad.clone()

    def main_loss(**kw):
        logits = model(inputs, **kw)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")

    model.mtp.loss_scales = [0.25]
    with_mtp = grad(main_loss(mtp_tokens=future_tokens(batch, 1)))
    logged = model.mtp.losses.pop().item()
    without = grad(main_loss())

    seen = {}
    hook = model.norm.register_forward_hook(lambda m, a, out: seen.update(h=out))
    model(inputs)
    hook.remove()
    module, positions = model.mtp["0"], torch.arange(s - 1)
    cos, sin = rope_cos_sin(positions, cfg, torch.float64)
    x = module.eh_proj(
        torch.cat([module.enorm(model.tok_embeddings(inputs[:, 1:])), module.hnorm(seen["h"][:, :-1])], -1)
    )
    logits = model.output(module.norm(module.block(x, cos, sin)))
    reference = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 2:].flatten(), reduction="sum")
    assert abs(logged - reference.item()) <= EXACT * reference.item()
    added = grad(0.25 * reference)
    assert added.abs().max() > 1e-6
    assert (with_mtp - without - added).abs().max() <= EXACT * added.abs().max()


def test_mtp_layers_export_and_import_as_released(tmp_path):
    """A run with MTP exports module k as layer n_layers + k, named as the released checkpoints
    (enorm, hnorm, eh_proj, shared_head with copies of the embedding and head, a decoder layer's
    tensors); importing it gives back every MTP tensor (transformers itself builds no MTP)."""
    from safetensors.torch import load_file

    from fived.checkpoint import dcp_io
    from fived.checkpoint.checkpointer import find_checkpoint
    from fived.cli.main import main
    from fived.testing import run_on_ranks
    from fived.training.trainer import run_training

    cfg = tiny_config(
        "tiny-deepseek-v3", train__steps=1, train__dtype="float32", train__output_dir=str(tmp_path / "run")
    )
    run_on_ranks(1, run_training, cfg, True, False)
    assert main(["export", str(tmp_path / "run"), "--output", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    files = load_file(tmp_path / "out" / "model.safetensors")
    layer = "model.layers.3."
    for leaf in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "self_attn.kv_a_proj_with_mqa", "mlp.gate"):
        assert layer + leaf + ".weight" in files, leaf
    assert torch.equal(files[layer + "embed_tokens.weight"], files["model.embed_tokens.weight"])
    assert torch.equal(files[layer + "shared_head.head.weight"], files["lm_head.weight"])
    import transformers

    _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and all(k.startswith(layer) for k in info["unexpected_keys"]), info

    imported = model_config_from_hf(read_config(tmp_path / "out"), str(tmp_path / "out"))
    assert imported.mtp_depth == 1
    check_hf_names(tmp_path / "out", imported, "deepseek_v3")
    state = whole_state(tmp_path / "out", imported)
    names = [n for n in state if n.startswith("mtp.")]
    saved = dcp_io.read_whole(find_checkpoint(str(tmp_path / "run")), [f"model.{n}" for n in names])
    assert len(names) == 21  # (20 parameters and the routing bias)
    assert all(torch.equal(state[n], saved[f"model.{n}"].float()) for n in names)
