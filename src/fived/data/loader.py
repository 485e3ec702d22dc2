"""Tokenizers, token files and the deterministic global-batch sampler.

The sampler is the piece the parallelism checks lean on: the batch for a step is
a pure function of (tokens, seq_len, global_batch, seed, step), and a data-parallel
rank's share is just a contiguous slice of it. So any DP/TP/PP layout sees exactly
the same examples as a single device, and resuming only needs the step number.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from fived.data.indexed import check_training_data, is_indexed, read_index

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
        self._tok = tokenizers.Tokenizer.from_file(self.path)
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
        meta = json.loads(json_path.read_text())
        if meta.get("format") != TOKEN_FORMAT:
            raise ValueError(f"{json_path}: not a {TOKEN_FORMAT} sidecar")
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


class GlobalBatchSampler:
    """Deterministic, layout-independent batches of (seq_len + 1)-token windows.

    Window i is tokens[i*seq_len : i*seq_len + seq_len + 1] (inputs = w[:-1], targets =
    w[1:]), so neighbours share one token and every token is predicted once per epoch.
    Windows are visited in a permutation drawn from default_rng([seed, epoch]); step t
    takes positions t*B .. t*B+B-1 of the endless sequence of epoch permutations, so a
    batch may straddle two epochs and any step can be computed without history.
    """

    def __init__(self, tokens, seq_len: int, global_batch: int, seed: int):
        if seq_len < 1 or global_batch < 1:
            raise ValueError(f"seq_len ({seq_len}) and global_batch ({global_batch}) must be >= 1")
        self.tokens = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens)
        if self.tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {self.tokens.shape}")
        self.seq_len, self.global_batch, self.seed = int(seq_len), int(global_batch), int(seed)
        self.num_windows = max(0, (len(self.tokens) - 1) // self.seq_len)
        if self.num_windows < self.global_batch:
            raise ValueError(
                f"corpus of {len(self.tokens)} tokens has {self.num_windows} windows of "
                f"{self.seq_len}+1 tokens, fewer than global_batch={self.global_batch}; "
                "use more data, a shorter seq_len or a smaller batch"
            )
        self.step = 0  # the next step __iter__ / next_global_batch will return
        # [step, count]: from `step` on, batches come `count` positions later (a divergence rollback
        # skipped the data it diverged on; see fived.training.divergence)
        self.skips: list[list[int]] = []
        # Permutations are pure functions of (seed, epoch); keep the last two (a batch
        # touches at most two epochs, since num_windows >= global_batch).
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
        return self._perms[epoch]

    def _rows(self, first: int, count: int) -> torch.Tensor:
        """Windows at positions first .. first+count-1 of the epoch-after-epoch order."""
        pos = np.arange(first, first + count, dtype=np.int64)
        epochs, idx = np.divmod(pos, self.num_windows)
        windows = np.empty(count, dtype=np.int64)
        for e in np.unique(epochs):
            mask = epochs == e
            windows[mask] = self._perm(int(e))[idx[mask]]
        offsets = windows[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        return torch.from_numpy(np.asarray(self.tokens[offsets], dtype=np.int64))

    def data_position(self, step: int) -> int:
        """The batch position in the endless data order that `step` trains on (after skips)."""
        return int(step) + sum(count for at, count in self.skips if step >= at)

    def skip(self, at_step: int, count: int) -> None:
        """From `at_step` on, train on the batches `count` positions later."""
        self.skips.append([int(at_step), int(count)])

    def global_batch_at(self, step: int) -> torch.Tensor:
        """LongTensor [global_batch, seq_len + 1] for `step`."""
        return self._rows(self.data_position(step) * self.global_batch, self.global_batch)

    def local_batch_at(self, step: int, dp_rank: int, dp_size: int) -> torch.Tensor:
        """Rows dp_rank*b .. (dp_rank+1)*b of the global batch, b = global_batch // dp_size."""
        if dp_size < 1 or self.global_batch % dp_size != 0:
            raise ValueError(f"global_batch ({self.global_batch}) must be divisible by dp_size ({dp_size})")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
        b = self.global_batch // dp_size
        return self._rows(self.data_position(step) * self.global_batch + dp_rank * b, b)

    def next_global_batch(self) -> torch.Tensor:
        batch = self.global_batch_at(self.step)
        self.step += 1
        return batch

    def __iter__(self):
        while True:
            yield self.next_global_batch()

    def state_dict(self) -> dict:
        state = {
            "step": self.step,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "num_windows": self.num_windows,
        }
        return {**state, "skips": [list(s) for s in self.skips]} if self.skips else state

    def load_state_dict(self, state: dict) -> None:
        # Resuming with different settings would silently change the data order.
        for key in ("seed", "seq_len", "global_batch", "num_windows"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]}, this sampler has {getattr(self, key)}")
        self.step = int(state["step"])
        self.skips = [[int(at), int(count)] for at, count in state.get("skips", [])]


