"""fived's canonical parameter names <-> Hugging Face tensor names.

fived and Hugging Face both rotate halves of each head (rotate_half), so q and k need no row
permutation; nn.Linear weights are [out, in] on both sides. The one change of shape is experts:
fived keeps each layer's experts stacked as [E, dim, hidden] (w1, w3) and [E, hidden, dim] (w2),
which is the transpose of Hugging Face's per-expert [hidden, dim] / [dim, hidden] Linear weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fived.config import ModelConfig

LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# per architecture: (router, expert tensor name template with {e}) for fived's router, w1, w3, w2
MOE = {
    "mixtral": (
        "block_sparse_moe.gate.weight",
        {
            "w1": "block_sparse_moe.experts.{e}.w1.weight",
            "w3": "block_sparse_moe.experts.{e}.w3.weight",
            "w2": "block_sparse_moe.experts.{e}.w2.weight",
        },
    ),
    "qwen3_moe": (
        "mlp.gate.weight",
        {
            "w1": "mlp.experts.{e}.gate_proj.weight",
            "w3": "mlp.experts.{e}.up_proj.weight",
            "w2": "mlp.experts.{e}.down_proj.weight",
        },
    ),
}


@dataclass(frozen=True)
class Source:
    """Where a fived tensor lives in a Hugging Face checkpoint: one tensor of the same shape
    (`name`), or one transposed tensor per expert (`per_expert`, a template with {e})."""

    name: str = ""
    per_expert: str = ""

    def expert_names(self, n_experts: int) -> list[str]:
        return [self.per_expert.format(e=e) for e in range(n_experts)]


def hf_source(name: str, kind: str) -> Source:
    """The Source of fived parameter `name` in a checkpoint of architecture `kind`."""
    if name in TOP:
        return Source(TOP[name])
    _, layer, rest = name.split(".", 2)
    prefix = f"model.layers.{layer}."
    if rest in LAYER:
        return Source(prefix + LAYER[rest])
    router, experts = MOE[kind]
    if rest == "feed_forward.router.weight":
        return Source(prefix + router)
    leaf = rest.rsplit(".", 1)[-1]
    if rest.startswith("feed_forward.experts.") and leaf in experts:
        return Source(per_expert=prefix + experts[leaf])
    raise KeyError(f"fived parameter {name} has no Hugging Face counterpart in {kind}")


def fived_to_hf(name: str, tensor, cfg: ModelConfig, kind: str) -> list[tuple[str, Any]]:
    """One whole fived tensor as the Hugging Face tensors it becomes (contiguous)."""
    source = hf_source(name, kind)
    if source.name:
        return [(source.name, tensor.contiguous())]
    return [(hf, tensor[e].t().contiguous()) for e, hf in enumerate(source.expert_names(cfg.n_experts))]
