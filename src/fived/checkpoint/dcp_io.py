"""Tensors in and out of `torch.distributed.checkpoint` (DCP) by their placements.

DCP already reshards: every saved tensor is recorded as chunks (offset and size in the whole tensor),
and a load reads, for each chunk a rank asks for, the overlapping parts of the saved ones. What DCP
cannot describe by itself is fived's storage: a ZeRO-1/2 slice is a flat range of a parameter (not a
rectangle), a vocabulary shard may run into padding, kv heads and replicated tensors have several
holders. `ShardedValue` hands DCP exactly the rectangles a rank holds (a flat range becomes a few
contiguous boxes), written only by the replica that saves them.

Safety: tensor data is read by DCP with `torch.load(weights_only=True)`; DCP's `.metadata` file is a
pickle, read here by an unpickler that admits only DCP's own metadata classes. Nothing else is
unpickled: non-tensor state goes to a JSON file beside (see fived.checkpoint.checkpointer).
"""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from fived.layout.placement import Box


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is: one line saying what and where."""


class ShardedValue:
    """One tensor as DCP sees it: its whole shape and this rank's boxes of it (views into live
    storage, or into a staged copy). `write` is False on replicas that hold the same boxes as a
    saving rank."""

    def __init__(
        self, global_shape: tuple[int, ...], boxes: list[tuple[Box, torch.Tensor]], write: bool, dtype: torch.dtype
    ):
        self.global_shape, self.boxes, self.write, self.dtype = tuple(global_shape), boxes, write, dtype

    def size(self) -> torch.Size:
        return torch.Size(self.global_shape)

    def __create_write_items__(self, fqn: str, _obj) -> list[WriteItem]:
        if not self.write:
            return []
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(box.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=_chunk(box), properties=TensorProperties(dtype=self.dtype), size=self.size()
                ),
            )
            for box, _ in self.boxes
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [_chunk(box) for box, _ in self.boxes]

    def box_at(self, offsets) -> torch.Tensor:
        for box, view in self.boxes:
            if tuple(box.offsets) == tuple(offsets):
                return view
        raise KeyError(f"no box at {tuple(offsets)}")

    def staged(self, previous: ShardedValue | None = None) -> ShardedValue:
        """A copy on CPU, so that training may go on changing the original while it is written; into
        `previous`'s memory when it has the same boxes (no new allocation, no page faults)."""
        if not self.write:
            return ShardedValue(self.global_shape, [], False, self.dtype)
        reuse = previous is not None and [(b, v.shape, v.dtype) for b, v in previous.boxes] == [
            (b, v.shape, v.dtype) for b, v in self.boxes
        ]
        copies = []
        for i, (box, view) in enumerate(self.boxes):
            target = (
                previous.boxes[i][1]
                if reuse and previous is not None
                else torch.empty(view.shape, dtype=view.dtype, pin_memory=view.is_cuda)
            )  # pinned: fast copies from a GPU
            copies.append((box, target.copy_(view.detach(), non_blocking=view.is_cuda)))
        if any(view.is_cuda for _, view in self.boxes):
            torch.cuda.synchronize()
        return ShardedValue(self.global_shape, copies, True, self.dtype)


def _chunk(box: Box) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes))


class _SavePlanner(DefaultSavePlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex):
        value = self.state_dict[index.fqn]
        return value.box_at(index.offset).detach().cpu()


class _LoadPlanner(DefaultLoadPlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict, metadata=None, is_coordinator: bool = False) -> None:
        # As the default planner without flattening, minus its pass that materialises meta tensors
        # (it replaces any value it does not know, such as a ShardedValue, by None).
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn].box_at(index.offset)

    def load_bytes(self, read_item, value) -> None:
        # DCP would torch.load(weights_only=False) them: fived never saves bytes, and never loads them.
        raise CheckpointError(
            f"checkpoint entry {read_item.dest_index.fqn} holds pickled bytes, which fived does not load"
        )


