"""The ledger: measured bytes, so that memory claims are checked, not assumed. (Communication is
measured by `fived.parallel.comm`, the layer fived's collectives go through.)

- `model_state_bytes` measures the bytes of parameters, gradients and optimizer state this rank holds.
- `ActivationLedger` measures the bytes saved for backward per micro-batch by each transformer
  layer, the embedding and the head (final norm, output projection, loss), inside pipeline
  schedules too, so activation memory is a measured figure (`fived.layout.activation_model` predicts it).
"""

from __future__ import annotations

import functools
from collections import defaultdict

import torch

from fived.model.transformer import Transformer


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def _storage_ptr(t: torch.Tensor) -> int:
    try:
        return local_tensor(t).untyped_storage().data_ptr()
    except RuntimeError:  # a sharded parameter whose gathered storage is freed right now
        return -1


def held_bytes(tensors) -> int:
    """Bytes of memory the tensors occupy, each byte once: views of one buffer (flat ZeRO buffers,
    parameters and their optimizer slices) are merged by storage and byte range."""
    ranges: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for t in tensors:
        t = local_tensor(t)
        if t.numel() == 0:
            continue
        start = t.storage_offset() * t.element_size()
        ranges[t.untyped_storage().data_ptr()].append((int(start), int(start + _nbytes(t))))
    total = 0
    for spans in ranges.values():
        end = -1
        for a, b in sorted(spans):
            if b > end:
                total += b - max(a, end)
                end = b
    return total


def model_state_bytes(tensors: dict[str, list[torch.Tensor]]) -> dict[str, int]:
    """{"params", "grads", "optimizer"} -> bytes this rank holds (local shards only, views once)."""
    return {kind: held_bytes(ts) for kind, ts in tensors.items()}


# Autograd nodes that only view or cast their input: a saved tensor reached from a parameter
# through these is that weight (a transpose for a matmul, one expert's slice, an autocast copy).
_WEIGHT_VIEWS = {
    "TBackward0",
    "TransposeBackward0",
    "TransposeBackward1",
    "PermuteBackward0",
    "ViewBackward0",
    "UnsafeViewBackward0",
    "SelectBackward0",
    "SliceBackward0",
    "ExpandBackward0",
    "AsStridedBackward0",
    "AliasBackward0",
    "ToCopyBackward0",
    "UnsqueezeBackward0",
    "SqueezeBackward0",
    "SqueezeBackward1",
    "ReshapeAliasBackward0",
}


def _is_weight(t: torch.Tensor) -> bool:
    """A parameter, or a view / dtype cast of one (e.g. the bf16 copy autocast makes of a weight)."""
    if isinstance(t, torch.nn.Parameter):
        return True
    node = t.grad_fn
    while node is not None and type(node).__name__ in _WEIGHT_VIEWS:
        edges = [f for f, _ in node.next_functions if f is not None]
        if len(edges) != 1:
            return False
        node = edges[0]
    return node is not None and isinstance(getattr(node, "variable", None), torch.nn.Parameter)


