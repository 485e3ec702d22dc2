"""A safetensors file written one tensor at a time.

`safetensors.torch.save_file` needs every tensor of a file in memory at once; export must hold only
one. The format allows streaming: an 8-byte little-endian header length, a JSON header giving each
tensor's dtype, shape and byte range (known from the shapes alone), then the bytes in that order.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

DTYPE_CODES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class StreamingSafetensorsWriter:
    """Declare every (name, shape, dtype) first; then `write` each tensor, in that order."""

    def __init__(self, path: str | Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]]):
        header, offset = {}, 0
        for name, shape, dtype in entries:
            size = dtype.itemsize
            for n in shape:
                size *= n
            header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        header["__metadata__"] = {"format": "pt"}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # (the data starts 8-byte aligned)
        self.pending = [(name, tuple(shape), dtype) for name, shape, dtype in entries]
        self.file = open(path, "wb")  # noqa: SIM115  (the writer owns it: closed by its close())
        self.file.write(struct.pack("<Q", len(text)) + text)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self.pending.pop(0)
        if expected != (name, tuple(tensor.shape), tensor.dtype):
            raise ValueError(f"expected {expected}, got {(name, tuple(tensor.shape), tensor.dtype)}")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        self.file.write(data.numpy().data)  # (the array's buffer: no copy)

    def close(self) -> None:
        self.file.close()
        if self.pending:
            raise ValueError(f"{len(self.pending)} declared tensors were not written (first: {self.pending[0][0]})")
