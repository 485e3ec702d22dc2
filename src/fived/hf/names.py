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
# DeepSeek-V3's multi-head latent attention, shared experts and routing bias (its own names first)
DEEPSEEK_LAYER = {
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "feed_forward.shared.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.shared.w2.weight": "mlp.shared_experts.down_proj.weight",
    "feed_forward.router_bias": "mlp.gate.e_score_correction_bias",
}
# DeepSeek-V3's multi-token prediction module k is layer n_layers + k of the released checkpoints:
# a decoder layer's tensors plus these (and copies of the embedding and head, written on export)
MTP = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}
MTP_COPIES = {"tok_embeddings.weight": "embed_tokens.weight", "output.weight": "shared_head.head.weight"}

# GPT-OSS: biases on q/k/v/o, sinks, a router with a bias; the experts stacked as whole tensors,
# gate and up interleaved in the columns of gate_up_proj (GPT_OSS_COLUMNS: (offset, step))
GPT_OSS_LAYER = {
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.wo_bias": "self_attn.o_proj.bias",
    "attention.sinks": "self_attn.sinks",
    "feed_forward.router.weight": "mlp.router.weight",
    "feed_forward.router.bias": "mlp.router.bias",
    "feed_forward.experts.w1": "mlp.experts.gate_up_proj",
    "feed_forward.experts.w3": "mlp.experts.gate_up_proj",
    "feed_forward.experts.w2": "mlp.experts.down_proj",
    "feed_forward.experts.b1": "mlp.experts.gate_up_proj_bias",
    "feed_forward.experts.b3": "mlp.experts.gate_up_proj_bias",
    "feed_forward.experts.b2": "mlp.experts.down_proj_bias",
}
GPT_OSS_COLUMNS = {"w1": (0, 2), "w3": (1, 2), "b1": (0, 2), "b3": (1, 2)}
# export writes each interleaved tensor once, with the gate's: the gate's partner fills the odd columns
INTERLEAVED_PARTNER = {"w1": "w3", "b1": "b3"}
# Gemma 3: four norms a layer (fived's ffn_norm is its pre-feed-forward norm)
GEMMA_LAYER = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffn_norm.weight": "post_feedforward_layernorm.weight",
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
    "deepseek_v3": (
        "mlp.gate.weight",
        {
            "w1": "mlp.experts.{e}.gate_proj.weight",
            "w3": "mlp.experts.{e}.up_proj.weight",
            "w2": "mlp.experts.{e}.down_proj.weight",
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
    # DeepSeek's interleaved rotary features (rope_interleave): fived row r is the file's row rows[r]
    rows: tuple[int, ...] | None = None
    # GPT-OSS's interleaved gate/up: fived's column c of the last dim is the file's offset + step * c
    columns: tuple[int, int] | None = None

    def expert_names(self, n_experts: int) -> list[str]:
        return [self.per_expert.format(e=e) for e in range(n_experts)]


def hf_source(name: str, kind: str, n_layers: int = 0) -> Source:
    """The Source of fived parameter `name` in a checkpoint of architecture `kind` (`n_layers`: the
    main model's, after which DeepSeek-V3's multi-token prediction layers come)."""
    if name in TOP:
        return Source(TOP[name])
    if name.startswith("mtp.") and kind == "deepseek_v3":
        _, k, rest = name.split(".", 2)
        if rest in MTP:
            return Source(f"model.layers.{n_layers + int(k)}.{MTP[rest]}")
        name = f"layers.{n_layers + int(k)}.{rest.removeprefix('block.')}"
    _, layer, rest = name.split(".", 2)
    prefix = f"model.layers.{layer}."
    if kind == "deepseek_v3" and rest in DEEPSEEK_LAYER:
        return Source(prefix + DEEPSEEK_LAYER[rest])
    if kind == "gemma3_text" and rest in GEMMA_LAYER:
        return Source(prefix + GEMMA_LAYER[rest])
    if kind == "gpt_oss" and rest in GPT_OSS_LAYER:
        return Source(prefix + GPT_OSS_LAYER[rest], columns=GPT_OSS_COLUMNS.get(rest.rsplit(".", 1)[-1]))
    if rest in LAYER:
        return Source(prefix + LAYER[rest])
    router, experts = MOE[kind]
    if rest == "feed_forward.router.weight":
        return Source(prefix + router)
    leaf = rest.rsplit(".", 1)[-1]
    if rest.startswith("feed_forward.experts.") and leaf in experts:
        return Source(per_expert=prefix + experts[leaf])
    raise KeyError(f"fived parameter {name} has no Hugging Face counterpart in {kind}")


def has_hf_source(name: str, kind: str, n_layers: int = 0) -> bool:
    """Whether a checkpoint of architecture `kind` holds `name` (buffers: only DeepSeek's routing bias)."""
    try:
        hf_source(name, kind, n_layers)
    except (KeyError, ValueError):
        return False
    return True


def deinterleaved_rows(name: str, cfg: ModelConfig) -> tuple[int, ...] | None:
    """The rows of a checkpoint with interleaved rotary pairs (x0, x1), (x2, x3), ... that fived's
    rotate-half layout [x0, x2, ... | x1, x3, ...] takes, for the tensors holding rotary features
    (the queries' up-projection, the shared rotary key); None for the others. Both layouts rotate the
    same pairs by the same angles, and queries and keys are permuted alike, so scores are unchanged."""
    rope, nope = cfg.qk_rope_head_dim, cfg.qk_nope_head_dim
    pairs = [*range(0, rope, 2), *range(1, rope, 2)]
    if name.endswith(("attention.wq_b.weight", "attention.wq.weight")):
        head = nope + rope
        return tuple(
            h * head + (r if r < nope else nope + pairs[r - nope]) for h in range(cfg.n_heads) for r in range(head)
        )
    if name.endswith("attention.wkv_a.weight"):
        return tuple(range(cfg.kv_lora_rank)) + tuple(cfg.kv_lora_rank + p for p in pairs)
    return None


def fived_to_hf(name: str, tensor, cfg: ModelConfig, kind: str) -> list[tuple[str, Any]]:
    """One whole fived tensor as the Hugging Face tensors it becomes (contiguous)."""
    source = hf_source(name, kind, cfg.n_layers)
    if source.name:
        return [(hf, tensor.contiguous()) for hf in [source.name, *mtp_copies(name, cfg, kind)]]
    return [(hf, tensor[e].t().contiguous()) for e, hf in enumerate(source.expert_names(cfg.n_experts))]


def mtp_copies(name: str, cfg: ModelConfig, kind: str) -> list[str]:
    """The released DeepSeek-V3 checkpoints' copies of the embedding and head in each multi-token
    prediction layer (fived shares them: written on export, not read on import)."""
    if kind != "deepseek_v3" or name not in MTP_COPIES:
        return []
    return [f"model.layers.{cfg.n_layers + k}.{MTP_COPIES[name]}" for k in range(cfg.mtp_depth)]