def check_data(cfg) -> np.ndarray:
    """The data a run needs, checked before any rank starts (and by each rank as a guard); returns
    the tokens. Errors are ConfigErrors: one line naming the field."""
    from fived.config import ConfigError

    d, t = cfg.data, cfg.train
    if d.tokenizer != "byte" and not Path(d.tokenizer).is_file():
        raise ConfigError(
            "data.tokenizer", d.tokenizer, "file not found", "give the path of a Hugging Face tokenizer.json, or 'byte'"
        )
    if d.path and not Path(d.path).exists() and not is_indexed(d.path):
        raise ConfigError(
            "data.path",
            d.path,
            "file not found",
            "give a .bin from `fived prepare-data` or Megatron-LM, a text file, or leave it empty for the bundled corpus",
        )
    try:
        vocab = load_tokenizer(d.tokenizer).vocab_size
        tokens = load_tokens(d.path, d.tokenizer)
    except (ValueError, ImportError) as e:
        raise ConfigError("data", d.path or "bundled corpus", str(e).splitlines()[0]) from None
    if vocab > cfg.model.vocab_size:
        raise ConfigError(
            "model.vocab_size",
            cfg.model.vocab_size,
            f"smaller than the tokenizer's vocabulary ({vocab})",
            f"set --model.vocab_size {vocab}",
        )
    if is_megatron_pair(d.path):
        check_training_data(d.path, tokens, end_of_document=end_of_document_id(cfg), document_mask=d.document_mask)
    largest = largest_token_id(d.path, tokens)
    if largest >= cfg.model.vocab_size:
        raise ConfigError(
            "data.path",
            d.path or "bundled corpus",
            f"holds token id {largest}, beyond the model's vocabulary (model.vocab_size={cfg.model.vocab_size})",
            f"set --model.vocab_size {largest + 1}, or re-tokenize the data with the model's tokenizer",
        )
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
    if d.document_mask and not _holds_token(tokens, end_of_document_id(cfg)):
        raise ConfigError(
            "data.document_mask",
            True,
            f"{d.path or 'the bundled corpus'} holds no end-of-document token ({end_of_document_id(cfg)}): "
            "it is one document, and masking would change nothing",
            "prepare the data with its documents ended (fived prepare-data of a JSON-lines or parquet file), "
            "or set it false",
        )
    validation_data(cfg)
    if t.trace and Path(t.trace).exists():
        raise ConfigError("train.trace", t.trace, "file exists; fived does not overwrite it", "name a new file")
    return tokens


def _holds_token(tokens: np.ndarray, token: int | None, chunk: int = 1 << 24) -> bool:
    """Whether `token` occurs (scanned in chunks: a memory-mapped corpus is not copied whole)."""
    return token is not None and any(bool(np.any(tokens[i : i + chunk] == token)) for i in range(0, len(tokens), chunk))


def end_of_document_id(cfg) -> int | None:
    """The token that ends each document: the token file's (its sidecar), else the tokenizer's."""
    meta = token_metadata(cfg.data.path)
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
    tmp = json_path.with_name(json_path.name + f".tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps({**meta, "max_token_id": {"value": largest, "of": stamp}}, indent=1) + "\n")
        os.replace(tmp, json_path)
    except OSError:  # (a cache only: the value is returned all the same, and nothing is left behind)
        tmp.unlink(missing_ok=True)
    return largest


def adopt_token_metadata(cfg, given: set[str]) -> None:
    """Training on a token file from `fived prepare-data`: its tokenizer (the copy beside the tokens)
    and its vocabulary size, for whichever of data.tokenizer and model.vocab_size was not given.
    (A preset's larger vocabulary is kept: a model may have unused rows.)"""
    meta = token_metadata(cfg.data.path)
    if meta is None:
        return
    if "data.tokenizer" not in given and meta.get("tokenizer", "byte") != "byte":
        copy = meta.get("tokenizer_file")
        cfg.data.tokenizer = str(token_file_paths(cfg.data.path)[1].parent / copy) if copy else meta["tokenizer"]
    if "model.vocab_size" not in given and cfg.model.vocab_size < int(meta.get("vocab_size", 0)):
        cfg.model.vocab_size = int(meta["vocab_size"])


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


def validation_data(cfg) -> np.ndarray | None:
    """The validation tokens when train.eval_every > 0 (checked: one-line ConfigErrors), else None."""
    from fived.config import ConfigError

    t = cfg.train
    for name, value in (("train.eval_every", t.eval_every), ("train.eval_batches", t.eval_batches)):
        if value < 0:
            raise ConfigError(name, value, "must be >= 0", "e.g. 100 (0: off / every whole batch)")
    if t.eval_every == 0:
        return None
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


def validation_sampler(cfg) -> tuple[GlobalBatchSampler | None, int]:
    """The validation data's own sampler and how many of its global batches an evaluation runs: the
    first ones, the same at every evaluation (its position never moves, so evaluating changes no
    training state). (None, 0) without validation data."""
    t = cfg.train
    tokens = validation_data(cfg)
    if tokens is None:
        return None, 0
    sampler = GlobalBatchSampler(tokens, t.seq_len, t.global_batch, t.seed)
    return sampler, validation_batches(cfg, sampler.num_windows)
