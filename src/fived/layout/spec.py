"""The sharding spec: for every parameter (and buffer) of a model, how each mesh dimension splits it,
written once, as data (torchtitan's parallelize plans as data; Megatron-Core's ShardedTensor for
where each piece lives).

`tensor_specs(m, tp=, ep=, sp=, etp=)` lists the model's tensors by canonical name with their whole shape
and, per dimension:
  - tp: which tensor dimension tensor parallelism cuts, into how many pieces, after padding it to
    what (the vocabulary, to a multiple of tp), and how many consecutive tp ranks hold each piece
    (kv heads when tp > n_kv_heads: rank r holds kv head r // (tp / n_kv_heads)); None: replicated,
    with `tp_partial_grad` when each tp rank still holds only part of its gradient (norms under SP,
    the MoE router, Qwen3's q/k norms);
  - ep: routed experts are cut along dim 0 (expert j of E on ep rank j // (E/ep)); folded (etp 1,
    Megatron-Core's MoE parallel folding) they are not cut by tp: ep then spans dp*cp*tp (`folded`),
    or with ep 1 each tp rank holds them whole with a partial gradient (its own tokens');
  - data parallelism: `shard_rows` (ZeRO-3: FSDP2's ceil-sized row chunks of dim 0) and
    `flat_range` (ZeRO-1/2: a range of one flat buffer of the other parameters, in model order,
    padded to a multiple of the shard group; with overlapped reductions `flat_buckets` cuts that
    buffer into buckets, each sharded alike), over dp_shard*cp, or for routed experts under ep over
    edp = dp*cp/ep (ZeRO-1/2 keep them whole, apart from the flat buffer);
  - pp: `fived.layout.stages` says which layers (and so which tensors) a pipeline rank holds.
The runtime splits its meta-device modules by it (`fived.parallel.tensor`, `.expert`), its
`Placement`s (checkpoints, `--init-from`, export, init) are computed from it, and the planner's
memory model and layer map read local shapes from it. Plain Python: no torch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import TypeVar

from fived.config import ModelConfig
from fived.layout.layout import Layout, keeps_flat_buffer
from fived.layout.stages import model_key, model_of


@dataclass(frozen=True)
class Cut:
    """Tensor dimension `dim`, padded to `padded` (0: not padded), cut into `pieces` equal chunks;
    `replicas` consecutive ranks of the mesh dimension hold each chunk."""

    dim: int
    pieces: int
    replicas: int = 1
    padded: int = 0

    def size(self, whole: int) -> int:
        return (self.padded or whole) // self.pieces

    def index(self, rank: int) -> int:
        return rank // self.replicas


@dataclass(frozen=True)
class TensorSpec:
    name: str  # canonical name (as one device's model names it)
    shape: tuple[int, ...]  # the whole tensor, without padding
    part: str  # "embedding", "layer" or "head"
    layer: int = -1  # the transformer layer holding it (-1: embedding, final norm, head)
    tp: Cut | None = None  # None: replicated over tp
    ep: Cut | None = None  # routed experts: dim 0 over ep
    expert: bool = False  # a routed expert's weight (data parallel over edp when ep > 1)
    tp_partial_grad: bool = False  # replicated over tp, but each tp rank holds part of its gradient
    buffer: bool = False  # not a parameter (the router's balancing bias): saved, never optimized
    # a routed expert folded over tp (etp 1, ep > 1): tp ranks hold other experts or edp replicas,
    # which the expert mesh numbers, not tp copies
    folded: bool = False

    def local_box(self, *, tp_rank: int = 0, ep_rank: int = 0) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offsets, sizes) of the tp/ep-local tensor in the (padded) whole tensor."""
        offsets, sizes = [0] * len(self.shape), list(self.shape)
        for cut, rank in ((self.ep, ep_rank), (self.tp, tp_rank)):
            if cut is not None:
                sizes[cut.dim] = cut.size(self.shape[cut.dim])
                offsets[cut.dim] = cut.index(rank) * sizes[cut.dim]
        return tuple(offsets), tuple(sizes)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return self.local_box()[1]

    def tp_replica(self, tp_rank: int) -> int:
        """Among the tp ranks holding the same piece, this rank's number (0: the copy that is saved)."""
        if self.folded:
            return 0
        return tp_rank if self.tp is None else tp_rank % self.tp.replicas

    @property
    def tp_summed(self) -> int:
        """Elements of this tensor's gradient summed over tp after backward, in one all-reduce
        (`fived.parallel.tensor.TensorParallel.finish_gradients`): all of a replicated tensor each tp
        rank holds part of the gradient of, every holder's slot of a kv head several tp ranks hold
        (0: none)."""
        if self.tp_partial_grad:
            return math.prod(self.local_shape)
        if self.tp is not None and self.tp.replicas > 1:
            return self.tp.pieces * math.prod(self.local_shape)
        return 0

    @property
    def splits(self) -> str:
        """The mesh dimensions that cut it, as the pages show them ("ep+tp", "tp", "")."""
        return "+".join(d for d, cut in (("ep", self.ep), ("tp", self.tp)) if cut is not None and cut.pieces > 1)


