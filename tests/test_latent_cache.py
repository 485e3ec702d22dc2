"""DeepSeek-V3's latent KV cache: `fived generate` caches the kv latent and the shared rope key per
token and layer (not per-head keys and values), decodes the ids of the uncached forward, and holds
the bytes `fived plan --serve` prices."""

from __future__ import annotations

import torch

from fived.config import model_preset
from fived.model.init import init_weights
from fived.model.transformer import build_model
from fived.planner.serve_model import kv_cache_bytes
from fived.tools.generate import LatentCachedAttentionCore, Sampling, cache_core, generate

PROMPT = [3, 141, 59, 26, 53, 58, 97]
NEW = 8


def _model():
    model = build_model(model_preset("tiny-deepseek-v3"), "cpu", torch.float64)
    init_weights(model, 0)
    return model.eval()


@torch.no_grad()
def _uncached_greedy(model, prompt: list[int], new: int) -> list[int]:
    """Each token from a full forward over every position so far (no cache)."""
    ids = list(prompt)
    for _ in range(new):
        logits = model(torch.tensor([ids]), positions=torch.arange(len(ids)))
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_latent_cache_decodes_the_uncached_ids_in_the_planned_bytes():
    m = model_preset("tiny-deepseek-v3")
    expected = _uncached_greedy(_model(), PROMPT, NEW)
    model = _model()
    got = generate(model, PROMPT, Sampling(max_new_tokens=NEW))
    assert got == expected and len(set(got)) > 2
    caches = [block.attention.core for block in model.layers.values()]
    assert all(isinstance(c, LatentCachedAttentionCore) for c in caches)
    assert caches[0].latent is not None and caches[0].latent.shape[-1] == m.kv_lora_rank
    positions = len(PROMPT) + NEW
    per_token_layer = (m.kv_lora_rank + m.qk_rope_head_dim) * 8  # float64: the latent and the rope key
    assert all(c.nbytes == positions * per_token_layer for c in caches)
    planned = kv_cache_bytes(m, tp=1, layers=range(len(caches)), sequences=1, positions=positions, element_bytes=8)
    assert sum(c.nbytes for c in caches) == planned


@torch.no_grad()
def test_latent_cache_logits_equal_the_uncached_forward():
    """Prompt, then one position at a time through the latent cache: every position's logits are the
    full forward's (float64), so a cache that drops or alters a position fails here."""
    model = _model()
    ids = torch.tensor([PROMPT + [7, 200, 11, 42]])
    n, prompt = ids.shape[1], len(PROMPT)
    full = model(ids, positions=torch.arange(n))
    for block in model.blocks():
        block.attention.core = cache_core(block.attention, n)
    steps = [model(ids[:, :prompt], positions=torch.arange(prompt))]
    steps += [model(ids[:, p : p + 1], positions=torch.tensor([p])) for p in range(prompt, n)]
    assert (torch.cat(steps, dim=1) - full).abs().max().item() <= 1e-10
