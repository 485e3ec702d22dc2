"""A Hugging Face model directory's safetensors, read one box at a time.

`safe_open(...).get_slice(name)[slices]` reads only the requested rows and columns, so a rank that
holds a quarter of a tensor reads about a quarter of it. A sharded checkpoint's
`model.safetensors.index.json` says which file holds each tensor; without one every `*.safetensors`
file in the directory is listed.

DeepSeek-V3's released weights are FP8 (e4m3) with one float32 `<name>_scale_inv` per 128 x 128
block (config.json's quantization_config.weight_block_size): a box is dequantised as it is read,
weight x the scale of its block, in float32, from the blocks the box touches only.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fived.errors import ConfigError
from fived.hf.names import Source

SCALE_SUFFIX = "_scale_inv"  # (DeepSeek's FP8 checkpoints: "<...>.weight_scale_inv" per weight)


class HfCheckpoint:
    def __init__(self, directory: str | Path, *, field: str = "source"):
        self.directory, self.field = Path(directory), field
        self._headers: dict[Path, object] = {}  # open handles, for names and shapes only (no data read)
        index = self.directory / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                self.files = {str(name): self.directory / file for name, file in weight_map.items()}
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ConfigError(
                    field, str(index), f"not a safetensors index ({type(e).__name__}: {e})", "download the model again"
                ) from None
        else:
            self.files = {}
            for path in sorted(self.directory.glob("*.safetensors")):
                for name in self._header(path).keys():  # noqa: SIM118  (safetensors' safe_open is no iterable)
                    self.files[name] = path

    def _header(self, path: Path):
        from safetensors import safe_open

        if path not in self._headers:
            try:
                self._headers[path] = safe_open(str(path), framework="pt")
            except Exception as e:  # (safetensors' SafetensorError: a truncated or foreign file)
                raise ConfigError(
                    self.field,
                    str(path),
                    f"not a readable safetensors file ({str(e).splitlines()[0] if str(e) else type(e).__name__})",
                    "download or export the model again",
                ) from None
        return self._headers[path]

    def check_readable(self) -> None:
        """One line for a directory whose weights fived cannot read (no weights, pickles only, a
        truncated or foreign file), before ranks start: each file's header is read and checked
        against the file's size."""
        self.check_has_weights()
        for path in sorted(set(self.files.values())):
            if not path.is_file():
                raise ConfigError(
                    self.field, str(path), "is named in the index but missing", "download the model again"
                )
            self._header(path)

    def check_has_weights(self) -> None:
        """One line for a directory whose weights fived cannot read: PyTorch pickles only, or none."""
        if self.files:
            return
        pickles = sorted(p.name for p in self.directory.glob("*.bin")) + sorted(
            p.name for p in self.directory.glob("*.pt*")
        )
        if pickles:
            raise ConfigError(
                self.field,
                str(self.directory),
                f"holds PyTorch pickle weights only ({pickles[0]}); fived reads safetensors and never unpickles",
                "convert it with transformers: from_pretrained(dir).save_pretrained(new_dir) writes model.safetensors",
            )
        raise ConfigError(
            self.field, str(self.directory), "holds no *.safetensors weights", "give a model directory with them"
        )

    def names(self) -> set[str]:
        """The tensors of the model (FP8 block scales are part of their weight, not tensors of their own)."""
        return {name for name in self.files if not name.endswith(SCALE_SUFFIX)}

    def _block(self) -> tuple[int, int]:
        path = self.directory / "config.json"
        quantization = (json.loads(path.read_text()) if path.is_file() else {}).get("quantization_config") or {}
        rows, cols = quantization.get("weight_block_size") or (128, 128)
        return int(rows), int(cols)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._header(self.files[name]).get_slice(name).get_shape())

    def read(self, name: str, offsets, sizes) -> torch.Tensor:
        """The box [offsets, offsets + sizes) of tensor `name`, copied out of the file's mapping (and
        dequantised when the file holds it in FP8 with block scales)."""
        scale = name + SCALE_SUFFIX
        if scale not in self.files:
            return self._read(name, offsets, sizes)
        (r0, c0), (rows, cols), (br, bc) = offsets, sizes, self._block()
        first, last = (r0 // br, c0 // bc), ((r0 + rows - 1) // br, (c0 + cols - 1) // bc)
        blocks = self._read(scale, first, (last[0] - first[0] + 1, last[1] - first[1] + 1))
        per_element = blocks.repeat_interleave(br, 0).repeat_interleave(bc, 1)
        inside = per_element[r0 - first[0] * br :][:rows, c0 - first[1] * bc :][:, :cols]
        return self._read(name, offsets, sizes).to(torch.float32) * inside.to(torch.float32)

    def _read(self, name: str, offsets, sizes) -> torch.Tensor:
        from safetensors import safe_open

        # A handle per read: the slice is a view of the mapped file, and the pages it touched stay
        # in this process's memory until the mapping goes; this way they go with each tensor.
        with safe_open(str(self.files[name]), framework="pt") as f:
            part = f.get_slice(name)
            return part[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].clone()

    def read_box(self, source: Source, offsets, sizes) -> torch.Tensor:
        """The box of a fived tensor: read directly, or gathered from the per-expert tensors it stacks
        (fived's [E, a, b] is expert e's Hugging Face [b, a] transposed)."""
        if source.name and source.rows is not None:  # (rows permuted within a head: read their span)
            wanted = source.rows[offsets[0] : offsets[0] + sizes[0]]
            lo = min(wanted)
            span = self.read(source.name, (lo, *offsets[1:]), (max(wanted) + 1 - lo, *sizes[1:]))
            return span[torch.tensor(wanted) - lo]
        if source.name and source.columns is not None:  # (every step-th column of the last dim)
            offset, step = source.columns
            first = offset + step * offsets[-1]
            span = self.read(source.name, (*offsets[:-1], first), (*sizes[:-1], step * (sizes[-1] - 1) + 1))
            return span[..., ::step].contiguous()
        if source.name:
            return self.read(source.name, offsets, sizes)
        first, count = offsets[0], sizes[0]
        parts = [
            self.read(source.per_expert.format(e=e), (offsets[2], offsets[1]), (sizes[2], sizes[1])).t()
            for e in range(first, first + count)
        ]
        return torch.stack(parts)
