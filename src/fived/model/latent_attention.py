"""Multi-head latent attention (DeepSeek-V2/V3), as the reference computes it.

    q        = wq_b(q_norm(wq_a(x)))  (or wq(x) without a query rank), per head [nope | rope]
    latent, k_rope = wkv_a(x)          (kv_lora_rank features, and one rotary key every head shares)
    k_nope, v = wkv_b(kv_norm(latent)), per head [qk_nope_head_dim | v_head_dim]
    k        = [k_nope | rope(k_rope)] per head, q = [q_nope | rope(q_rope)]
    out      = wo(softmax(q k^T * (nope + rope)^-0.5 * yarn's gain) v)

The down-projections (wq_a, wkv_a) and their norms are whole on every tensor-parallel rank (their
gradients are partial sums over tp: `fived.layout.spec`); wq_b and wkv_b are cut by heads, wo by its
input. Attention itself runs on the up-projected per-head K/V through the same core as grouped-query
attention (so context parallelism's ring passes up-projected K/V, Ulysses splits heads): V is padded
with zeros to the query/key head size (the fused kernels need one head size; zero columns add nothing
to the output and are sliced off), and YaRN's softmax correction and the padding's change of the
default scale are folded into the queries.

Generation caches the normed latent and the rotated rope key (kv_lora_rank + qk_rope_head_dim per token
and layer, as the reference decodes) instead of per-head K/V: a core with `remember_latent` (fived
generate's) stores them and hands back every cached position, which is up-projected again each step.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fived.config import ModelConfig
from fived.model.yarn import softmax_gain

LATENT_NORM_EPS = 1e-6  # the reference's q_a/kv_a norms keep their default epsilon, whatever rms_norm_eps says


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, norm: type[nn.Module], core: nn.Module, rope):
        super().__init__()
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        qk = self.nope + self.rope_dim
        self.width = max(qk, self.v_dim)  # the head size the attention kernels see
        # scores = q.k * qk^-0.5 * gain; the kernels scale by width^-0.5: the rest goes into q
        self.q_gain = softmax_gain(cfg) * math.sqrt(self.width / qk)
        self.apply_rope = rope
        heads = cfg.n_heads
        self.wq: nn.Linear | None = None
        if cfg.q_lora_rank:
            self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_norm = norm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(cfg.q_lora_rank, heads * qk, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, heads * qk, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, self.kv_rank + self.rope_dim, bias=False)
        self.kv_norm = norm(self.kv_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.kv_rank, heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(heads * self.v_dim, cfg.dim, bias=False)
        self.core = core  # (context parallelism and generation swap it)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        documents: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        q_nope, q_rope = q.view(b, s, -1, self.nope + self.rope_dim).split([self.nope, self.rope_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_norm(latent), self.apply_rope(k_rope.view(b, s, 1, self.rope_dim), cos, sin)
        remember = getattr(self.core, "remember_latent", None)
        if remember is not None:  # generation's latent cache: the latent and rope key of every position so far
            latent, k_rope = remember(latent, k_rope)
        t = latent.shape[1]  # key positions (s, or every cached one)
        kv = self.wkv_b(latent).view(b, t, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        heads = kv.shape[2]  # (this tensor-parallel rank's)
        k_rope = k_rope.expand(b, t, heads, self.rope_dim)
        q = torch.cat([q_nope, self.apply_rope(q_rope, cos, sin)], dim=-1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        if self.q_gain != 1.0:
            q = q * self.q_gain
        q, k, v = (_pad(t, self.width) for t in (q, k, v))
        out = self.core(q, k, v, documents, positions)[..., : self.v_dim]
        return self.wo(out.reshape(b, s, -1))


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))
