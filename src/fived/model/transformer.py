"""A Llama-style decoder with an optional mixture-of-experts feed-forward.

The model code has no parallel branches: every parallel dimension is applied from outside by
`fived.parallel.parallelize`, which swaps or wraps modules. Shapes inside forward are read from the
tensors (e.g. the number of local heads), so a tensor-parallel shard runs the same code.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from fived.config import ModelConfig
from fived.model.attention import document_attention
from fived.model.gpt_oss_experts import ClampedSwiglu, biased_experts
from fived.model.grouped_gemm import grouped_swiglu
from fived.model.mtp import MultiTokenPrediction
from fived.model.rope import apply_rope, rope_cos_sin, windowed_rope
from fived.model.routing import route


class RMSNorm(nn.Module):
    """`offset`: the weight is stored centred at zero and scales by 1 + weight (Gemma's checkpoints)."""

    def __init__(self, dim: int, eps: float, *, offset: bool = False):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), 1 + self.weight if self.offset else self.weight, self.eps)


def model_norm(cfg: ModelConfig, dim: int) -> RMSNorm:
    """An RMSNorm of the model's kind (epsilon, offset)."""
    return RMSNorm(dim, cfg.norm_eps, offset=cfg.norm_offset)


class CausalAttentionCore(nn.Module):
    """softmax(QK^T/sqrt(d)) V with a causal mask, or with `documents` (per-token document ids, and
    the tokens' in-document `positions`) within documents only (fived.model.attention). A module of its own
    so that context parallelism can replace it without touching `Attention`. `window` > 0: a query
    sees only the window's keys (itself included); `sinks` [heads]: GPT-OSS's sink logits."""

    def __init__(self, *, window: int = 0):
        super().__init__()
        self.window = window

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if documents is not None or self.window or sinks is not None:  # (the blockwise kernels)
            if positions is None:
                positions = torch.arange(q.shape[1], device=q.device)
            return document_attention(q, k, v, documents, positions, window=self.window, sinks=sinks)
        # [b, s, h, d] -> [b, h, s, d]; kv heads are shared by groups of query heads (GQA).
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int = 0):
        super().__init__()
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        # wo's bias is added by the block, after tensor parallelism's reduction of the heads' sum
        self.wo_bias = nn.Parameter(torch.empty(cfg.dim)) if bias else None
        self.sinks = nn.Parameter(torch.empty(cfg.n_heads)) if cfg.attention_sinks else None
        # (context parallelism and generation swap it)
        self.core: nn.Module = CausalAttentionCore(window=cfg.layer_window(layer_id))
        # Qwen3: each query and key head normalised before the rotation (weights shared by heads)
        self.q_norm = model_norm(cfg, cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = model_norm(cfg, cfg.head_dim) if cfg.qk_norm else None
        # Gemma 3 divides the scores by sqrt(attn_scale_dim): the queries carry the change from the
        # cores' 1/sqrt(head_dim), so every core (rings, Ulysses, the KV cache) computes it unchanged
        self.q_gain = math.sqrt(cfg.head_dim / cfg.attn_scale_dim) if cfg.attn_scale_dim else 1.0

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        documents: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        sinks = {"sinks": self.sinks} if self.sinks is not None else {}
        q = apply_rope(q, cos, sin) if self.q_gain == 1.0 else apply_rope(q, cos, sin) * self.q_gain
        out = self.core(q, apply_rope(k, cos, sin), v, documents, positions, **sinks)
        return self.wo(out.reshape(b, s, -1))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu-tanh": functools.partial(F.gelu, approximate="tanh"),
}


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); `activation` "gelu-tanh": GeGLU (Gemma)."""

    def __init__(self, dim: int, hidden: int, *, activation: str = "silu"):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.act = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as three [E, ...] tensors, so expert parallelism can shard dim 0.

    forward takes tokens already sorted by expert and the count per expert (a tensor: on a GPU it
    stays there); all experts run in one grouped call (`fived.model.grouped_gemm`)."""

    def __init__(self, n_experts: int, dim: int, hidden: int, *, clamped: ClampedSwiglu | None = None):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        # GPT-OSS's experts (fived.model.gpt_oss_experts): biases and the clamped SwiGLU
        self.clamped = clamped
        if clamped is not None:
            self.b1 = nn.Parameter(torch.empty(n_experts, hidden))
            self.b3 = nn.Parameter(torch.empty(n_experts, hidden))
            self.b2 = nn.Parameter(torch.empty(n_experts, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.clamped is not None:
            weights = (self.w1, self.b1, self.w3, self.b3, self.w2, self.b2)
            return biased_experts(x, weights, counts, self.clamped)
        return grouped_swiglu(x, self.w1, self.w3, self.w2, counts)


class AddAuxLossGrad(torch.autograd.Function):
    """Identity on the activations whose backward also seeds the auxiliary loss with `scale`.

    This puts the load-balancing loss into the gradient without adding it to the language-model loss,
    so it works unchanged under pipeline stages and activation checkpointing."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, load: torch.Tensor, scale: float, sink: list):
        ctx.scale, ctx.sink = scale, sink
        ctx.save_for_backward(aux, load)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        aux, load = ctx.saved_tensors
        # Logged here, not in forward: backward runs once per micro-batch even when activation
        # checkpointing runs the forward twice, and inside pipeline schedules too.
        ctx.sink.append((aux.detach(), load))
        return grad, torch.full_like(aux, ctx.scale), None, None, None


class MoE(nn.Module):
    """Top-k routed experts (+ optional shared experts), dropless unless capacity_factor > 0.

    The load-balancing loss is Switch-style, E * sum_e f_e * P_e, computed **per sequence** (f: fraction
    of the sequence's routing slots sent to e, P: mean router probability of e) and summed over
    sequences; the trainer scales it by coef / global sequences. Whatever the layout, every sequence
    is whole on one rank before context parallelism, so the value does not depend on the layout.
    Capacity-factor dropping is per local micro-batch and therefore layout-dependent (documented)."""

    router_bias: torch.Tensor  # (a buffer)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.capacity_factor = cfg.capacity_factor
        gpt_oss = cfg.expert_kind == "gpt-oss"
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=gpt_oss)
        # Aux-loss-free balancing: added to the scores only to choose experts, never to the weights;
        # the trainer moves it after each step from the global load (zero and fixed by default).
        self.register_buffer("router_bias", torch.zeros(cfg.n_experts))
        clamped = ClampedSwiglu(cfg.swiglu_alpha, cfg.swiglu_limit) if gpt_oss else None
        self.experts = GroupedExperts(cfg.n_experts, cfg.dim, cfg.expert_dim, clamped=clamped)
        self.shared = FeedForward(cfg.dim, cfg.expert_dim * cfg.n_shared_experts) if cfg.n_shared_experts else None
        self.aux_loss_scale = 0.0  # set by the trainer: coef / sequences in the global batch
        self.last_aux_loss: torch.Tensor | None = None  # detached per-sequence sum of the last forward
        self.aux_losses: list = []  # (aux, tokens per expert) per backward since the trainer last read it
        self.last_tokens_per_expert: torch.Tensor | None = None
        # Sums the per-sequence statistics over the ranks that hold parts of a sequence (context
        # parallelism sets it); identity when every sequence is whole on this rank.
        self.reduce_sequence_stats = _identity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        logits = self.router(x).to(torch.promote_types(x.dtype, torch.float32))
        routing = route(logits, self.router_bias, self.cfg)  # (fived.model.routing)
        experts, probs, weights = routing.experts, routing.probs, routing.weights.to(x.dtype)  # [b, s, k]

        # Per-sequence load-balancing statistics: routing slots and router probability per expert.
        e = self.n_experts
        slots = F.one_hot(experts, e).sum(dim=2).to(probs.dtype)  # [b, s, E]
        tokens = torch.full((b, 1), float(s), dtype=probs.dtype, device=x.device)
        stats = self.reduce_sequence_stats(torch.cat([slots.sum(dim=1), probs.sum(dim=1), tokens], dim=-1))
        frac = stats[:, :e] / (stats[:, -1:] * self.top_k)  # [b, E]
        mean_prob = stats[:, e : 2 * e] / stats[:, -1:]
        aux = (e * (frac * mean_prob).sum(dim=-1)).sum()
        self.last_aux_loss = aux.detach()

        flat_experts = experts.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)  # slots grouped by expert, token order kept
        # (scatter_add, not bincount: a static shape, so a compiled block has no graph break here)
        counts = flat_experts.new_zeros(self.n_experts).scatter_add_(0, flat_experts, torch.ones_like(flat_experts))
        routed = counts
        self.last_tokens_per_expert = counts.detach()
        token_of_slot = order // self.top_k
        slot_weight = weights.reshape(-1)[order]
        if self.capacity_factor > 0:
            keep = self._within_capacity(flat_experts[order], counts, b * s)
            token_of_slot, slot_weight = token_of_slot[keep], slot_weight[keep]
            counts = torch.bincount(flat_experts[order][keep], minlength=self.n_experts)

        tokens = x.reshape(-1, d)
        expert_out = self.experts(tokens[token_of_slot], counts) * slot_weight[:, None]
        out = torch.zeros_like(tokens).index_add_(0, token_of_slot, expert_out).view(b, s, d)
        if self.shared is not None:
            out = out + self.shared(x)
        if self.training and torch.is_grad_enabled():
            load = routed.double()
            out = AddAuxLossGrad.apply(out, aux, load, self.aux_loss_scale, self.aux_losses)
        return out

    def _within_capacity(self, sorted_experts: torch.Tensor, counts: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """Keep the first `capacity` slots of each expert in token order; deterministic."""
        capacity = math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts)
        starts = torch.cumsum(counts, 0) - counts
        rank_in_expert = torch.arange(len(sorted_experts), device=sorted_experts.device) - starts[sorted_experts]
        return rank_in_expert < capacity


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class TransformerBlock(nn.Module):
    """Pre-norm attention and feed-forward, each added to the residual; with model.post_norms their
    outputs are normed first (Gemma 3's four norms a layer)."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.attention_norm = model_norm(cfg, cfg.dim)
        self.attention: nn.Module
        if cfg.is_mla:
            # (imported here: latent attention is built from this module's norm, core and rotation)
            from fived.model.latent_attention import LatentAttention

            self.attention = LatentAttention(cfg, RMSNorm, CausalAttentionCore(), apply_rope)
        else:
            self.attention = Attention(cfg, layer_id)
        self.post_attention_norm = model_norm(cfg, cfg.dim) if cfg.post_norms else None
        self.ffn_norm = model_norm(cfg, cfg.dim)
        moe = cfg.is_moe and layer_id >= cfg.n_dense_layers
        self.feed_forward = MoE(cfg) if moe else FeedForward(cfg.dim, cfg.ffn_dim, activation=cfg.ffn_activation)
        self.post_ffn_norm = model_norm(cfg, cfg.dim) if cfg.post_norms else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        documents: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        out = self.attention(self.attention_norm(x), cos, sin, documents, positions)
        bias = getattr(self.attention, "wo_bias", None)
        out = out if bias is None else out + bias
        x = x + (out if self.post_attention_norm is None else self.post_attention_norm(out))
        out = self.feed_forward(self.ffn_norm(x))
        return x + (out if self.post_ffn_norm is None else self.post_ffn_norm(out))


class Transformer(nn.Module):
    """Embedding -> blocks -> norm -> output head. Layers live in a ModuleDict keyed by layer index so
    that a pipeline stage can drop layers and keep every parameter's name (and thus its init)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.sequence_shards = 1  # >1 when the hidden states between pipeline stages are sequence shards
        self.positions: torch.Tensor | None = None  # global positions of the local tokens (context parallelism)
        # (a pipeline stage without the embedding, or the final norm and head, holds None instead)
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = model_norm(cfg, cfg.dim)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # multi-token prediction (fived.model.mtp): on the last stage, after the head
        self.mtp: MultiTokenPrediction | None = None
        if cfg.mtp_depth:
            self.mtp = MultiTokenPrediction(
                cfg, lambda lid: TransformerBlock(cfg, lid), lambda: model_norm(cfg, cfg.dim)
            )
        # a pipeline's last stage without the embedding reads a copy for MTP (fived.parallel.mtp_embedding)
        self.mtp_embeddings: nn.Module | None = None

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
        mtp_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`positions`: the tokens' rotary positions ([s], or [b, s]); `documents`: with document
        masking, each token's document ([b, s]; `positions` then count from its document's start).
        Both describe the whole (local) sequence, also when hidden states are SP shards.
        `mtp_tokens` ([b, s, D+1], training only): the next D+1 tokens of each position."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if self.cfg.embed_scale and self.tok_embeddings is not None:
            # (sqrt(dim) rounded to the activations' dtype first, as Gemma's reference does)
            h = h * torch.tensor(self.cfg.dim**0.5, dtype=h.dtype, device=h.device)
        if positions is None:
            positions = self.positions
        if positions is None:  # tokens are whole sequences; hidden states may be sequence shards (SP)
            seq_len = tokens.shape[1] * (1 if self.tok_embeddings is not None else self.sequence_shards)
            positions = torch.arange(seq_len, device=h.device)
        positions = positions.to(h.device)
        cos, sin = rope_cos_sin(positions, self.cfg, h.dtype)
        local = (cos, sin)  # (the windowed layers' tables: their own with model.rope_local_theta)
        if self.cfg.rope_local_theta and self.cfg.sliding_window:
            local = rope_cos_sin(positions, windowed_rope(self.cfg), h.dtype)
        masked = (documents, positions) if documents is not None else ()  # (the mask's data, when there is one)
        for lid, layer in self.layers.items():
            h = layer(h, *(local if self.cfg.layer_window(int(lid)) else (cos, sin)), *masked)
        h = self.norm(h) if self.norm is not None else h
        if self.output is None:
            return h
        if self.mtp is not None and mtp_tokens is not None and self.training and torch.is_grad_enabled():
            embed = self.tok_embeddings if self.tok_embeddings is not None else self.mtp_embeddings
            h = self.mtp(h, mtp_tokens, embed, self.output, (cos, sin, *masked))
        logits = self.output(h)
        cap = self.cfg.final_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap

    def blocks(self) -> list[TransformerBlock]:
        """This model's (a stage's: its own) blocks, in order, the MTP modules' last; a wrapped block
        (checkpointed, compiled, sharded) still reads as its block."""
        mtp = self.mtp.blocks() if self.mtp is not None and self.output is not None else []
        return cast("list[TransformerBlock]", list(self.layers.values()) + mtp)


# ---------------------------------------------------------------------------------------------
# Initialisation (fived.model.init): every parameter's values depend only on (seed, canonical name,
# position in the whole tensor), never on rank or layout; each rank generates only what it holds.

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def find_config(model: nn.Module) -> ModelConfig:
    for module in model.modules():
        if isinstance(module, Transformer):
            return module.cfg
    raise TypeError("init_weights expects a module containing a fived Transformer")


def materialize(model: nn.Module, device: str | torch.device) -> None:
    """Allocate (uninitialised) storage for a meta-device model. Tensors are swapped in place so a
    parameter shared by two modules (tied embeddings) stays one parameter."""
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


def build_model(
    cfg: ModelConfig, device: str | torch.device = "meta", dtype: torch.dtype = torch.float32
) -> Transformer:
    """Build on `device` (meta by default: no memory is allocated until `to_empty`)."""
    with torch.device(device):
        model = Transformer(cfg)
    return model.to(dtype)


def keep_buffers_float32(model: nn.Module) -> None:
    """Floating buffers of a bf16 model back to float32 (the router biases: a bias step of 1e-3 would
    vanish in bf16's 8-bit mantissa)."""
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.dtype == torch.bfloat16:
                module.register_buffer(name, buffer.float(), persistent=name not in module._non_persistent_buffers_set)


def count_params(cfg: ModelConfig, active: bool = False) -> int:
    """Parameter count from the shapes (meta device, no memory); active=True counts top_k experts."""
    model = build_model(cfg)
    total = 0
    for name, p in model.named_parameters():
        n = p.numel()
        if active and ".experts." in name:
            n = n // cfg.n_experts * cfg.top_k
        total += n
    return total
