"""`fived prepare-data`: documents from text, JSON lines, Parquet or a saved Hugging Face dataset,
tokenized into one token file, streaming.

- A document is a whole `.txt` file, one JSON line's `text_field`, one row of a Parquet column or of
  a dataset column. Each document is followed by the tokenizer's end-of-document token.
- Streaming: text is read in blocks of whole lines, JSON lines one at a time, Parquet and datasets
  in record batches (a saved dataset is memory-mapped by `datasets`), and encoded a batch of pieces
  at a time, so memory stays bounded by a batch, not the corpus. Tokens go straight to disk.
- Pieces are encoded without the tokenizer's post-processor (no BOS added to every block of a text
  file): the end-of-document token alone separates documents.
- `val_fraction`: the last fraction of the tokens (cut at the nearest document boundary) become a
  validation file `<output>.val.bin` beside the training tokens.
- The sidecar `<output>.json` names the tokenizer and its vocabulary size (a tokenizer.json is
  copied next to the tokens), so training on the result needs neither `--data.tokenizer` nor
  `--model.vocab_size`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from fived.data.loader import EOT_TOKENS, TOKEN_FORMAT, ByteTokenizer, load_tokenizer, token_dtype, token_file_paths
from fived.files import Refused, publish

TEXT_BLOCK_CHARS = 1 << 20  # a .txt file is tokenized in blocks of whole lines of about this size
ROWS_PER_BATCH = 1024  # Parquet / dataset rows read at a time
BOUNDARY_SEARCH = 1 << 20  # tokens searched either side of the validation cut for a document end
FORMAT_EXTRA = "pip install 'fived[data]'"  # pyarrow and datasets


def input_format(path: Path) -> str:
    """txt | jsonl | parquet | dataset (a directory written by `Dataset.save_to_disk`)."""
    if path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
            return "dataset"
        raise ValueError(f"{path}: a directory that is not a saved Hugging Face dataset (no dataset_info.json)")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
    return "txt"


class MissingExtra(ImportError):
    """An input format whose reader (an optional extra) is not installed."""

    def __init__(self, module: str, path: Path):
        super().__init__(f"reading {path} needs {module}: {FORMAT_EXTRA}")
        self.module, self.input_path = module, path  # (ImportError's own `path` is the module's file)


def _optional(module: str, path: Path):
    try:
        return __import__(module)
    except ImportError:
        raise MissingExtra(module, path) from None


def _text_blocks(path: Path):
    """The file's text in blocks of whole lines (one document: the file)."""
    # newline="" keeps the bytes as they are, so byte tokens equal the file's bytes.
    with open(path, encoding="utf-8", newline="") as f:
        while True:
            block = f.read(TEXT_BLOCK_CHARS)
            if not block:
                return
            block += f.readline()  # finish the line: a tokenizer never sees half a word
            yield block


def _jsonl_documents(path: Path, field: str):
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"{path}:{number}: not JSON lines (one JSON object per line)") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: not a JSON object (one object per line, its text in a field)")
            if field not in row:
                have = ", ".join(repr(k) for k in list(row)[:10]) + (", ..." if len(row) > 10 else "") or "none"
                raise ValueError(
                    f"{path}:{number}: no field {field!r} (its fields: {have}); give the text's field with --text-field"
                )
            yield row[field]


def _parquet_documents(path: Path, field: str):
    _optional("pyarrow", path)
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    if field not in parquet.schema_arrow.names:
        raise ValueError(
            f"{path}: no column {field!r} (columns: {', '.join(parquet.schema_arrow.names)}; "
            "give the text's column with --text-field)"
        )
    for batch in parquet.iter_batches(batch_size=ROWS_PER_BATCH, columns=[field]):
        yield from batch.column(0).to_pylist()


def _dataset_documents(path: Path, field: str, split: str):
    datasets = _optional("datasets", path)
    data = datasets.load_from_disk(str(path))  # memory-mapped Arrow files: rows are read on demand
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise ValueError(f"{path}: no split {split!r} (splits: {', '.join(data)}; choose one with --split)")
        data = data[split]
    if field not in data.column_names:
        raise ValueError(
            f"{path}: no column {field!r} (columns: {', '.join(data.column_names)}; "
            "give the text's column with --text-field)"
        )
    for rows in data.select_columns([field]).iter(batch_size=ROWS_PER_BATCH):
        yield from rows[field]


def pieces(path: Path, text_field: str = "text", split: str = "train"):
    """The text of `path` as (piece, ends a document): one piece per row, several for a large .txt
    file (its blocks; the last ends the document)."""
    kind = input_format(path)
    if kind == "txt":
        previous = ""  # (an empty file is an empty document: its end token alone)
        for index, block in enumerate(_text_blocks(path)):
            if index:
                yield previous, False
            previous = block
        yield previous, True
        return
    rows = {
        "jsonl": lambda: _jsonl_documents(path, text_field),
        "parquet": lambda: _parquet_documents(path, text_field),
        "dataset": lambda: _dataset_documents(path, text_field, split),
    }[kind]()
    for text in rows:
        if text is None:
            continue  # a missing value in a column: no document
        if not isinstance(text, str):
            raise ValueError(f"{path}: field {text_field!r} holds {type(text).__name__}, not text")
        yield text, True


