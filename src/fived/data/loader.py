"""Tokenizers, token files, and the checks of a run's data (the sampler: fived.data.sampler)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from fived.data.blend import parse_blend
from fived.data.indexed import check_training_data, is_indexed, read_index

# (re-exported: the sampler's home was this module, and its importers still name it)
from fived.data.sampler import BlendedTokens as BlendedTokens
from fived.data.sampler import GlobalBatchSampler as GlobalBatchSampler
from fived.errors import ConfigError

TOKEN_FORMAT = "fived-tokens-v1"


class ByteTokenizer:
    """UTF-8 bytes as tokens: no files, no dependencies, works on any text."""

    vocab_size = 256
    # No id is left for a special token: documents end with the NUL byte, which text does not hold.
    eot_id = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        # A model can emit a byte sequence that is not valid UTF-8; show it, don't fail.
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


# End-of-document tokens of common vocabularies, in the order they are looked for (Llama 3 has both
# <|end_of_text|> and <|eot_id|>; the first ends a document, the second a chat turn).
EOT_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[EOS]")


class HFTokenizer:
    """A Hugging Face `tokenizer.json`, for users who bring their own vocabulary."""

    def __init__(self, path: str | Path):
        try:
            import tokenizers  # imported here so the byte path needs no extra package
        except ImportError as e:
            raise ImportError(
                f"tokenizer {str(path)!r} needs the Hugging Face tokenizers package: pip install tokenizers"
            ) from e
        if not Path(path).is_file():
            raise ValueError(f"tokenizer file not found: {path}")
        self.path = str(path)
        try:
            self._tok = tokenizers.Tokenizer.from_file(self.path)
        except Exception as e:  # (tokenizers raises a bare Exception for a file it cannot parse)
            raise ConfigError(
                "data.tokenizer",
                self.path,
                f"not a Hugging Face tokenizer.json ({str(e).splitlines()[0] if str(e) else type(e).__name__})",
                "give the tokenizer.json a model ships, or 'byte'",
            ) from None
        self.vocab_size = self._tok.get_vocab_size()
        self.eot_id = next((self._tok.token_to_id(t) for t in EOT_TOKENS if self._tok.token_to_id(t) is not None), None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Several texts at once (in parallel), without the post-processor's special tokens: for
        `fived prepare-data`, where the end-of-document token alone separates documents."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]


def load_tokenizer(name: str):
    """ "byte" -> ByteTokenizer; anything else is taken as a path to a tokenizer.json."""
    if name == "byte":
        return ByteTokenizer()
    return HFTokenizer(name)


def bundled_corpus_path() -> Path:
    """The small English corpus shipped with the package (see assets/CORPUS.md)."""
    return Path(__file__).parents[1] / "assets" / "corpus.txt"


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 65536 else np.uint32


def _read_text(path: Path) -> str:
    if not path.is_file():
        raise ValueError(f"data file not found: {path}")
    # newline="" keeps the bytes as they are, so byte tokens equal the file's bytes.
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


def _tokenize(text: str, tokenizer: str) -> np.ndarray:
    if tokenizer == "byte":
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)  # fast path, no list
    tok = load_tokenizer(tokenizer)
    return np.asarray(tok.encode(text), dtype=token_dtype(tok.vocab_size))


def token_file_paths(path: str | Path) -> tuple[Path, Path]:
    """`x` or `x.bin` -> (x.bin, x.json)."""
    p = str(path)
    base = p[: -len(".bin")] if p.endswith(".bin") else p
    return Path(base + ".bin"), Path(base + ".json")


def token_metadata(path: str | Path) -> dict | None:
    """The sidecar of a token file from `fived prepare-data` (None for a text file or no path)."""
    if not path:
        return None
    bin_path, json_path = token_file_paths(path)
    if not (bin_path.is_file() and json_path.is_file()):
        return None
    try:
        meta = json.loads(json_path.read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == TOKEN_FORMAT else None


def _sidecar(json_path: Path) -> dict:
    """A token file's sidecar, read; a damaged one refused naming the file and the way out."""
    redo = "restore the sidecar, or run fived prepare-data again"
    try:
        meta = json.loads(json_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{json_path}: not valid JSON ({e}); {redo}") from None
    if not isinstance(meta, dict) or meta.get("format") != TOKEN_FORMAT:
        raise ValueError(f"{json_path}: not a {TOKEN_FORMAT} sidecar; {redo}")
    return meta


def is_megatron_pair(path: str | Path | None) -> bool:
    """Whether `path` names Megatron-LM's .bin + .idx (the .bin or the prefix; a fived sidecar wins)."""
    if not path or not is_indexed(path) or token_metadata(path) is not None:
        return False
    return str(path).endswith(".bin") or not Path(path).is_file()


def load_tokens(path: str | Path | None, tokenizer: str = "byte") -> np.ndarray:
    """A 1-D integer token array: the bundled corpus, a prepared token file, Megatron-LM's .bin + .idx
    (fived.data.indexed), or a text file.

    Token files are memory-mapped read-only, so corpora larger than RAM work.
    """
    if path is None or str(path) == "":
        return _tokenize(_read_text(bundled_corpus_path()), tokenizer)
    bin_path, json_path = token_file_paths(path)
    if is_megatron_pair(path):
        return read_index(path).tokens()  # Megatron-LM's .bin + .idx (a .bin, or the pair's prefix)
    if str(path).endswith(".bin") or (json_path.is_file() and bin_path.is_file()):
        if not bin_path.is_file():
            raise ValueError(f"token file not found: {bin_path}")
        if not json_path.is_file():
            raise ValueError(
                f"token file {bin_path} needs {json_path.name} (fived prepare-data) or "
                f"{bin_path.with_suffix('.idx').name} (Megatron-LM) beside it"
            )
        meta = _sidecar(json_path)
        dtype, n = np.dtype(meta["dtype"]), int(meta["num_tokens"])
        if dtype != np.dtype(token_dtype(int(meta["vocab_size"]))):  # (an edited sidecar: garbage ids)
            raise ValueError(
                f"{json_path}: dtype {meta['dtype']} is not the one prepare-data writes for vocab_size "
                f"{meta['vocab_size']} ({np.dtype(token_dtype(int(meta['vocab_size']))).name}); restore the "
                "sidecar, or run fived prepare-data again"
            )
        if bin_path.stat().st_size != n * dtype.itemsize:
            raise ValueError(f"{bin_path}: size does not match num_tokens={n} in {json_path}")
        # Tokens made with another vocabulary would index past the model's embedding.
        if meta.get("tokenizer") != tokenizer and meta["vocab_size"] != load_tokenizer(tokenizer).vocab_size:
            raise ValueError(
                f"{bin_path} was made with tokenizer {meta.get('tokenizer')!r} "
                f"(vocab {meta['vocab_size']}), not {tokenizer!r}"
            )
        if n == 0:
            return np.zeros(0, dtype=dtype)  # np.memmap refuses empty files
        return np.memmap(bin_path, dtype=dtype, mode="r", shape=(n,))
    return _tokenize(_read_text(Path(path)), tokenizer)


def check_data(cfg) -> np.ndarray | BlendedTokens:
    """The data a run needs, checked before any rank starts (and by each rank as a guard); returns
    the tokens (a blend's: BlendedTokens). Errors are ConfigErrors: one line naming the field."""

    d, t = cfg.data, cfg.train
    if d.tokenizer != "byte" and not Path(d.tokenizer).is_file():
        raise ConfigError(
            "data.tokenizer", d.tokenizer, "file not found", "give the path of a Hugging Face tokenizer.json, or 'byte'"
        )
    try:
        vocab = load_tokenizer(d.tokenizer).vocab_size
    except ConfigError:
        raise
    except (ValueError, ImportError) as e:
        raise ConfigError("data.tokenizer", d.tokenizer, str(e).splitlines()[0]) from None
    if vocab > cfg.model.vocab_size:
        raise ConfigError(
            "model.vocab_size",
            cfg.model.vocab_size,
            f"smaller than the tokenizer's vocabulary ({vocab})",
            f"set --model.vocab_size {vocab}",
        )
    tokens: np.ndarray | BlendedTokens
    if d.blend:
        tokens = blend_tokens(cfg, d.blend, "data.blend", taken="data.path" if d.path else "")
    else:
        tokens = open_source(cfg, d.path, "data.path")
        windows = max(0, (len(tokens) - 1) // t.seq_len)
        if windows < t.global_batch:
            raise ConfigError(
                "train.global_batch",
                t.global_batch,
                f"the data holds only {windows} sequences of seq_len={t.seq_len}",
                "use more data, a shorter seq_len or a smaller global batch",
            )
    if d.document_mask and end_of_document_id(cfg) is None:
        raise ConfigError(
            "data.document_mask",
            True,
            f"the tokenizer {d.tokenizer!r} has no end-of-document token to find documents by",
            "use a tokenizer with one (e.g. <|endoftext|>), or set it false",
        )
    if d.document_mask and not all(
        _holds_token(source, end_of_document_id(cfg))
        for source in (tokens.tokens if isinstance(tokens, BlendedTokens) else (tokens,))
    ):
        raise ConfigError(
            "data.document_mask",
            True,
            f"{d.path or d.blend or 'the bundled corpus'} holds no end-of-document token ({end_of_document_id(cfg)}): "
            "it is one document, and masking would change nothing",
            "prepare the data with its documents ended (fived prepare-data of a JSON-lines or parquet file), "
            "or set it false",
        )
    validation_data(cfg)
    return tokens


def _holds_token(tokens: np.ndarray, token: int | None, chunk: int = 1 << 24) -> bool:
    """Whether `token` occurs (scanned in chunks: a memory-mapped corpus is not copied whole)."""
    return token is not None and any(bool(np.any(tokens[i : i + chunk] == token)) for i in range(0, len(tokens), chunk))


def open_source(cfg, path: str, field: str) -> np.ndarray:
    """One token source's tokens ("": the bundled corpus), checked: the file exists, loads (every
    format fived reads plugs in at load_tokens) and holds no id beyond the model's vocabulary.
    Errors are one-line ConfigErrors naming `field`."""

    if path and not Path(path).exists() and not is_indexed(path):
        raise ConfigError(
            field,
            path,
            "file not found",
            "give a .bin from `fived prepare-data` or Megatron-LM (or its prefix), a text file"
            + (", or leave it empty for the bundled corpus" if field == "data.path" else ""),
        )
    try:
        tokens = load_tokens(path, cfg.data.tokenizer)
    except ConfigError:
        raise
    except (ValueError, ImportError) as e:
        raise ConfigError(field, path or "bundled corpus", str(e).splitlines()[0]) from None
    if is_megatron_pair(path):
        eod = end_of_document_id(cfg)
        check_training_data(path, tokens, end_of_document=eod, document_mask=cfg.data.document_mask, field=field)
    largest = largest_token_id(path, tokens)
    if largest >= cfg.model.vocab_size:
        raise ConfigError(
            field,
            path or "bundled corpus",
            f"holds token id {largest}, beyond the model's vocabulary (model.vocab_size={cfg.model.vocab_size})",
            f"set --model.vocab_size {largest + 1}, or re-tokenize the data with the model's tokenizer",
        )
    return tokens


def blend_tokens(cfg, text: str, field: str, *, taken: str = "") -> BlendedTokens:
    """A blend's sources opened and checked (`taken`: the field that was also given, refused)."""

    if taken:
        raise ConfigError(field, text, f"given together with {taken}", "give one of them: a blend lists every source")
    sources = parse_blend(text, field=field)
    tokens = tuple(open_source(cfg, s.path, field) for s in sources)
    for source, source_tokens in zip(sources, tokens):
        if len(source_tokens) <= cfg.train.seq_len:
            raise ConfigError(
                field,
                source.path,
                f"holds {len(source_tokens)} tokens, not one sequence of seq_len={cfg.train.seq_len} (+1)",
                "use more data or a shorter seq_len",
            )
    return BlendedTokens(sources, tokens)


def first_source_path(cfg) -> str:
    """data.path, or a blend's first source (whose sidecar names the tokenizer and end of document)."""
    if cfg.data.blend and not cfg.data.path:
        items = cfg.data.blend.split()
        return items[1] if len(items) > 1 else ""
    return cfg.data.path


def end_of_document_id(cfg) -> int | None:
    """The token that ends each document: the token file's (its sidecar), else the tokenizer's."""
    meta = token_metadata(first_source_path(cfg))
    if meta is not None and meta.get("eot_id") is not None:
        return int(meta["eot_id"])
    return load_tokenizer(cfg.data.tokenizer).eot_id


def largest_token_id(path: str, tokens: np.ndarray) -> int:
    """The largest id in the tokens (vectorised; a memory-mapped file is streamed once). For a token
    file the answer is cached in its sidecar (`max_token_id`, with the file's size and time), so a
    corpus is read once, not at every start; a read-only sidecar is simply not updated."""
    if len(tokens) == 0:
        return -1
    meta = token_metadata(path)
    if meta is None:
        return int(tokens.max())
    bin_path, json_path = token_file_paths(path)
    stat = bin_path.stat()
    stamp = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    cached = meta.get("max_token_id")
    if isinstance(cached, dict) and cached.get("of") == stamp and isinstance(cached.get("value"), int):
        return cached["value"]
    largest = int(tokens.max())
    from fived.files import Refused, write_output

    try:  # (prepare-data's sidecar, fived's: replaced whole; never a link, never a changed file)
        text = json.dumps({**meta, "max_token_id": {"value": largest, "of": stamp}}, indent=1) + "\n"
        write_output(json_path, text, "data.path", lambda path: json.loads(Path(path).read_text()) == meta)
    except (OSError, Refused):  # (a cache only: the value is returned all the same, and nothing is left behind)
        pass
    return largest


def adopt_token_metadata(cfg, given: set[str]) -> None:
    """Training on a token file from `fived prepare-data`: its tokenizer (the copy beside the tokens)
    and its vocabulary size, for whichever of data.tokenizer and model.vocab_size was not given.
    (A preset's larger vocabulary is kept: a model may have unused rows.)"""
    path = first_source_path(cfg)
    meta = token_metadata(path)
    if meta is None:
        return
    if "data.tokenizer" not in given and meta.get("tokenizer", "byte") != "byte":
        copy = meta.get("tokenizer_file")
        cfg.data.tokenizer = str(token_file_paths(path)[1].parent / copy) if copy else meta["tokenizer"]
    if "model.vocab_size" not in given and cfg.model.vocab_size < int(meta.get("vocab_size", 0)):
        cfg.model = replace(cfg.model, vocab_size=int(meta["vocab_size"]))


def validation_path(cfg) -> str:
    """data.val_path, or else the validation split `prepare-data --val-fraction` wrote beside
    data.path ("" if neither)."""
    if cfg.data.val_path:
        return cfg.data.val_path
    meta = token_metadata(cfg.data.path)
    if meta and meta.get("validation"):
        return str(token_file_paths(cfg.data.path)[0].parent / meta["validation"])
    return ""


def validation_batches(cfg, num_windows: int) -> int:
    """Global batches per evaluation: train.eval_batches, or (0) every whole batch of the data."""
    whole = num_windows // cfg.train.global_batch
    return min(cfg.train.eval_batches, whole) if cfg.train.eval_batches > 0 else whole


def validation_data(cfg) -> np.ndarray | BlendedTokens | None:
    """The validation tokens when train.eval_every > 0 (checked: one-line ConfigErrors), else None."""

    t = cfg.train
    for name, value in (("train.eval_every", t.eval_every), ("train.eval_batches", t.eval_batches)):
        if value < 0:
            raise ConfigError(name, value, "must be >= 0", "e.g. 100 (0: off / every whole batch)")
    if cfg.data.valid_blend:
        parse_blend(cfg.data.valid_blend, field="data.valid_blend")  # (its syntax, even with no evaluations)
    if t.eval_every == 0:
        return None
    if cfg.data.valid_blend:
        return validation_blend(cfg)
    path = validation_path(cfg)
    if not path:
        raise ConfigError(
            "train.eval_every",
            t.eval_every,
            "needs validation data",
            "hold some out with `fived prepare-data ... --val-fraction 0.05`, or give --data.val_path",
        )
    if not Path(path).exists():
        raise ConfigError(
            "data.val_path", path, "file not found", "give a .bin from `fived prepare-data` or a text file"
        )
    try:
        tokens = load_tokens(path, cfg.data.tokenizer)
    except ConfigError:
        raise
    except (ValueError, ImportError) as e:
        raise ConfigError(
            "data.val_path", path, str(e).splitlines()[0], "give validation tokens made like data.path (same tokenizer)"
        ) from None
    if is_megatron_pair(path):
        check_training_data(
            path,
            tokens,
            end_of_document=end_of_document_id(cfg),
            document_mask=cfg.data.document_mask,
            field="data.val_path",
        )
    largest = largest_token_id(path, tokens)
    if largest >= cfg.model.vocab_size:
        raise ConfigError(
            "data.val_path",
            path,
            f"holds token id {largest}, beyond the model's vocabulary (model.vocab_size={cfg.model.vocab_size})",
            "give validation tokens made like data.path",
        )
    windows = max(0, (len(tokens) - 1) // t.seq_len)
    if windows < t.global_batch:
        raise ConfigError(
            "data.val_path",
            path,
            f"holds {windows} sequences of seq_len={t.seq_len}, fewer than one global batch ({t.global_batch})",
            "hold out more data (a larger --val-fraction)",
        )
    return tokens


def validation_blend(cfg) -> BlendedTokens:
    """data.valid_blend's sources, checked: together at least one global batch of sequences."""

    d, t = cfg.data, cfg.train
    blend = blend_tokens(cfg, d.valid_blend, "data.valid_blend", taken="data.val_path" if d.val_path else "")
    windows = sum(max(0, (len(tokens) - 1) // t.seq_len) for tokens in blend.tokens)
    if windows < t.global_batch:
        raise ConfigError(
            "data.valid_blend",
            d.valid_blend,
            f"holds {windows} sequences of seq_len={t.seq_len}, fewer than one global batch ({t.global_batch})",
            "give more validation data",
        )
    return blend


def validation_sampler(cfg) -> tuple[GlobalBatchSampler | None, int]:
    """The validation data's own sampler and how many of its global batches an evaluation runs: the
    first ones, the same at every evaluation (its position never moves, so evaluating changes no
    training state). (None, 0) without validation data."""
    t = cfg.train
    tokens = validation_data(cfg)
    if tokens is None:
        return None, 0
    sampler = GlobalBatchSampler(tokens, t.seq_len, t.global_batch, t.seed)
    return sampler, validation_batches(cfg, total_windows(sampler.num_windows))


def total_windows(num_windows: int | list[int]) -> int:
    """A sampler's windows: its source's, or the sum of a blend's sources'."""
    return sum(num_windows) if isinstance(num_windows, list) else num_windows
