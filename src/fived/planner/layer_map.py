"""The layer map: every weight and activation tensor of one transformer layer (and the embedding and
head) on one GPU of a model replica, with its local shape and whether the layout shards or
replicates it — read from the sharding spec (`fived.layout.spec`), as the runtime splits them and
`fived.planner.memory` counts them: tensor parallelism splits heads,
feed-forward widths and the padded vocabulary (a whole kv head per rank when tp > n_kv_heads),
expert parallelism keeps E/ep experts, ZeRO-3 stores ceil(rows/S) rows of every weight (experts over
edp), ZeRO-1/2 shard the optimizer state (and ZeRO-2 the gradients) S ways, S = dp_shard * cp.
Activations are one micro-batch's on the rank: B = micro_batch * seq_len / cp tokens (sequence
parallelism splits the residual stream's over tp too).
"""

from __future__ import annotations

import math

from fived.config import ModelConfig
from fived.layout.layout import Layout
from fived.layout.spec import TensorSpec, end_specs, kv_width, layer_specs, local_vocab
from fived.layout.stages import rank_chunks


def layer_weights(m: ModelConfig, tp: int, ep: int, lid: int) -> list[dict]:
    """One layer's weights on one rank: name, local shape, full shape, the dimensions that split it
    (read from the sharding spec, `fived.layout.spec`)."""
    return [_weight(spec, "layer") for spec in layer_specs(m, lid, tp=tp, ep=ep) if not spec.buffer]


def end_weights(m: ModelConfig, tp: int, first: bool, last: bool) -> list[dict]:
    """The embedding (first stage), final norm and output head (last stage) on one rank."""
    return [_weight(spec, spec.part) for spec in end_specs(m, first=first, last=last, tp=tp)]


def _weight(spec: TensorSpec, part: str) -> dict:
    return {
        "name": _short_name(spec.name),
        "kind": "weight",
        "part": part,
        "shape": list(spec.local_shape),
        "full": list(spec.shape),
        "split": spec.splits,
    }


def _short_name(name: str) -> str:
    """layers.3.attention.wq.weight -> wq; layers.3.feed_forward.experts.w1 -> experts.w1;
    tok_embeddings.weight -> embedding."""
    if name == "tok_embeddings.weight":
        return "embedding"
    parts = name.removesuffix(".weight").split(".")
    if parts[0] == "layers":
        parts = parts[2:]
    return ".".join(parts[1:] if parts[0] in ("attention", "feed_forward") and len(parts) > 1 else parts)


def _zero(tensors: list[dict], layout: Layout) -> None:
    """ZeRO-3's stored rows (ceil(rows/S); experts over edp) and where optimizer state is sharded."""
    shards, edp = layout.shards, layout.edp
    for t in tensors:
        n = edp if t["name"].startswith("experts.") and layout.ep > 1 else shards
        if layout.zero == 3 and n > 1:
            t["stored"] = [math.ceil(t["shape"][0] / n)] + t["shape"][1:]
            t["split"] = "+".join(x for x in (t["split"], f"zero3/{n}") if x)
        elif layout.zero in (1, 2) and shards > 1 and not (t["name"].startswith("experts.") and layout.ep > 1):
            t["state_note"] = f"Adam state{' and gradients' if layout.zero == 2 else ''} 1/{shards}"


def activations(m: ModelConfig, layout: Layout, seq_len: int) -> list[dict]:
    """One micro-batch's main activations of one layer (and the logits) on one rank."""
    L, hd = layout, m.head_dim
    tokens = L.micro_batch * seq_len // L.cp
    kv_local = kv_width(m, L.tp) // hd
    lid = m.n_dense_layers if m.is_moe else 0  # a MoE layer's activations for a MoE model
    local = {_short_name(s.name): s.local_shape for s in layer_specs(m, lid, tp=L.tp, ep=L.ep)}
    q_width = local["wq" if "wq" in local else "wq_b"][0]  # the local widths, from the sharding spec's cuts
    ffn_width = local["experts.w1"][2] * m.top_k if m.is_moe else local["w1"][0]
    by_cp = "cp" if L.cp > 1 else ""
    by_tp = "+".join(x for x in (by_cp, "tp" if L.tp > 1 else "") if x)
    by_sp = "+".join(x for x in (by_cp, "sp" if L.sp else "") if x)
    resid = [tokens // L.tp if L.sp else tokens, m.dim]
    ffn = (m.expert_dim * m.top_k) if m.is_moe else m.ffn_dim
    out = [
        a("x (residual)", resid, [L.micro_batch * seq_len, m.dim], by_sp),
        a("q", [tokens, q_width], [L.micro_batch * seq_len, m.n_heads * hd], by_tp),
        a(
            "k, v",
            [tokens, kv_local * hd],
            [L.micro_batch * seq_len, m.n_kv_heads * hd],
            by_tp if kv_local < m.n_kv_heads else by_cp,
        ),
        a("attention out", [tokens, q_width], [L.micro_batch * seq_len, m.n_heads * hd], by_tp),
        a(
            "ffn hidden" + (" (top_k routed)" if m.is_moe else ""),
            [tokens, ffn_width],
            [L.micro_batch * seq_len, ffn],
            by_tp,
        ),
        a("logits", [tokens, local_vocab(m, L.tp)], [L.micro_batch * seq_len, m.vocab_size], by_tp, "head"),
    ]
    if L.checkpointing == "full":
        for t in out[1:5]:
            t["note"] = "recomputed in backward (full checkpointing)"
    return out


def a(name: str, shape: list[int], full: list[int], split: str, part: str = "layer") -> dict:
    return {"name": name, "kind": "activation", "part": part, "shape": shape, "full": full, "split": split}


def replica_weights(m: ModelConfig, layout: Layout) -> list[dict]:
    """The weights of one MoE layer (a dense one for dense models), the embedding and the head on one
    GPU; the same shapes on every tp/cp rank (each holds its own slice)."""
    lid = m.n_dense_layers if m.is_moe else 0
    tensors = layer_weights(m, layout.tp, layout.ep, lid) + end_weights(m, layout.tp, True, True)
    _zero(tensors, layout)
    return tensors


def pipeline_ranks(m: ModelConfig, layout: Layout) -> list[dict]:
    """Per pipeline rank: its stages' layers ([first, last] per stage), how many, and whether it holds
    the embedding / head."""
    ranks = []
    for pp_rank in range(layout.pp):
        chunks = rank_chunks(m, layout, pp_rank)
        ranks.append(
            {
                "stages": [[min(layers), max(layers)] for layers, _, _ in chunks if layers],
                "layers": sum(len(layers) for layers, _, _ in chunks),
                "first": any(f for _, f, _ in chunks),
                "last": any(la for _, _, la in chunks),
            }
        )
    return ranks