def _named_decoding(path: Path, rows):
    """`rows`, with a file that is not UTF-8 refused naming it, the byte and the way out."""
    try:
        yield from rows
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start} of a block); "
            "convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8), or leave it out"
        ) from None


def _batches(inputs: list[Path], text_field: str, split: str):
    """Lists of (piece, ends a document) of at most ROWS_PER_BATCH pieces or about TEXT_BLOCK_CHARS
    characters: enough to encode in parallel, little enough to bound memory."""
    batch, chars = [], 0
    for path in inputs:
        for piece in _named_decoding(path, pieces(path, text_field, split)):
            batch.append(piece)
            chars += len(piece[0])
            if len(batch) >= ROWS_PER_BATCH or chars >= TEXT_BLOCK_CHARS:
                yield batch
                batch, chars = [], 0
    if batch:
        yield batch


def _new_file_mode() -> int:
    """The mode open() gives a new file, 0666 less the umask (0644 usually): mkstemp's 0600 would
    hide the token files from the other users of a shared machine."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _write_sidecar(json_path: Path, meta: dict) -> str:
    fd, tmp = tempfile.mkstemp(dir=json_path.parent, prefix=json_path.name + ".", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    return tmp


def _validation_cut(tokens: np.ndarray, fraction: float, eot_id: int) -> int:
    """Where the validation tokens start: (1 - fraction) of the way, moved to the nearest document
    end within BOUNDARY_SEARCH tokens (if one leaves both parts non-empty)."""
    n = len(tokens)
    target = min(max(round(n * (1.0 - fraction)), 1), n - 1)
    lo = max(target - BOUNDARY_SEARCH, 0)
    ends = np.flatnonzero(tokens[lo : target + BOUNDARY_SEARCH] == eot_id) + lo + 1  # a cut right after each end
    ends = ends[(ends > 0) & (ends < n)]
    return int(ends[np.abs(ends - target).argmin()]) if ends.size else target


def _encode(tok, texts: list[str], dtype) -> list[np.ndarray]:
    if isinstance(tok, ByteTokenizer):  # (no list of Python ints for a block of bytes)
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(dtype) for t in texts]
    return [np.asarray(ids, dtype=dtype) for ids in tok.encode_batch(texts)]


def count_tokens(
    inputs: list[Path], tok, dtype, out, text_field: str, split: str, lengths: list | None = None
) -> tuple[int, int]:
    """Tokenize every document of every input into the open file `out`, each followed by the end
    token; returns (tokens, documents). `lengths`, if given, receives each document's token count
    (an array per batch: a Megatron index needs them)."""
    from tqdm import tqdm

    num_tokens = num_docs = pending = 0  # pending: tokens of a document still being read (a .txt's blocks)
    eot = np.asarray([tok.eot_id], dtype=dtype)
    # (shown after its first second only: a quick job, or an input refused at its first lines, prints
    # no progress before its result or its one-line error)
    with tqdm(desc="prepare-data", unit=" docs", mininterval=0.5, delay=1.0) as bar:
        for batch in _batches(inputs, text_field, split):
            parts, ended = [], []
            for ids, (_, ends) in zip(_encode(tok, [text for text, _ in batch], dtype), batch):
                parts += [ids, eot] if ends else [ids]
                pending += ids.size + ends
                if ends:
                    ended.append(pending)
                    pending = 0
            if lengths is not None:
                lengths.append(np.asarray(ended, dtype=np.int64))
            written = np.concatenate(parts)
            written.tofile(out)  # (one write per batch)
            documents = sum(ends for _, ends in batch)
            num_tokens, num_docs = num_tokens + written.size, num_docs + documents
            bar.update(documents)
            bar.set_postfix(tokens=num_tokens, refresh=False)
    return num_tokens, num_docs


def checked_inputs(inputs: list[str | Path], tokenizer: str, val_fraction: float) -> tuple[list[Path], Any]:
    """(the inputs as paths, the tokenizer): everything checked before anything is created."""
    paths = [Path(p) for p in inputs]
    if not paths:
        raise ValueError("prepare_data needs at least one input file")
    for p in paths:
        if not p.exists():
            raise ValueError(f"data file not found: {p}")
        reader = {"parquet": "pyarrow", "dataset": "datasets"}.get(input_format(p))
        if reader:
            _optional(reader, p)
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be in [0, 1)")
    tok = load_tokenizer(tokenizer)
    if tok.eot_id is None:
        raise ValueError(f"tokenizer {tokenizer} has no end-of-document token (one of {', '.join(EOT_TOKENS)})")
    return paths, tok


def prepare_data(
    inputs: list[str | Path],
    output: str | Path,
    tokenizer: str = "byte",
    text_field: str = "text",
    val_fraction: float = 0.0,
    split: str = "train",
) -> Path:
    """Tokenize `inputs` (in order) into `<output>.bin` with its `<output>.json` sidecar, and with
    `val_fraction` > 0 the validation split `<output>.val.bin` / `.val.json` (Megatron-LM's .bin +
    .idx instead: fived.data.prepare_megatron).

    Everything is written to temporary files and renamed into place at the end, so a failure
    never leaves a half-written file behind or clobbers a good one.
    """
    paths, tok = checked_inputs(inputs, tokenizer, val_fraction)
    dtype = token_dtype(tok.vocab_size)
    bin_path, json_path = token_file_paths(output)
    val_bin, val_json = token_file_paths(str(bin_path)[: -len(".bin")] + ".val")
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "format": TOKEN_FORMAT,
        "dtype": np.dtype(dtype).name,
        "num_tokens": 0,
        "vocab_size": tok.vocab_size,
        "tokenizer": tokenizer,
        "eot_id": tok.eot_id,
    }
    if tokenizer != "byte":  # a copy beside the tokens: the sidecar stays valid wherever they move
        meta["tokenizer_file"] = bin_path.with_suffix(".tokenizer.json").name
    refuse_existing(
        [bin_path, json_path, *([val_bin, val_json] if val_fraction > 0 else [])]
        + ([bin_path.parent / meta["tokenizer_file"]] if "tokenizer_file" in meta else []),
        paths,
    )
    with publishing([]) as moves:  # (temporary file, final path)
        tmp_bin = temporary(bin_path, moves)
        with open(tmp_bin, "wb") as f:
            meta["num_tokens"], meta["documents"] = count_tokens(paths, tok, dtype, f, text_field, split)
        if val_fraction > 0:
            meta["num_tokens"] = _split_validation(tmp_bin, meta, val_fraction, val_bin, val_json, moves)
        if "tokenizer_file" in meta:
            shutil.copyfile(tokenizer, temporary(bin_path.parent / meta["tokenizer_file"], moves))
        moves.append((_write_sidecar(json_path, meta), json_path))
    return bin_path


def refuse_existing(outputs: list[Path], inputs: list[Path]) -> None:
    """Before anything is written: no output may exist already (an input, or anyone's file)."""
    for out in outputs:
        if os.path.lexists(out):
            own = any(os.path.lexists(p) and os.path.samefile(p, out) for p in inputs if not out.is_symlink())
            raise Refused(
                out,
                ("is one of the inputs" if own else "exists") + "; fived does not write over a file it did not create",
                "name a new --output",
            )


def _split_validation(tmp_bin: str, meta: dict, fraction: float, val_bin: Path, val_json: Path, moves: list) -> int:
    """Move the last `fraction` of the tokens in `tmp_bin` to a validation file; returns the
    training tokens left."""
    dtype, n = np.dtype(meta["dtype"]), meta["num_tokens"]
    if n < 2:
        raise ValueError(f"{n} token(s) cannot be split into training and validation data")
    tokens = np.memmap(tmp_bin, dtype=dtype, mode="r", shape=(n,))
    cut = _validation_cut(tokens, fraction, meta["eot_id"])
    del tokens
    move_tail(tmp_bin, dtype=dtype, num_tokens=n, cut=cut, to=temporary(val_bin, moves))
    val_meta = {**meta, "num_tokens": n - cut, "split": "validation"}
    val_meta.pop("documents", None)
    meta["validation"] = val_bin.name
    moves.append((_write_sidecar(val_json, val_meta), val_json))
    return cut


def temporary(final: Path, moves: list) -> str:
    """A new empty temporary file beside `final`, to be published as `final` (appended to `moves`)."""
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=final.name + ".", suffix=".tmp")
    os.close(fd)
    moves.append((tmp, final))
    return tmp


def move_tail(tmp_bin: str, *, dtype, num_tokens: int, cut: int, to: str) -> None:
    """Tokens cut.. of the token file `tmp_bin` into the file `to`; `tmp_bin` keeps ..cut."""
    tokens = np.memmap(tmp_bin, dtype=dtype, mode="r", shape=(num_tokens,))
    with open(to, "wb") as f:
        for start in range(cut, num_tokens, BOUNDARY_SEARCH):  # (in pieces: memory stays bounded)
            np.asarray(tokens[start : min(start + BOUNDARY_SEARCH, num_tokens)]).tofile(f)
    del tokens
    os.truncate(tmp_bin, cut * np.dtype(dtype).itemsize)


@contextmanager
def publishing(moves: list):
    """Publish every (temporary, final) of `moves`, in order, when the block ends without an error
    (never over a file: not even one made since the check); remove the temporaries when it fails."""
    try:
        yield moves
        mode = _new_file_mode()
        for tmp, final in moves:
            os.chmod(tmp, mode)
            publish(tmp, final, "name a new --output")
    except BaseException:
        for tmp, _ in moves:
            if os.path.exists(tmp):
                os.remove(tmp)
        raise