class ActivationLedger:
    """Bytes saved for backward per micro-batch, by part of the model: each transformer layer (keyed
    by its id), "embedding" (the token embedding) and "head" (final norm, output projection and the
    loss), over every model chunk (pipeline stage) this rank holds.

    What counts is what autograd keeps: tensors passed to the saved-tensor pack hook
    (`ParallelPlan.forward_context`; sequence-parallel shards as stored, not as gathered), the
    inputs activation checkpointing keeps, and the op outputs selective checkpointing caches (read
    from its cache after each block). Weights (parameters, and views or autocast copies of them)
    are not activations and are skipped; views of one buffer count once per key and micro-batch.

    Without a pipeline the trainer records the first micro-batch's forward. Under a pipeline
    schedule (`watch_stages`) every micro-batch of a step is recorded, each forward attributed to
    the micro-batch index the schedule runs (`forward_one_chunk`), and the figure per key is the mean
    over the micro-batches; forwards the schedule runs outside `forward_one_chunk` (its shape
    inference on the first step) are not counted. A part's tensors are counted as soon as its
    forward ends (the head's with its loss) and let go of, so recording holds no extra memory.
    """

    def __init__(self, chunks):
        chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
        self.recording = False
        self.layer: str | None = None  # the part running now: a layer id, "embedding", "head"
        self.micro: int | None = None  # the micro-batch whose forward runs now (None: do not count)
        self.gated = False  # True under a pipeline schedule: only forward_one_chunk's forwards count
        self._weights: set[int] = set()
        self._saved: dict[tuple[str, int], list[torch.Tensor]] = defaultdict(list)  # the part running now
        self._bytes: dict[str, list[int]] = defaultdict(list)  # per part: bytes of each micro-batch seen
        self._sac: list = []  # selective checkpointing caches of the block running now
        self.per_layer: dict[str, int] = {}
        # Set to {} before recording to keep, per part, (shape, dtype, bytes, storage) of each saved tensor.
        self.detail: dict[str, list[tuple]] | None = None
        for chunk in chunks:
            self._watch(chunk)

    # hooks -----------------------------------------------------------------------------------
    def _watch(self, chunk: Transformer) -> None:
        emb = chunk.tok_embeddings
        if emb is not None:
            emb.register_forward_pre_hook(lambda m, args: self._enter("embedding", m))
            emb.register_forward_hook(lambda m, args, out: self._leave())
        for name, block in chunk.layers.items():
            block.register_forward_pre_hook(lambda m, args, name=name: self._enter(name, m))
            block.register_forward_hook(lambda m, args, out: self._leave())
            self._watch_selective_cache(block)
        if chunk.norm is not None:
            # The head runs from the final norm to the loss, which the trainer computes outside the
            # model: it stays the current part until the next one starts or `leave` is called.
            chunk.norm.register_forward_pre_hook(lambda m, args, c=chunk: self._enter("head", c, head=True))

    def _watch_selective_cache(self, block: torch.nn.Module) -> None:
        """Selective checkpointing keeps op outputs in a cache of its own, not through saved-tensor
        hooks: wrap the block's context_fn to see that cache, read after the block's forward."""
        fn = getattr(block, "checkpoint_fn", None)
        context_fn = getattr(fn, "keywords", {}).get("context_fn") if fn is not None else None
        if fn is None or context_fn is None:
            return

        def seen_context_fn():
            contexts = context_fn()
            storage = getattr(contexts[0], "storage", None)
            if storage is not None and self.recording:
                self._sac.append(storage)
            return contexts

        wrapped = functools.partial(fn.func, *fn.args, **{**fn.keywords, "context_fn": seen_context_fn})
        setattr(block, "checkpoint_fn", wrapped)  # noqa: B010  (torch's wrapper reads it: no typed attribute)

    def _enter(self, name: str, module: torch.nn.Module, head: bool = False) -> None:
        self.layer, self._sac = name, []
        if self.recording:  # weights (and views of them, e.g. transposes) are saved too; not activations
            parts = [module]
            if head:  # (the chunk: its final norm and output head)
                assert isinstance(module, Transformer)
                parts = [part for part in (module.norm, module.output) if part is not None]
            params = [p for part in parts for p in part.parameters()]
            self._weights = {_storage_ptr(p) for p in params}

    def _leave(self) -> None:
        if self.recording and self._sac:
            for storage in self._sac:
                for entries in list(storage.values()):
                    for entry in list(entries.values()) if isinstance(entries, dict) else list(entries):
                        for item in _flatten(entry):
                            val = getattr(item, "val", item)
                            if isinstance(val, torch.Tensor):
                                self.note(val)
        self._count()
        self.layer, self._sac = None, []

    def _count(self) -> None:
        """Count the finished parts' tensors and let go of them (under a pipeline schedule they would
        otherwise outlive their backward: every micro-batch of the step would stay in memory)."""
        for (name, _), ts in sorted(self._saved.items(), key=lambda kv: (_order(kv[0][0]), kv[0][1])):
            self._bytes[name].append(held_bytes(ts))
            if self.detail is not None and name not in self.detail:  # the first micro-batch's tensors
                self.detail[name] = [(tuple(t.shape), t.dtype, _nbytes(t), _storage_ptr(t)) for t in ts]
        self._saved = defaultdict(list)

    def leave(self) -> None:
        """The current part is done (the trainer calls this after the loss)."""
        self._leave()

    def watch_stages(self, stages) -> None:
        """Under a pipeline schedule: count a forward only when the schedule runs it for a
        micro-batch (the loss that follows belongs to that micro-batch too)."""
        self.gated = True
        for stage in stages:
            real = stage.forward_one_chunk

            def forward_one_chunk(chunk_id, *args, _real=real, **kwargs):
                self.layer, self.micro = None, chunk_id
                return _real(chunk_id, *args, **kwargs)

            stage.forward_one_chunk = forward_one_chunk

    def note(self, t: torch.Tensor) -> None:
        if not self.recording or self.layer is None or self.micro is None:
            return
        if _storage_ptr(t) in self._weights or _is_weight(t):
            return
        self._saved[(self.layer, self.micro)].append(t)

    # recording -------------------------------------------------------------------------------
    def start(self) -> None:
        self.recording, self._saved, self._bytes, self.per_layer = True, defaultdict(list), defaultdict(list), {}
        self.layer, self.micro = None, (None if self.gated else 0)

    def stop(self) -> None:
        """The figure per part: the mean of its micro-batches' bytes."""
        self._count()
        self.recording = False
        self.per_layer = {
            name: round(sum(v) / len(v)) for name, v in sorted(self._bytes.items(), key=lambda kv: _order(kv[0]))
        }
        self._bytes, self.layer, self.micro, self._sac = defaultdict(list), None, None, []


def _order(name: str) -> tuple:
    """embedding, layers by id, head."""
    return (0, 0) if name == "embedding" else (2, 0) if name == "head" else (1, int(name))


def _flatten(entry):
    if isinstance(entry, (list, tuple)):
        for e in entry:
            yield from _flatten(e)
    else:
        yield entry
