"""Gemma 3 (text): a tiny random transformers Gemma3ForCausalLM (five windowed layers to one global,
their own rotary base, linear rope scaling on the global layer, q/k norms, norms scaling by 1 + weight,
post-norms, the scaled embedding, GeGLU, scores over sqrt(query_pre_attn_scalar), final soft-capping,
the tied head) gives fived the same logits and greedy ids; tiny-gemma3 trains exactly under tp2 + sp,
pp2, cp2 (ring and Ulysses), ZeRO-1 and ZeRO-3 with document masks (`fived verify`)."""

import tempfile
from pathlib import Path

import pytest
import torch
from hf_models import hf_config, hf_logits, save_hf_model

from fived.config import ConfigError
from fived.hf.config_map import model_config_from_hf, read_config
from fived.hf.init import check_hf_names, whole_state
from fived.model.transformer import build_model
from fived.testing import EXACT, tiny_config, write_documents
from fived.tools.verification import run_verify

pytest.importorskip("transformers")
TOLERANCE = {torch.float64: EXACT, torch.float32: 1e-4}  # (of the largest logit: relative)


def _fived(directory, dtype, **changes):
    cfg = model_config_from_hf(read_config(directory), str(directory))
    cfg = type(cfg)(**{**cfg.__dict__, **changes})
    check_hf_names(directory, cfg, "gemma3_text")
    model = build_model(cfg, "cpu", dtype)
    missing, unexpected = model.load_state_dict(whole_state(directory, cfg, dtype), strict=False)
    assert not unexpected and missing == ["output.weight"]  # (tied: the embedding's)
    return model.eval(), cfg


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_gemma3_logits_and_greedy_ids_equal_transformers(dtype, tmp_path):
    reference = save_hf_model("gemma3_text", tmp_path, dtype=dtype)
    model, cfg = _fived(tmp_path, dtype)
    assert (cfg.window_pattern, cfg.rope_scaling, cfg.rope_local_theta) == ("wwwwwg", "linear", 1e4)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids)
    expected = hf_logits(reference, ids)
    assert expected.abs().max().item() > 1.0  # (logits far from zero: the comparison is not vacuous)
    assert (logits - expected).abs().max().item() <= TOLERANCE[dtype] * expected.abs().max().item()
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    if dtype == torch.float64:  # the windows and the windowed layers' own rotary matter at these lengths
        for changes in ({"sliding_window": 0}, {"rope_local_theta": 0.0}):
            other, _ = _fived(tmp_path, dtype, **changes)
            with torch.no_grad():
                assert (other(ids) - expected).abs().max().item() > 1e-3, changes


def test_gemma3_generate_equals_transformers(tmp_path):
    """fived's KV-cached greedy ids equal transformers' generate and the full recompute (the whole
    sequence run again for every new token), past the window of 8: the five windowed layers' rolling
    caches (their own rotary base) hold 8 positions and wrap four times over 12 + 20, the global
    layer's holds all 32."""
    from fived.tools.generate import Sampling, generate

    reference = save_hf_model("gemma3_text", tmp_path, dtype=torch.float64)
    model, cfg = _fived(tmp_path, torch.float64)
    prompt, new = list(range(3, 15)), 20
    got = generate(model, prompt, Sampling(max_new_tokens=new))
    held = [block.attention.core.keys.shape[1] for block in model.blocks()]
    assert held == [cfg.sliding_window] * 5 + [len(prompt) + new]
    ids = torch.tensor([prompt])
    expected = reference.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)[0, len(prompt) :]
    assert got == expected.tolist() and len(set(got)) > 3
    recomputed, _ = _fived(tmp_path, torch.float64)
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            tokens.append(int(recomputed(torch.tensor([tokens]))[0, -1].argmax()))
    assert got == tokens[len(prompt) :]


@pytest.mark.parametrize(
    "change,key",
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"hidden_activation": "gelu"}, "hidden_activation"),
    ],
)
def test_what_fived_does_not_compute_is_refused_in_one_line(change, key):
    values = hf_config("gemma3_text").to_dict()
    values.update(change)
    with pytest.raises(ConfigError) as e:
        model_config_from_hf(values, "gemma")
    assert key in str(e.value) and "\n" not in str(e.value)


LAYOUTS = {  # ZeRO shards over dp x cp: with cp2 and dp 1 it has two shards
    "tp2-sp-ring-zero3": dict(parallel__tp=2, parallel__sp=True, parallel__cp=2, parallel__zero=3),
    # (fived's pipelines do not tie the head to the embedding across stages)
    "pp2-ulysses-zero1": dict(
        parallel__pp=2,
        parallel__cp=2,
        parallel__cp_mode="ulysses",
        parallel__zero=1,
        model__tie_embeddings=False,
        train__microbatches=2,  # (one per stage)
    ),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_tiny_gemma3_with_documents_matches_one_device(name):
    data = write_documents(Path(tempfile.mkdtemp()) / "docs.txt")
    cfg = tiny_config(
        "tiny-gemma3",
        train__steps=2,
        data__document_mask=True,
        data__path=data,
        parallel__dp=1,
        **LAYOUTS[name],
    )
    report = run_verify(cfg, 4, printer=lambda *_: None)
    assert report.ok, report.max_relative_difference
