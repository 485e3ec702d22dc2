"""Activation memory: the bytes autograd keeps for backward, per micro-batch and rank, by formula.

Pure arithmetic on a `ModelConfig` and a layout (no model is built, no torch call): a planner can
call `activation_bytes` thousands of times. The figures are what `fived.model.ledger.ActivationLedger`
measures (tensors handed to the saved-tensor hooks, the inputs activation checkpointing keeps, the
op outputs selective checkpointing caches; weights excluded; views of one buffer once per part),
for fived's model (RMSNorm, GQA with RoPE, SDPA or ring attention, SwiGLU, top-k MoE) on CPU.

Notation (per micro-batch on one rank):
    b   sequences of the micro-batch (global_batch / dp / microbatches)
    sl  tokens of each sequence this rank holds: seq_len / cp
    B   tokens this rank computes on: b * sl;  Bs = B / T_sp the sequence-parallel shard (T_sp = tp
        with sp, else 1): norms and residuals live on Bs tokens, tensor-parallel regions on B
    T   tp;  h dim;  f ffn_dim;  fe expert_dim;  fs = fe * n_shared_experts;  hd head_dim
    a   local query heads n_heads / T;  kv  local k (or v) width max(n_kv_heads / T, 1) * hd
        (with T > n_kv_heads every rank keeps the one kv head its query heads use)
    V   local vocabulary: ceil(vocab / T) (padded);  E experts, k top_k
    S   routing slots a rank feeds its experts: B*k (dropless, perfectly balanced: with ep each
        rank receives as many slots as it sends; capacity_factor cf > 0 keeps E*min(B*k/E,
        ceil(cf*B*k/E))). Without ep and dropless S = B*k whatever the routing (exact); with ep it
        is exact for the mean over the ep ranks, and a rank's own figure moves with its routing
        (tiny-moe, ep=2: +-1.5% per rank total, up to 7% per layer); with cf > 0 real routing drops
        more than a balanced one (an upper bound, 3-5% over on tiny-moe)
Element sizes: x = activation bytes (8 float64, 4 float32; 2 = bfloat16 autocast, see below); int64
indices 8; bool masks 1. The loss and router statistics are computed in at least float32.

Per part, in elements per token unless said (times x bytes unless said):

    embedding  token ids, int64: 8 bytes * B; with T > 1 also the mask of ids another rank owns,
               bool: + 1 byte * B
    dense layer, no checkpointing:
        norms      each of the two RMSNorms keeps its input, the normalised input and its output
                   plus 1/rms: 2 * (3h + 1) * Bs  (with SP the output is stored as its shard)
        attention  q and its output (the output is also wo's input) 2h/T, k and v 2kv, a
                   log-sum-exp per head a: (2h/T + 2kv + a) * B
        MLP        SwiGLU gate, up, silu(gate), product: 4f/T * B
        RoPE       cos and sin tables: 2 * sl * hd (per layer: each layer's ops save them)
        cp > 1     ring attention keeps q, k, v, its output and the log-sum-exp as SDPA does
        Ulysses    (group of u) q, k, v of the group's tokens of a u-th of the heads (k, v of u heads'
                   width when the rank has fewer kv heads than u), the output in that layout and in
                   the tokens' (wo's input): + h/T; the sort order and its inverse 16 bytes * u*B
        documents  (document masking) the RoPE tables per sequence, 2 * B * hd; the order keys the
                   masked kernel keeps, 8 bytes per token it attends over (B; u*B under Ulysses;
                   also hybrid's ring without documents); full or selective checkpointing keeps the
                   block's documents and positions, 16 bytes * B
        windows    a windowed layer (model.sliding_window), or one with attention sinks, runs the
                   same blockwise kernels without documents: their order keys, 8 bytes per token
                   it attends over, and under selective checkpointing no cached attention output
                   or log-sum-exp. Nothing else: the kernels never hold the score matrix, so its
                   activations are per token as a global layer's, not bounded by the window
    MoE layer, no checkpointing: norms, attention and RoPE as dense, and (every tp rank routes the
    region's whole B tokens):
        router     probabilities E, top-k ids (int64) 8k bytes, the gathered top-k weights k and
                   their sum 1 (route_norm): (E + k + 1) * B + 8k bytes * B
        statistics per sequence: frac and mean_prob E each, the token count 1, the views of the
                   [b, 2E+1] statistics (counted as the ledger counts views):
                   2E*b + b + max(E*(b+1), 2E+b)
        dispatch   slot -> token ids 8 bytes * S, the weight gather's ids 8 bytes * B*k (with
                   cf > 0 also the kept slots' ids 8 bytes * S); the dispatched tokens h*S; with
                   ep the receiving side's reorder ids + 8 bytes * S
        experts    the grouped op keeps gate and up 2 fe/T * S (silu and the product are
                   recomputed in its backward) and the slots per local expert 8 bytes * E/ep;
                   GPT-OSS's experts (model.expert_kind gpt-oss: plain autograd per expert, its
                   counts read once) keep 7 fe/T * S: the clamps' inputs (gate, up), the sigmoid's
                   output, the clamped gate, gate * sigmoid, up + 1 and their product (w2's input);
                   their biases keep nothing
        combine    expert outputs h*S and their weights 1*S (the multiply), the weighted outputs
                   h*S (index_add)
        shared     shared experts' SwiGLU 4 fs/T * B
        aux loss   the loss (a scalar) and the tokens per expert (E float64): x + 8E bytes
    Gemma 3's parts (float32/float64 runs; no checkpointing): q and the attention output are
        n_heads*head_dim/T wide (not h/T when head_size is set); q/k norms keep their input, the
        normalised input and 1/rms per head, 2 (q + k) + a + kv/hd; the post-norms their input, the
        normalised input and 1/rms, 2 * (2h + 1) * Bs (their output only feeds the residual sum);
        a norm scaling by 1 + weight keeps that sum, its width once; a windowed layer or one with
        sinks on one cp rank keeps the blockwise kernel's order keys, 8 bytes * B; the final
        soft-capping keeps the capped logits V*B
    full checkpointing, per layer (dense or MoE): the block's input h*Bs (a sequence shard with SP,
        the rank's chunk with cp) and the RoPE tables 2*sl*hd
    selective checkpointing (matmul and attention outputs cached), per layer:
        block input h*Bs, RoPE 2*sl*hd, q projection h/T, k and v 2kv, attention output h/T and
        log-sum-exp a, the row-parallel projections' partial outputs (wo, w2: full width h), gate
        and up 2f/T, all on B. cp > 1 replaces SDPA with ring attention, whose blocks are
        recomputed with its exchanges: no attention output or log-sum-exp is cached.
        MoE: router logits E*B, per slot gate, up and down outputs (2fe/T + h)*S, shared
        (2fs/T + h)*B, in place of the dense MLP's.
    head       final norm (3h + 1) * Bs; without tp: log-probabilities V*B, target ids 8 bytes * B,
               one scalar; with tp (vocab-parallel loss): the shifted logits and their exp
               2V*B, the target-column ids 8 bytes * B, its mask 1 byte * B, the summed exp B;
               with a padded vocabulary the padded-column mask, V bytes (on the ranks that hold
               padding; counted on every rank here)

bfloat16 (dtype_bytes=2) means fived's mixed precision: float32 weights and residual stream,
compute under autocast. Matmul outputs, SDPA's q/k/v/output and the expert activations are bf16
(2 bytes, ring attention's too: its kernels run in autocast's dtype), the residual stream, norms,
RoPE tables, log-sum-exp, router statistics and the loss float32 (4 bytes), and every linear keeps its own bf16 copy of its input: the
attention norm's output is kept three times (wq, wk, wv) at 2 bytes, the MLP norm's twice (w1,
w3), the head norm's once, and under SP these copies are of the *gathered* input (B, not Bs
tokens): sequence parallelism does not shrink them. In a MoE layer the MLP norm's output is kept
for the router and the shared experts' w1 and w3, each expert matmul (w1, w3) keeps a bf16 copy of
its slots (2 * 2h bytes per slot), expert outputs are bf16 and the weighted outputs float32.
Derived from (and exact on) CPU autocast runs. bfloat16 with autocast=False means bf16 weights
(train.dtype=bfloat16): every tensor is bf16 (2 bytes) as a float32 run's is float32, except each
RMSNorm, which computes in float32 and keeps its float32 input and normalised input, 1/rms, and its
bf16 output ((2h + 1) * 4 + 2h per token), and the float32 statistics above. CUDA kernels (flash attention's RNG state, its
log-sum-exp padding) can differ slightly.

The RoPE tables are one pair of tensors shared by the layers of a chunk, but each layer's entry
counts them (as the ledger does); the sum over layers thus overstates a rank's memory by
(layers - 1) * 2*sl*hd*x bytes — negligible next to the rest.
"""

