"""Megatron-LM's indexed datasets (a `.bin` of tokens and its `.idx`), read memory-mapped and written.

The `.idx` (the "MMIDIDX" format of megatron-core's `indexed_dataset.py`), little-endian:

    magic         9 bytes   b"MMIDIDX\\x00\\x00"
    version       uint64    1
    dtype code    uint8     of the tokens in the .bin (DTYPE_CODES)
    sequences     uint64    S
    doc entries   uint64    D + 1 (the length of the document indices below)
    lengths       int32[S]  tokens of each sequence
    pointers      int64[S]  byte offset of each sequence in the .bin
    doc indices   int64[D+1] 0, then the (exclusive) last sequence of each document; ends at S
    (modes        int8[S]   only in multimodal datasets, which fived does not read)

A sequence is what megatron-core's builder `add_item`s (a document, or a sentence of one), a document a
run of sequences. The `.bin` holds the sequences back to back, so fived reads it as its token stream:
the same memory-mapped 1-D array a token file from `fived prepare-data` gives, sampled the same way.
Documents reach document masking as they do in fived's own files, by the end-of-document token that
ends each one (Megatron's `--append-eod`; `fived prepare-data --format megatron` writes it):
`documents_without_end` counts the documents that lack it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fived.errors import ConfigError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, document-index entries (34 bytes)
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CHECK_BLOCK = 1 << 22  # sequences checked at a time (memory stays bounded for any index)


@dataclass(frozen=True)
class IndexedDataset:
    """A checked `.bin`/`.idx` pair; the arrays are read-only views of the memory-mapped `.idx`."""

    bin_path: Path
    dtype: np.dtype
    sequence_lengths: np.ndarray  # int32 [S]
    document_indices: np.ndarray  # int64 [D + 1]

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def tokens(self) -> np.ndarray:
        """The token stream, memory-mapped read-only."""
        n = self.num_tokens
        if n == 0:
            return np.zeros(0, dtype=self.dtype)  # (np.memmap refuses an empty file)
        return np.memmap(self.bin_path, dtype=self.dtype, mode="r", shape=(n,))

    def document_ends(self) -> np.ndarray:
        """Token offset (exclusive) where each document ends, int64 [D]."""
        ends = np.concatenate([[0], np.cumsum(self.sequence_lengths, dtype=np.int64)])
        return ends[self.document_indices[1:]]


def pair_paths(path: str | Path) -> tuple[Path, Path]:
    """`x` or `x.bin` -> (x.bin, x.idx) (Megatron names a dataset by its prefix)."""
    p = str(path)
    base = p[: -len(".bin")] if p.endswith(".bin") else p
    return Path(base + ".bin"), Path(base + ".idx")


def is_indexed(path: str | Path) -> bool:
    """Whether `path` (a .bin or a prefix) has a Megatron `.idx` beside it."""
    bin_path, idx_path = pair_paths(path)
    return bin_path.is_file() and idx_path.is_file()


def megatron_dtype(vocab_size: int) -> np.dtype:
    """The token dtype fived writes: uint16 while ids fit, else int32 (the format has no uint32); the
    .bin's bytes are then those of fived's own token file for every vocabulary below 2**31."""
    return np.dtype(np.uint16 if vocab_size <= 65536 else np.int32)


def dtype_code(dtype) -> int:
    return next(code for code, d in DTYPE_CODES.items() if np.dtype(d) == np.dtype(dtype))


def _header(idx_path: Path) -> tuple[np.dtype, int, int]:
    """(dtype, sequences, document-index entries) from the header, checked."""
    with open(idx_path, "rb") as f:
        raw = f.read(HEADER.size)
    if len(raw) < HEADER.size or raw[: len(MAGIC)] != MAGIC:
        raise ValueError(f"{idx_path}: not a Megatron index (no MMIDIDX header); the .idx is damaged or not one")
    _, version, code, sequences, entries = HEADER.unpack(raw)
    if version != VERSION:
        raise ValueError(f"{idx_path}: Megatron index version {version}; fived reads version {VERSION}")
    if code not in DTYPE_CODES:
        raise ValueError(f"{idx_path}: unknown token dtype code {code} (known: {sorted(DTYPE_CODES)})")
    dtype = np.dtype(DTYPE_CODES[code])
    if dtype.kind != "u" and dtype.kind != "i":
        raise ValueError(f"{idx_path}: tokens of dtype {dtype.name}, not integers; re-tokenize the data")
    return dtype, sequences, entries


def read_index(path: str | Path) -> IndexedDataset:
    """The pair at `path` (a .bin or a prefix), every size and offset checked against the files;
    ValueError (one line: the file, what is wrong, what to do) for anything else."""
    bin_path, idx_path = pair_paths(path)
    if not idx_path.is_file():
        raise ValueError(f"{bin_path}: no Megatron index {idx_path.name} beside it (nor a fived .json sidecar)")
    if not bin_path.is_file():
        raise ValueError(f"{idx_path}: its tokens {bin_path.name} are not beside it")
    dtype, sequences, entries = _header(idx_path)
    size = idx_path.stat().st_size
    expected = HEADER.size + sequences * (4 + 8) + entries * 8
    if size == expected + sequences and sequences:
        raise ValueError(f"{idx_path}: a multimodal index (sequence modes); fived reads text datasets")
    if size != expected:
        raise ValueError(
            f"{idx_path}: {size} bytes, but its header ({sequences} sequences, {entries} document indices) "
            f"needs {expected}; the .idx is truncated or damaged"
        )
    raw = np.memmap(idx_path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    at = HEADER.size
    lengths = np.frombuffer(raw, dtype="<i4", count=sequences, offset=at)
    pointers = np.frombuffer(raw, dtype="<i8", count=sequences, offset=at + 4 * sequences)
    documents = np.frombuffer(raw, dtype="<i8", count=entries, offset=at + 12 * sequences)
    total = _check_sequences(idx_path, lengths, pointers, dtype)
    _check_documents(idx_path, documents, sequences)
    if bin_path.stat().st_size != total * dtype.itemsize:
        raise ValueError(
            f"{bin_path}: {bin_path.stat().st_size} bytes, but {idx_path.name} indexes {total} tokens of "
            f"{dtype.name} ({total * dtype.itemsize} bytes); the two files do not belong together"
        )
    return IndexedDataset(bin_path, dtype, lengths, documents)


def _check_sequences(idx_path: Path, lengths: np.ndarray, pointers: np.ndarray, dtype: np.dtype) -> int:
    """The tokens the sequences hold; the sequences must lie back to back (the token stream)."""
    total, itemsize = 0, dtype.itemsize
    for start in range(0, len(lengths), CHECK_BLOCK):
        block = lengths[start : start + CHECK_BLOCK].astype(np.int64)
        if (block < 0).any():
            raise ValueError(f"{idx_path}: a negative sequence length; the .idx is damaged")
        offsets = (total + np.cumsum(block) - block) * itemsize
        if not np.array_equal(offsets, pointers[start : start + CHECK_BLOCK]):
            bad = start + int(np.flatnonzero(offsets != pointers[start : start + CHECK_BLOCK])[0])
            raise ValueError(
                f"{idx_path}: sequence {bad} starts at byte {int(pointers[bad])}, not at {int(offsets[bad - start])} "
                f"as the {dtype.name} tokens before it end; the dtype code or the pointers are wrong (fived reads "
                "sequences stored back to back, as megatron-core's builder writes them)"
            )
        total += int(block.sum())
    return total


def _check_documents(idx_path: Path, documents: np.ndarray, sequences: int) -> None:
    if len(documents) == 0 or documents[0] != 0 or documents[-1] != sequences:
        raise ValueError(
            f"{idx_path}: document indices must run from 0 to the {sequences} sequences; the .idx is damaged"
        )
    if (np.diff(documents) < 0).any():
        raise ValueError(f"{idx_path}: document indices go backwards; the .idx is damaged")


def documents_without_end(dataset: IndexedDataset, end_of_document: int) -> int:
    """How many non-empty documents do not end with `end_of_document` (document masking would join
    each to the next)."""
    ends = dataset.document_ends()
    starts = np.concatenate([[0], ends[:-1]])
    ends = ends[ends > starts]
    if len(ends) == 0:
        return 0
    return int((np.asarray(dataset.tokens()[ends - 1]) != end_of_document).sum())


def write_index(idx_path: str | Path, *, dtype, document_lengths: np.ndarray) -> None:
    """A new `.idx` at `idx_path` (a temporary file the caller publishes) for a `.bin` of documents of
    `document_lengths` tokens, back to back: one sequence per document, as Megatron's preprocess_data
    writes without sentence splitting."""
    lengths = np.asarray(document_lengths, dtype=np.int64)
    if (lengths > np.iinfo(np.int32).max).any():
        raise ValueError("a document of more than 2**31 - 1 tokens does not fit a Megatron index")
    itemsize = np.dtype(dtype).itemsize
    with open(idx_path, "wb") as f:
        f.write(HEADER.pack(MAGIC, VERSION, dtype_code(dtype), len(lengths), len(lengths) + 1))
        f.write(lengths.astype("<i4").tobytes())
        f.write(((np.cumsum(lengths) - lengths) * itemsize).astype("<i8").tobytes())
        f.write(np.arange(len(lengths) + 1, dtype="<i8").tobytes())


def check_training_data(
    path: str, tokens: np.ndarray, *, end_of_document: int | None, document_mask: bool, field: str = "data.path"
) -> None:
    """What a Megatron pair (`field`: data.path or data.val_path) must hold to train or evaluate on,
    beyond fived's checks of any tokens (ids below the vocabulary: fived.data.loader.check_data): no
    negative id (a signed dtype can hold one), and with document masking every document ended by the
    end-of-document token. One-line ConfigErrors."""
    if tokens.dtype.kind == "i" and len(tokens) and (smallest := int(tokens.min())) < 0:
        raise ConfigError(field, path, f"holds token id {smallest}, below 0", "re-tokenize the data")
    if not document_mask or end_of_document is None:
        return
    dataset = read_index(path)
    missing = documents_without_end(dataset, end_of_document)
    if missing:
        raise ConfigError(
            "data.document_mask",
            True,
            f"{missing} of the {len(dataset.document_indices) - 1} documents of {path} do not end with the "
            f"end-of-document token ({end_of_document}), which is how fived finds documents",
            "make the data with Megatron's --append-eod (or fived prepare-data --format megatron), or set it false",
        )