def _cut(dim: int, pieces: int, *, replicas: int = 1, padded: int = 0) -> Cut | None:
    return Cut(dim, pieces, replicas, padded) if pieces * replicas > 1 else None


def _kv_cut(m: ModelConfig, tp: int) -> Cut | None:
    """Fewer kv heads than tp ranks: each rank holds the one kv head its query heads use."""
    if m.n_kv_heads % tp == 0:
        return _cut(0, tp)
    return _cut(0, m.n_kv_heads, replicas=tp // m.n_kv_heads)


Count = TypeVar("Count", int, float)  # (positions: a whole cache's, or the planner's mean context)


def kv_width(m: ModelConfig, tp: int) -> int:
    """Rows of wk (and of wv) a tp rank holds: its share of the kv heads times the head size, or the
    one head its query heads use when tp > n_kv_heads."""
    cut, whole = _kv_cut(m, tp), m.n_kv_heads * m.head_dim
    return whole if cut is None else cut.size(whole)


def kv_cache_width(m: ModelConfig, tp: int) -> int:
    """Elements a tp rank caches per token and layer when decoding: the keys and the values of its kv
    heads, or for multi-head latent attention the normed kv latent and the shared rope key (whole on
    every rank: wkv_a is not cut), which `fived generate` up-projects each step as the reference does."""
    return m.kv_lora_rank + m.qk_rope_head_dim if m.is_mla else 2 * kv_width(m, tp)


def cached_positions(window: int, positions: Count) -> Count:
    """Positions one layer's decoding cache holds for a sequence of `positions`: a windowed layer's
    (`window` > 0, `ModelConfig.layer_window`) only its last `window`, since no query sees a key
    further back (`fived generate`'s rolling cache); a global layer's every one."""
    return min(window, positions) if window else positions


def kv_replicated(m: ModelConfig, tp: int) -> bool:
    """Whether several tp ranks hold the same kv head (their gradients are summed over tp)."""
    cut = _kv_cut(m, tp)
    return cut is not None and cut.replicas > 1


def layer_specs(
    m: ModelConfig, lid: int, *, tp: int = 1, ep: int = 1, sp: bool = False, etp: int = 0
) -> tuple[TensorSpec, ...]:
    """Transformer layer `lid`'s tensors. `etp`: the tensor-parallel size of the routed experts (0:
    tp, as fived runs them; the planner prices other runtimes' expert tensor parallelism)."""
    return _memoised_layer_specs(model_key(m), lid, tp, ep, bool(sp), etp)  # (sp 0 and False: one entry)


@functools.lru_cache(maxsize=16384)
def _memoised_layer_specs(key: tuple, lid: int, tp: int, ep: int, sp: bool, etp: int) -> tuple[TensorSpec, ...]:
    """`layer_specs`, built once per model, layer and sizes (the planner asks each layer's tensors of
    ~10^4 layouts' chunks; the specs are frozen, so one tuple serves every caller)."""
    m = model_of(key)
    return tuple(_layer_specs(m, lid if m.is_moe and lid >= m.n_dense_layers else -1, tp, ep, sp, etp or tp, lid))


def _layer_specs(m: ModelConfig, moe_id: int, tp: int, ep: int, sp: bool, etp: int, lid: int):
    pre = f"layers.{lid}."
    hd, d, heads = m.head_dim, m.dim, m.n_heads * m.head_dim

    def t(name, shape, cut=None, **kw):
        return TensorSpec(pre + name, tuple(shape), "layer", lid, cut, **kw)

    out = [t("attention_norm.weight", [d], tp_partial_grad=sp and tp > 1)]
    if m.is_mla:
        out += _latent_attention(t, m, tp)
    else:
        out += [
            t("attention.wq.weight", [heads, d], _cut(0, tp)),
            t("attention.wk.weight", [m.n_kv_heads * hd, d], _kv_cut(m, tp)),
            t("attention.wv.weight", [m.n_kv_heads * hd, d], _kv_cut(m, tp)),
            t("attention.wo.weight", [d, heads], _cut(1, tp)),
        ]
        out += _attention_extras(t, m, tp, sp)
    if m.qk_norm:  # shared by heads: each rank's heads give it a part of the gradient
        out += [t(f"attention.{n}.weight", [hd], tp_partial_grad=tp > 1) for n in ("q_norm", "k_norm")]
    # Gemma's post-norms run after the region's reduction, on SP's sequence shards as the pre-norms
    post = [t(f"{n}.weight", [d], tp_partial_grad=sp and tp > 1) for n in ("post_attention_norm", "post_ffn_norm")]
    out += post[:1] if m.post_norms else []
    out.append(t("ffn_norm.weight", [d], tp_partial_grad=sp and tp > 1))
    if moe_id < 0:
        out += _mlp(t, "feed_forward.", m.ffn_dim, d, tp)
        return tuple(out + (post[1:] if m.post_norms else []))
    e, f, by_ep = m.n_experts, m.expert_dim, _cut(0, ep)
    # folded (whole experts under tp > 1): each tp rank routes its own tokens through them
    fold = {"folded": ep > 1, "tp_partial_grad": ep == 1} if etp == 1 < tp else {}
    out += [
        t("feed_forward.router.weight", [e, d], tp_partial_grad=tp > 1),
        t("feed_forward.experts.w1", [e, d, f], _cut(2, etp), ep=by_ep, expert=True, **fold),
        t("feed_forward.experts.w3", [e, d, f], _cut(2, etp), ep=by_ep, expert=True, **fold),
        t("feed_forward.experts.w2", [e, f, d], _cut(1, etp), ep=by_ep, expert=True, **fold),
    ]
    if m.expert_kind == "gpt-oss":  # (the layout rules keep these experts whole over tp)
        out += [
            t("feed_forward.router.bias", [e], tp_partial_grad=tp > 1),
            t("feed_forward.experts.b1", [e, f], _cut(1, etp), ep=by_ep, expert=True, **fold),
            t("feed_forward.experts.b3", [e, f], _cut(1, etp), ep=by_ep, expert=True, **fold),
            t("feed_forward.experts.b2", [e, d], ep=by_ep, expert=True, **fold),
        ]
    if m.n_shared_experts:
        out += _mlp(t, "feed_forward.shared.", f * m.n_shared_experts, d, tp)
    out.append(t("feed_forward.router_bias", [e], buffer=True))
    return tuple(out + (post[1:] if m.post_norms else []))


def _attention_extras(t, m: ModelConfig, tp: int, sp: bool) -> list[TensorSpec]:
    """GPT-OSS's projection biases (q/k/v cut as their rows; wo's added after the heads' reduction,
    a partial gradient under SP as the norms) and per-head sink logits (cut as the heads)."""
    out = []
    if m.attention_bias:
        kv = m.n_kv_heads * m.head_dim
        out += [
            t("attention.wq.bias", [m.n_heads * m.head_dim], _cut(0, tp)),
            t("attention.wk.bias", [kv], _kv_cut(m, tp)),
            t("attention.wv.bias", [kv], _kv_cut(m, tp)),
            t("attention.wo_bias", [m.dim], tp_partial_grad=sp and tp > 1),
        ]
    if m.attention_sinks:
        out.append(t("attention.sinks", [m.n_heads], _cut(0, tp)))
    return out


def _latent_attention(t, m: ModelConfig, tp: int) -> list[TensorSpec]:
    """Multi-head latent attention (fived.model.latent_attention): the up-projections (wq_b or wq,
    wkv_b) cut by heads, wo by its input; the down-projections and their norms whole on every tp rank,
    each rank's heads giving them a part of their gradient (summed over tp, whether or not SP)."""
    d, heads, qk = m.dim, m.n_heads, m.qk_nope_head_dim + m.qk_rope_head_dim
    partial = {"tp_partial_grad": tp > 1}
    if m.q_lora_rank:
        query = [
            t("attention.wq_a.weight", [m.q_lora_rank, d], **partial),
            t("attention.q_norm.weight", [m.q_lora_rank], **partial),
            t("attention.wq_b.weight", [heads * qk, m.q_lora_rank], _cut(0, tp)),
        ]
    else:
        query = [t("attention.wq.weight", [heads * qk, d], _cut(0, tp))]
    return query + [
        t("attention.wkv_a.weight", [m.kv_lora_rank + m.qk_rope_head_dim, d], **partial),
        t("attention.kv_norm.weight", [m.kv_lora_rank], **partial),
        t("attention.wkv_b.weight", [heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank], _cut(0, tp)),
        t("attention.wo.weight", [d, heads * m.v_head_dim], _cut(1, tp)),
    ]


def _mlp(t, pre: str, hidden: int, d: int, tp: int) -> list[TensorSpec]:
    """SwiGLU: gate and up column-parallel (output features split), down row-parallel."""
    return [
        t(pre + "w1.weight", [hidden, d], _cut(0, tp)),
        t(pre + "w3.weight", [hidden, d], _cut(0, tp)),
        t(pre + "w2.weight", [d, hidden], _cut(1, tp)),
    ]


def end_specs(m: ModelConfig, *, first: bool, last: bool, tp: int = 1, sp: bool = False) -> tuple[TensorSpec, ...]:
    """The embedding (first stage), the final norm and the output head (last stage): vocab-parallel,
    the vocabulary padded to a multiple of tp. A tied head is the embedding itself."""
    vocab = _cut(0, tp, padded=padded_vocab(m, tp))
    out = []
    if first:
        out.append(TensorSpec("tok_embeddings.weight", (m.vocab_size, m.dim), "embedding", -1, vocab))
    if last:
        out.append(TensorSpec("norm.weight", (m.dim,), "head", -1, tp_partial_grad=sp and tp > 1))
        if not (m.tie_embeddings and first):
            out.append(TensorSpec("output.weight", (m.vocab_size, m.dim), "head", -1, vocab))
    return tuple(out)


def mtp_specs(m: ModelConfig, *, tp: int = 1, ep: int = 1, sp: bool = False, etp: int = 0) -> list[TensorSpec]:
    """Multi-token prediction's modules (fived.model.mtp), on the last stage after the head: module
    k's norms and 2d -> d projection replicated over tp (under SP each rank's sequence shard gives
    them a part of their gradient), and its block (layer n_layers + k: MoE in DeepSeek-V3) cut as a
    layer is."""
    out = []
    for k in range(m.mtp_depth):
        pre, lid, partial = f"mtp.{k}.", m.n_layers + k, sp and tp > 1
        out += [
            TensorSpec(pre + n, (m.dim,), "head", -1, tp_partial_grad=partial) for n in ("enorm.weight", "hnorm.weight")
        ]
        out.append(TensorSpec(pre + "eh_proj.weight", (m.dim, 2 * m.dim), "head", -1, tp_partial_grad=partial))
        block = layer_specs(m, lid, tp=tp, ep=ep, sp=sp, etp=etp)
        out += [dataclasses.replace(b, name=pre + "block." + b.name.removeprefix(f"layers.{lid}.")) for b in block]
        out.append(TensorSpec(pre + "norm.weight", (m.dim,), "head", -1, tp_partial_grad=partial))
    return out


def padded_vocab(m: ModelConfig, tp: int) -> int:
    return math.ceil(m.vocab_size / tp) * tp


def local_vocab(m: ModelConfig, tp: int) -> int:
    """Rows of the embedding and head (columns of the logits) a tp rank holds, padding included."""
    return padded_vocab(m, tp) // tp


def layout_specs(m: ModelConfig, layout: Layout) -> dict[str, TensorSpec]:
    """`tensor_specs` of the model under `layout` (its tp, ep, sp and etp): the runtime's one call."""
    return tensor_specs(m, tp=layout.tp, ep=layout.ep, sp=layout.sp, etp=layout.etp)


def chunk_specs(
    m: ModelConfig, layers, first: bool, last: bool, *, tp: int = 1, ep: int = 1, sp: bool = False, etp: int = 0
) -> list[TensorSpec]:
    """The tensors of a model chunk (a pipeline stage, or the whole model), in the model's order."""
    ends = end_specs(m, first=first, last=last, tp=tp, sp=sp)
    out = [s for s in ends if s.part == "embedding"]
    for lid in layers:
        out += layer_specs(m, lid, tp=tp, ep=ep, sp=sp, etp=etp)
    return out + [s for s in ends if s.part == "head"] + (mtp_specs(m, tp=tp, ep=ep, sp=sp, etp=etp) if last else [])


def tensor_specs(m: ModelConfig, *, tp: int = 1, ep: int = 1, sp: bool = False, etp: int = 0) -> dict[str, TensorSpec]:
    """Every tensor of the whole model by canonical name."""
    return {s.name: s for s in chunk_specs(m, range(m.n_layers), True, True, tp=tp, ep=ep, sp=sp, etp=etp)}


# --- data parallelism: how a ZeRO stage stores a tensor's local piece ------------------------------

# ZeRO-0/1/2's flat gradients held in bf16 and summed in float32 are cast and reduced this many
# elements at a time (64 MiB of float32): the runtime's piece and the planner's transient buffer.
REDUCE_CHUNK_ELEMENTS = 2**24
# With overlapped reductions (parallel.overlap_grad_reduce) at most this many such cast pieces are in
# flight at once: a further one first completes the oldest.
CAST_PIECES_IN_FLIGHT = 2


def shard_rows(dim0: int, shards: int, index: int) -> tuple[int, int]:
    """Rows [a, b) of a first dimension that ZeRO-3 (FSDP2) gives shard `index` of `shards`:
    ceil-sized chunks, the last ones shorter or empty."""
    chunk = math.ceil(dim0 / shards)
    a = min(dim0, index * chunk)
    return a, min(dim0, a + chunk)


def flat_range(total: int, shards: int, index: int) -> tuple[int, int]:
    """Elements [a, b) of a flat buffer of `total` elements, padded to a multiple of `shards`, that
    shard `index` owns (ZeRO-1/2), clipped to the real elements."""
    length = math.ceil(total / shards)
    return min(total, index * length), min(total, (index + 1) * length)


@dataclass(frozen=True)
class FlatBucket:
    """Parameters [first, last) of a flat buffer, at elements [start, start + shards * piece): the
    bucket is padded to a multiple of the shard group and shard r owns [start + r*piece, +piece)."""

    first: int
    last: int
    start: int
    piece: int

    def owned(self, index: int) -> tuple[int, int]:
        return self.start + index * self.piece, self.start + (index + 1) * self.piece


def flat_buckets(numels: list[int], shards: int, cap: int | None) -> list[FlatBucket]:
    """ZeRO-1/2's flat buffer (parameters in model order) cut at parameter boundaries into buckets of
    at least `cap` elements (the last may be smaller), each sharded on its own, as Megatron-Core's
    distributed optimizer does, so a bucket can be reduced as soon as backward has produced it.
    `cap=None`: one bucket, whose shards are `flat_range`'s."""
    buckets, first, size, start = [], 0, 0, 0
    for i, n in enumerate(numels):
        size += n
        if (cap is not None and size >= cap) or i == len(numels) - 1:
            piece = math.ceil(size / shards)
            buckets.append(FlatBucket(first, i + 1, start, piece))
            first, size, start = i + 1, 0, start + piece * shards
    return buckets


def flat_owned(numels: list[int], shards: int, index: int, cap: int | None) -> int:
    """Real (unpadded) elements shard `index` owns of the flat buffer `flat_buckets` lays out."""
    owned = 0
    for bucket in flat_buckets(numels, shards, cap):
        real = sum(numels[bucket.first : bucket.last])
        owned += max(0, min(real, (index + 1) * bucket.piece) - min(real, index * bucket.piece))
    return owned


def in_flat_buffer(spec: TensorSpec, ep: int) -> bool:
    """Whether ZeRO-0/1/2's flat buffer holds `spec`: every parameter but the routed experts under
    ep > 1, which stay apart (data parallel over edp)."""
    return not spec.buffer and not (spec.expert and ep > 1)


class FlatLayout:
    """ZeRO-1/2's flat buffer (and ZeRO-0's under a pipeline, `shards` = 1): the parameters `names`
    of `numels` elements one after another, cut into `flat_buckets` of `cap`, each sharded on its own."""

    def __init__(self, names: list[str], numels: list[int], shards: int, cap: int | None):
        self.names, self.numels, self.shards = list(names), list(numels), shards
        self.index = {name: i for i, name in enumerate(self.names)}
        self.buckets = flat_buckets(self.numels, shards, cap)
        self.bucket_of = [k for k, bucket in enumerate(self.buckets) for _ in range(bucket.first, bucket.last)]
        self.offsets = []  # where each parameter starts in the buffer
        for bucket in self.buckets:
            self.offsets += [
                bucket.start + sum(self.numels[bucket.first : i]) for i in range(bucket.first, bucket.last)
            ]

    def owned(self, name: str, shard: int) -> tuple[int, int]:
        """Elements [a, b) of parameter `name`'s flat view that shard `shard` owns (a == b: none)."""
        i = self.index[name]
        lo, hi = self.buckets[self.bucket_of[i]].owned(shard)
        n, offset = self.numels[i], self.offsets[i]
        a = min(max(lo - offset, 0), n)
        return a, max(min(hi - offset, n), a)

    def owners(self, name: str, a: int, b: int) -> list[tuple[int, int]]:
        """(shard, elements) for elements [a, b) of parameter `name`'s flat view, by the shards owning
        them (each shard's range is contiguous: a division finds them)."""
        i = self.index[name]
        bucket = self.buckets[self.bucket_of[i]]
        lo, hi = self.offsets[i] - bucket.start + a, self.offsets[i] - bucket.start + b
        shards = range(lo // bucket.piece, (hi - 1) // bucket.piece + 1) if hi > lo else range(0)
        return [(r, min(hi, (r + 1) * bucket.piece) - max(lo, r * bucket.piece)) for r in shards]


@dataclass(frozen=True)
class Stored:
    """How one rank stores its tp/ep-local piece of a tensor: ZeRO-3 rows [a, b), or ZeRO-1/2 elements
    [a, b) of its flat view, or (both None) all of it; `replica` numbers the data-parallel ranks
    storing the same part (0: the copy that is saved); `slot` tells the distinct parts apart (the
    shard index the rows or range are cut by, 0 when whole)."""

    rows: tuple[int, int] | None
    flat: tuple[int, int] | None
    replica: int
    slot: int


@dataclass(frozen=True)
class DataRank:
    """A rank's place in data parallelism, as the storage rules (`stored`) read it: the runtime's
    strategies (`fived.parallel.make_data_parallel`) build it from their mesh, Muon's plan
    (`fived.layout.muon_plan`) from any rank's mesh coordinates."""

    zero: int
    pp: int
    ep: int
    dp_cp_size: int  # dp * cp
    shards: int  # dp_shard * cp: the ZeRO shard group
    shard: int  # this rank's index in it
    replicate: int  # its index in dp_replicate
    dp_cp: int  # its index in dp * cp
    # the expert mesh: ep x edp cut `Layout.expert_ranks` ranks (dp*cp, or dp*cp*tp folded); `edp` is
    # `Layout.edp`; this rank's index among them is ep rank expert_index % ep, edp rank expert_index // ep
    edp: int
    expert_index: int

    @property
    def flat_buffer(self) -> bool:
        return keeps_flat_buffer(self.zero, self.pp, self.dp_cp_size)

    def whole_replica(self, spec: TensorSpec) -> int:
        """The replica index of a tensor every data-parallel rank holds whole (routed experts under
        ep > 1: every edp rank), as buffers always are."""
        if spec.expert and self.ep > 1:
            return self.expert_index // self.ep
        return 0 if self.dp_cp_size == 1 else self.dp_cp

    def stored(self, spec: TensorSpec, flat: FlatLayout | None = None) -> Stored:
        """How this rank stores `spec`'s local piece (`flat`: the stage's flat buffer, when it has one)."""
        apart = spec.expert and self.ep > 1  # routed experts: data parallel over edp only
        if self.zero == 3:
            # FSDP2: rows over the shard group (experts: over edp), HSDP replicas across
            shards, index = (self.edp, self.expert_index // self.ep) if apart else (self.shards, self.shard)
            return Stored(shard_rows(spec.local_shape[0], shards, index), None, self.replicate, index)
        if apart or not self.flat_buffer:
            return Stored(None, None, self.whole_replica(spec), 0)
        assert flat is not None  # (the stage's flat buffer: a rank that keeps one is handed it)
        if self.zero == 0:  # the flat buffer unsharded, repeated on every dp*cp rank
            return Stored(None, flat.owned(spec.name, 0), self.dp_cp, 0)
        return Stored(None, flat.owned(spec.name, self.shard), self.replicate, self.shard)
