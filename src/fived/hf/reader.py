"""A Hugging Face model directory's safetensors, read one box at a time.

`safe_open(...).get_slice(name)[slices]` reads only the requested rows and columns, so a rank that
holds a quarter of a tensor reads about a quarter of it. A sharded checkpoint's
`model.safetensors.index.json` says which file holds each tensor; without one every `*.safetensors`
file in the directory is listed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fived.hf.names import Source


class HfCheckpoint:
    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._headers: dict[Path, object] = {}  # open handles, for names and shapes only (no data read)
        index = self.directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: self.directory / file for name, file in weight_map.items()}
        else:
            self.files = {}
            for path in sorted(self.directory.glob("*.safetensors")):
                for name in self._header(path).keys():  # noqa: SIM118  (safetensors' safe_open is no iterable)
                    self.files[name] = path

    def _header(self, path: Path):
        from safetensors import safe_open

        if path not in self._headers:
            self._headers[path] = safe_open(str(path), framework="pt")
        return self._headers[path]

    def names(self) -> set[str]:
        return set(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._header(self.files[name]).get_slice(name).get_shape())

    def read(self, name: str, offsets, sizes) -> torch.Tensor:
        """The box [offsets, offsets + sizes) of tensor `name`, copied out of the file's mapping."""
        from safetensors import safe_open

        # A handle per read: the slice is a view of the mapped file, and the pages it touched stay
        # in this process's memory until the mapping goes; this way they go with each tensor.
        with safe_open(str(self.files[name]), framework="pt") as f:
            part = f.get_slice(name)
            return part[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].clone()

    def read_box(self, source: Source, offsets, sizes) -> torch.Tensor:
        """The box of a fived tensor: read directly, or gathered from the per-expert tensors it stacks
        (fived's [E, a, b] is expert e's Hugging Face [b, a] transposed)."""
        if source.name:
            return self.read(source.name, offsets, sizes)
        first, count = offsets[0], sizes[0]
        parts = [
            self.read(source.per_expert.format(e=e), (offsets[2], offsets[1]), (sizes[2], sizes[1])).t()
            for e in range(first, first + count)
        ]
        return torch.stack(parts)
