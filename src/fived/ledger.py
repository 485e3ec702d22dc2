"""The ledger: measured bytes, so that memory and communication claims are checked, not assumed.

- `CommLedger` counts every collective issued through `torch.distributed` while it is active (ours,
  and those of DDP/FSDP2, which call the same functions), keyed by (mesh dimension, collective).
  It wraps the real functions and calls them; nothing is simulated.
- `model_state_bytes` measures the bytes of parameters, gradients and optimizer state this rank holds.
- `ActivationLedger` measures the bytes each transformer layer saves for backward (saved-tensor
  hooks), so activation memory is a measured figure.

Payload bytes per call are counted as: all_reduce / broadcast / send / recv the tensor itself;
all_gather_into_tensor the gathered output; reduce_scatter_tensor the full input; all_to_all_single
the input. Mesh dimensions are named by `Mesh.group_names`; any other group is named by its ranks.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
import torch.distributed as dist

_TRACKED = {
    # name: (index of the tensor whose bytes count, keyword of that tensor)
    "all_reduce": (0, "tensor"),
    "broadcast": (0, "tensor"),
    "all_gather_into_tensor": (0, "output_tensor"),
    "all_gather_single": (0, "output_tensor"),
    "reduce_scatter_tensor": (1, "input"),
    "reduce_scatter_single": (1, "input"),
    "all_to_all_single": (1, "input"),
    "send": (0, "tensor"),
    "recv": (0, "tensor"),
}
# isend/irecv are not wrapped: P2POp checks their identity. Batched point-to-point (pipeline
# stages) is counted from batch_isend_irecv's ops instead.


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CommLedger:
    def __init__(self, group_names: dict | None = None):
        self.group_names = dict(group_names or {})
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self._depth = 0

    def _dim(self, group) -> str:
        ranks = _ranks(dist.group.WORLD if group is None else group)
        for g, name in self.group_names.items():
            if len(_ranks(g)) > 1 and _ranks(g) == ranks:
                return name
        return "ranks" + "-".join(map(str, ranks))

    def record(self, op: str, group, nbytes: int) -> None:
        key = (self._dim(group), op)
        self.bytes[key] += nbytes
        self.calls[key] += 1

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def summary(self) -> dict[str, dict[str, int]]:
        """{"dp/all_reduce": {"bytes": .., "calls": ..}, ...}"""
        return {f"{d}/{op}": {"bytes": self.bytes[(d, op)], "calls": self.calls[(d, op)]}
                for d, op in sorted(self.bytes)}

    @contextlib.contextmanager
    def track(self):
        """Count collectives issued through torch.distributed inside the block."""
        originals = {name: getattr(dist, name) for name in _TRACKED}

        def wrap(name, real):
            index, keyword = _TRACKED[name]

            def counted(*args, **kwargs):
                if self._depth:  # a deprecated name calling its replacement: count once
                    return real(*args, **kwargs)
                tensor = kwargs.get(keyword, args[index] if len(args) > index else None)
                group = kwargs.get("group", _positional_group(name, args))
                if tensor is not None:
                    self.record(name, group, _nbytes(tensor))
                self._depth += 1
                try:
                    return real(*args, **kwargs)
                finally:
                    self._depth -= 1

            return counted

        real_batch = dist.batch_isend_irecv

        def counted_batch(ops):
            for op in ops:
                kind = "send" if op.op is dist.distributed_c10d.isend else "recv"
                self.record(kind, op.group, _nbytes(op.tensor))
            return real_batch(ops)

        for name, real in originals.items():
            setattr(dist, name, wrap(name, real))
        dist.batch_isend_irecv = counted_batch
        try:
            yield self
        finally:
            for name, real in originals.items():
                setattr(dist, name, real)
            dist.batch_isend_irecv = real_batch


def _positional_group(name: str, args: tuple):
    # Positional group argument index in torch.distributed's signatures.
    index = {"all_reduce": 2, "broadcast": 2, "all_gather_into_tensor": 2, "all_gather_single": 2,
             "reduce_scatter_tensor": 3, "reduce_scatter_single": 3,
             "all_to_all_single": 4, "send": 2, "recv": 2}[name]
    return args[index] if len(args) > index else None


def _ranks(group) -> tuple[int, ...]:
    if group is None or not dist.is_initialized():
        return ()
    return tuple(dist.get_process_group_ranks(group))


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
        ranges[t.untyped_storage().data_ptr()].append((start, start + _nbytes(t)))
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


class ActivationLedger:
    """Bytes saved for backward per transformer layer during one recorded forward pass.

    Parameters are not activations and are skipped; views of one buffer count once."""

    def __init__(self, model: torch.nn.Module):
        self.recording = False
        self.layer: str | None = None
        self._saved: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.per_layer: dict[str, int] = {}
        self._weights: set[int] = set()
        for name, block in model.layers.items():
            block.register_forward_pre_hook(lambda m, args, name=name: self._enter(name, m))
            block.register_forward_hook(lambda m, args, out: setattr(self, "layer", None))

    def _enter(self, name: str, block: torch.nn.Module) -> None:
        self.layer = name
        if self.recording:  # weights (and views of them, e.g. transposes) are saved too; not activations
            self._weights = {_storage_ptr(p) for p in block.parameters()}

    def note(self, t: torch.Tensor) -> None:
        if self.recording and self.layer is not None and t.untyped_storage().data_ptr() not in self._weights:
            self._saved[self.layer].append(t)

    def start(self) -> None:
        self.recording, self._saved, self.per_layer = True, defaultdict(list), {}

    def stop(self) -> None:
        """Count what the recorded forward saved, and let go of the tensors."""
        self.recording = False
        self.per_layer = {name: held_bytes(ts) for name, ts in self._saved.items()}
        self._saved = defaultdict(list)
