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
from fived.model.transformer import build_model
from fived.testing import EXACT

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
    assert differ <= {"init_std", "aux_loss_coef"}, differ


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
    for change in ({"rope_scaling": "none"}, {"routed_scaling": 1.0}, {"n_expert_groups": 1}, {"rope_mscale_all_dim": 0.0}):
        changed = build_model(type(cfg)(**{**vars(cfg), **change}), "cpu", dtype)
        changed.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert (changed(ids) - expected).abs().max().item() > 1e-3, change