from __future__ import annotations

import math

from fived.layout.layout import CHECKPOINTING
from fived.layout.spec import kv_width, local_vocab

# tensors of an expert's width GPT-OSS's experts keep per slot (the module docstring lists them)
GPT_OSS_EXPERT_SAVES = 7


def activation_bytes(
    model,
    *,
    micro_batch_seqs: int,
    seq_len: int,
    tp: int = 1,
    sp: bool = False,
    cp: int = 1,
    ep: int = 1,
    dtype_bytes: int = 4,
    checkpointing: str = "none",
    layers=(),
    first: bool = False,
    last: bool = False,
    autocast: bool = True,
    ulysses: int = 1,
    document_mask: bool = False,
    folded: bool = False,
) -> dict[str, int]:
    """Bytes saved for backward by ONE micro-batch on one rank, by part: a key per layer id in
    `layers` (str), "embedding" if `first` (the rank holds the token embedding), "head" if `last`
    (final norm, output projection, loss). `model` is a `fived.config.ModelConfig`;
    `micro_batch_seqs` the sequences of a micro-batch on this data-parallel rank; `seq_len` the
    whole sequence (cp ranks hold seq_len / cp of each); `dtype_bytes` 8, 4 or 2 (bfloat16 autocast);
    `checkpointing` none | full | selective; `autocast` (with dtype_bytes 2): float32 weights under
    autocast (bfloat16-autocast), else bf16 weights (bfloat16); `ulysses` the Ulysses group size
    (`Layout.ulysses`); `document_mask` data.document_mask; `folded` MoE parallel folding (etp 1 under
    tp: a MoE layer routes its Bs sequence-shard tokens through whole experts). See the module
    docstring for every term."""
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing={checkpointing!r}: must be one of {', '.join(CHECKPOINTING)}")
    if dtype_bytes not in (2, 4, 8):
        raise ValueError(f"dtype_bytes={dtype_bytes}: must be 8 (float64), 4 (float32) or 2 (bfloat16 autocast)")
    g = _Geometry(
        model, micro_batch_seqs, seq_len, tp, sp, cp, ep, dtype_bytes, autocast, ulysses, document_mask, folded
    )
    out: dict[str, int] = {}
    if first:
        out["embedding"] = g.embedding()
    per_kind: dict[tuple[bool, bool], int] = {}  # (MoE, blockwise): every layer of a kind saves the same
    for lid in layers:
        kind = (model.is_moe and int(lid) >= model.n_dense_layers, blockwise_layer(model, int(lid)))
        if kind not in per_kind:
            per_kind[kind] = g.layer(*kind, checkpointing=checkpointing)
        out[str(lid)] = per_kind[kind]
    if last:
        out["head"] = g.head()
    return out