class Stager:
    """dcp.async_save's staging step: copy every box this rank writes (the only part that stalls
    training), then DCP writes the copies from a background thread. The copies are kept for the next
    save, which copies into memory already allocated (as DCP's cached staging and torchtitan do):
    after the first save, staging costs one memory copy of this rank's shards. The caller must not
    stage again before the previous save is written."""

    should_synchronize_after_execute = False
    _synchronize_after_execute = False  # (what torch's AsyncStager protocol reads it from)

    def __init__(self):
        self.copies: dict[str, ShardedValue] = {}

    def stage(self, state_dict: dict) -> dict:
        self.copies = {k: v.staged(self.copies.get(k)) for k, v in state_dict.items()}
        return self.copies

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def save(values: dict[str, ShardedValue], path: str | Path, group=None, stager: Stager | None = None):
    """Write `values` under `path` (every rank of `group` calls this). With a `stager`, return a
    Future once the boxes are staged; DCP writes them from a thread over `group` (which must then be
    a group no other thread uses, e.g. its own gloo group)."""
    writer = dcp.FileSystemWriter(str(path), sync_files=True)
    if stager is not None:
        return dcp.async_save(
            values, storage_writer=writer, planner=_SavePlanner(), process_group=group, async_stager=stager
        )
    dcp.save(values, storage_writer=writer, planner=_SavePlanner(), process_group=group)
    return None


def load(values: dict[str, ShardedValue], path: str | Path, group=None) -> None:
    """Fill each value's boxes in place from the checkpoint at `path`, whatever layout wrote it. Every
    value must be a tensor of the same whole shape there (checked before anything is read)."""
    check_tensors(path, {name: value.global_shape for name, value in values.items()})
    dcp.load(values, storage_reader=SafeReader(str(path)), planner=_LoadPlanner(), process_group=group)


def check_tensors(path: str | Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """Raise CheckpointError unless the checkpoint at `path` holds each name as a tensor of that shape."""
    saved = tensor_shapes(path)
    for name, shape in shapes.items():
        if name not in saved:
            raise CheckpointError(f"{name} is missing from the checkpoint {path}")
        if saved[name] != tuple(shape):
            raise CheckpointError(f"{name} has shape {list(saved[name])} in the checkpoint {path}, {list(shape)} here")


def read_whole(path: str | Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors of a checkpoint, whole, in this process (no process group), whatever layout
    wrote them: DCP reads the pieces of each."""
    metadata = SafeReader(str(path)).read_metadata().state_dict_metadata
    out, values = {}, {}
    for name in names:
        md = metadata[name]
        out[name] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        whole = Box((0,) * len(md.size), tuple(md.size))
        values[name] = ShardedValue(tuple(md.size), [(whole, out[name])], True, out[name].dtype)
    with warnings.catch_warnings():  # ("assuming the intent is to load in a single process": it is)
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(values, storage_reader=SafeReader(str(path)), planner=_LoadPlanner(), no_dist=True)
    return out


def tensor_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Whole shape of every tensor saved at `path` (no process group needed)."""
    metadata = SafeReader(str(path)).read_metadata()
    return {name: tuple(md.size) for name, md in metadata.state_dict_metadata.items()}


# Everything DCP's metadata pickle names (checked against torch 2.13's files); nothing else loads.
_METADATA_GLOBALS = {
    *(
        ("torch.distributed.checkpoint.metadata", n)
        for n in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's metadata classes, torch dtypes and sizes; any other global is refused."""

    def find_class(self, module: str, name: str):
        allowed = (module, name) in _METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        )
        if not allowed:
            raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which fived does not load")
        return super().find_class(module, name)


class SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, TypeError) as e:
            raise CheckpointError(f"{path}: not a readable checkpoint index ({e})") from None
        if not isinstance(metadata, Metadata) or not all(
            isinstance(md, TensorStorageMetadata) for md in metadata.state_dict_metadata.values()
        ):
            raise CheckpointError(f"{path}: holds entries other than tensors, which fived does not load")
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
