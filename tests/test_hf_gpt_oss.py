"""GPT-OSS from transformers: a tiny random GptOssForCausalLM (windows, sinks, biases, YaRN without
truncation, its router and clamped experts) gives fived the same logits and greedy ids (export:
tests/test_hf_export.py's round trip)."""

import pytest
import torch
from hf_models import hf_logits, save_hf_model

from fived.hf.config_map import model_config_from_hf, read_config
from fived.hf.init import check_hf_names, whole_state
from fived.model.transformer import build_model
from fived.testing import EXACT

pytest.importorskip("transformers")
TOLERANCE = {torch.float64: EXACT, torch.float32: 1e-4}  # (of the largest logit: relative)


def _fived(directory, dtype):
    cfg = model_config_from_hf(read_config(directory), str(directory))
    check_hf_names(directory, cfg, "gpt_oss")
    model = build_model(cfg, "cpu", dtype)
    missing, unexpected = model.load_state_dict(whole_state(directory, cfg, dtype), strict=False)
    assert not unexpected and all(name.endswith("router_bias") for name in missing)  # (buffers start at 0)
    return model.eval(), cfg


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_gpt_oss_logits_and_greedy_ids_equal_transformers(dtype, tmp_path):
    reference = save_hf_model("gpt_oss", tmp_path, dtype=dtype)
    model, cfg = _fived(tmp_path, dtype)
    assert (cfg.window_pattern, cfg.sliding_window, cfg.rope_truncate) == ("wg", 8, False)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids)
    expected = hf_logits(reference, ids)
    assert expected.abs().max().item() > 1.0  # (logits far from zero: the comparison is not vacuous)
    assert (logits - expected).abs().max().item() <= TOLERANCE[dtype] * expected.abs().max().item()
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    if dtype == torch.float64:  # the window matters at these lengths: without it the logits differ
        for block in model.blocks():
            block.attention.core.window = 0
        with torch.no_grad():
            assert (model(ids) - expected).abs().max().item() > 1e-3


def test_gpt_oss_generate_equals_transformers(tmp_path):
    """fived's KV-cached greedy ids equal transformers' generate: 12 + 20 positions, so the windowed
    layers' rolling caches of 8 positions wrap four times."""
    from fived.tools.generate import Sampling, generate

    reference = save_hf_model("gpt_oss", tmp_path, dtype=torch.float64)
    model, _ = _fived(tmp_path, torch.float64)
    prompt, new = list(range(3, 15)), 20
    got = generate(model, prompt, Sampling(max_new_tokens=new))
    assert [block.attention.core.keys.shape[1] for block in model.blocks()][:2] == [8, len(prompt) + new]
    ids = torch.tensor([prompt])
    expected = reference.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)[0, len(prompt) :]
    assert got == expected.tolist() and len(set(got)) > 3