def blockwise_layer(m, lid: int) -> bool:
    """Whether layer `lid`'s attention runs the blockwise kernels without documents too (a sliding
    window or sinks: `fived.model.transformer.CausalAttentionCore`), which keep the order keys and
    are recomputed under selective checkpointing, as document-masked attention is."""
    return bool(m.layer_window(lid)) or m.attention_sinks


def layer_bytes(model, moe: bool = False, **layout) -> int:
    """One layer's bytes (dense, or MoE with moe=True); `layout` as `activation_bytes` takes it."""
    checkpointing = layout.pop("checkpointing", "none")
    for key in ("layers", "first", "last"):
        layout.pop(key, None)
    g = _Geometry(
        model,
        layout.pop("micro_batch_seqs"),
        layout.pop("seq_len"),
        **{
            k: layout[k]
            for k in ("tp", "sp", "cp", "ep", "dtype_bytes", "autocast", "ulysses", "document_mask", "folded")
            if k in layout
        },
    )
    return g.layer(moe, blockwise_layer(model, 0), checkpointing=checkpointing)


class _Geometry:
    """The sizes the formulas use, for one layout (see the module docstring for the names)."""

    def __init__(
        self,
        m,
        b: int,
        seq_len: int,
        tp: int = 1,
        sp: bool = False,
        cp: int = 1,
        ep: int = 1,
        dtype_bytes: int = 4,
        autocast: bool = True,
        ulysses: int = 1,
        document_mask: bool = False,
        folded: bool = False,
    ):
        self.m, self.b, self.tp, self.cp, self.ep = m, b, tp, cp, ep
        self.folded = folded and tp > 1
        self.u, self.documents = ulysses, document_mask
        # the attention keeps its tokens' order keys: document-masked, or the ring across Ulysses groups
        self.keys = document_mask or 1 < ulysses < cp
        self.q = m.n_heads * m.head_dim / tp  # q's (and the attention output's) width
        self.sl = seq_len // cp
        self.B = b * self.sl
        self.Bs = self.B / (tp if sp else 1)
        self.h, self.hd = m.dim, m.head_dim
        self.a = m.n_heads / tp
        self.kv = kv_width(m, tp)  # (one whole head when tp > n_kv_heads: the sharding spec's rule)
        self.bf16 = dtype_bytes == 2 and autocast
        self.bf16_weights = dtype_bytes == 2 and not autocast
        self.x = dtype_bytes  # matmul / activation dtype
        self.r = 4 if self.bf16 else dtype_bytes  # residual stream, norms, RoPE (fp32 weights under autocast)
        self.f32 = max(dtype_bytes, 4)  # at least float32: softmax statistics, loss, router
        self.V = local_vocab(m, tp)

    # parts -------------------------------------------------------------------------------------
    def embedding(self) -> int:
        return round(self.B * (8 + (1 if self.tp > 1 else 0)))

    def head(self) -> int:
        B, Bs, V = self.B, self.Bs, self.V
        total = self._norm(Bs, B, consumers=1)
        if self.m.final_softcap:
            total += B * V * self.x  # (tanh's output)
        if self.tp == 1:
            total += B * V * self.f32 + 8 * B + self.f32
        else:
            total += 2 * B * V * self.f32 + 8 * B + B + B * self.f32
            if V * self.tp != self.m.vocab_size:
                total += V
        return round(total)

    def layer(self, moe: bool, blockwise: bool = False, *, checkpointing: str) -> int:
        # RoPE tables per sequence with document masking; its documents and positions (int64) are
        # the block's inputs, which checkpointing keeps
        rope = 2 * (self.B if self.documents else self.sl) * self.hd * self.r
        ids = 16 * self.B if self.documents else 0
        if checkpointing == "full":
            return round(self.Bs * self.h * self.r + rope + ids)
        if checkpointing == "selective":
            return round(self._selective(moe, blockwise) + rope + ids)
        ffn = self._moe() if moe else 4 * self.m.ffn_dim / self.tp * self.B * self.x
        consumers = (1 + (2 if self.m.n_shared_experts else 0)) if moe else 2  # router (+ shared w1, w3) or w1, w3
        return round(
            self._norm(self.Bs, self.B, consumers=3)
            + self._attention(blockwise)
            + self._qk_norms()
            + self._norm(self.Bs, self.B, consumers)
            + (2 * self._norm(self.Bs, self.B, consumers=0) if self.m.post_norms else 0)
            + ffn
            + rope
        )

    # pieces ------------------------------------------------------------------------------------
    def _norm(self, Bs: float, B: float, consumers: int) -> float:
        """An RMSNorm and the linears that take its output: input, normalised input, 1/rms and the
        output (fp32/fp64), or under autocast a bf16 copy of the output per consuming linear."""
        offset = self.h * self.r if self.m.norm_offset else 0  # (1 + weight, kept by the norm)
        if self.bf16_weights:  # rms_norm computes in float32: its input and normalised input, 1/rms
            return Bs * ((2 * self.h + 1) * 4 + (2 * self.h if consumers else 0)) + offset
        if not self.bf16:
            return Bs * (2 * self.h + 1 + (self.h if consumers else 0)) * self.x + offset
        return Bs * (2 * self.h + 1) * self.r + consumers * B * self.h * 2 + offset

    def _qk_norms(self) -> float:
        """Per-head q and k norms (Qwen3, Gemma 3): input, normalised input, 1/rms per head."""
        if not self.m.qk_norm:
            return 0
        offset = 2 * self.hd * self.r if self.m.norm_offset else 0
        return self.B * (2 * (self.q + self.kv) + self.a + self.kv / self.hd) * self.x + offset

    def _attention(self, blockwise: bool) -> float:
        B, a, kv, u = self.B, self.a, self.kv, self.u
        keys = self.keys or blockwise
        if u == 1:  # SDPA or ring attention (same kernels, same dtype): q, k, v, output (= wo's input), lse
            return B * ((2 * self.q + 2 * kv) * self.x + a * self.f32) + (8 * B if keys else 0)
        # Ulysses: the group's tokens of a u-th of the heads, sorted (kv heads repeated up to u when
        # fewer), the output in that layout and again in the tokens' (wo's input), the sort order and
        # its inverse (int64), and the gathered order keys where the attention is masked
        if (kv // self.hd) % u:
            kv = u * self.hd
        return B * ((3 * self.q + 2 * kv) * self.x + a * self.f32) + 16 * u * B + (8 * u * B if keys else 0)

    def _routed(self) -> tuple[float, int]:
        """(tokens a MoE layer routes, the tp split of its experts): B and T, or folded Bs and 1."""
        return (self.Bs, 1) if self.folded else (self.B, self.tp)

    def _slots(self) -> float:
        m, B = self.m, self._routed()[0]
        slots = B * m.top_k
        if m.capacity_factor > 0:
            cap = math.ceil(m.capacity_factor * B * m.top_k / m.n_experts)
            slots = m.n_experts * min(B * m.top_k / m.n_experts, cap)
        return slots

    def _moe(self) -> float:
        m, h, b = self.m, self.h, self.b
        B, T = self._routed()
        E, k, S = m.n_experts, m.top_k, self._slots()
        p = self.f32  # router probabilities and statistics
        router = B * E * p + 8 * k * B + ((k + 1) * B * p if m.route_norm else 0)
        stats = (2 * E * b + b + max(E * (b + 1), 2 * E + b)) * p
        ids = 8 * B * k + 8 * S + (8 * S if m.capacity_factor > 0 else 0) + (8 * S if self.ep > 1 else 0)
        if self.bf16:
            # the grouped experts keep one bf16 copy of their tokens; expert outputs are bf16,
            # their weights and the weighted outputs float32. (Not measured with ep: bf16 + ep
            # fails today in ExpertParallelExperts, a float32 buffer given bf16 expert outputs.)
            dispatched = S * h * 2
            combine = S * h * 2 + S * 4 + S * h * 4
        else:
            dispatched = S * h * self.x
            combine = (2 * S * h + S) * self.x
        if m.expert_kind == "gpt-oss":  # (fived.model.gpt_oss_experts: the clamped SwiGLU's saved tensors)
            experts = GPT_OSS_EXPERT_SAVES * m.expert_dim / T * S * self.x
        else:
            experts = 2 * m.expert_dim / T * S * self.x + 8 * E // self.ep
        shared = 4 * m.expert_dim * m.n_shared_experts / self.tp * self.B * self.x  # (a tp region: B tokens)
        aux = p + 8 * E
        return router + stats + ids + dispatched + experts + combine + shared + aux

    def _selective(self, moe: bool, blockwise: bool) -> float:
        m, B, h, T, a, kv, x = self.m, self.B, self.h, self.tp, self.a, self.kv, self.x
        total = self.Bs * h * self.r  # the block's input
        total += B * (self.q + 2 * kv + h) * x  # q, k, v projections; wo's partial output
        if (self.cp == 1 or self.u == self.cp) and not (self.documents or blockwise):
            # SDPA's output and log-sum-exp (the ring's and the blockwise tiles': recomputed)
            total += B * (self.q * x + a * self.f32)
        if not moe:
            return total + B * (2 * m.ffn_dim / T + h) * x
        S, (routed, split) = self._slots(), self._routed()
        total += routed * m.n_experts * x  # router logits
        total += S * (2 * m.expert_dim / split + h) * x
        if m.n_shared_experts:
            total += B * (2 * m.expert_dim * m.n_shared_experts / T + h) * x
        return total
