"""Tokenizers, token files and the deterministic global-batch sampler.

The sampler is the piece the parallelism checks lean on: the batch for a step is
a pure function of (tokens, seq_len, global_batch, seed, step), and a data-parallel
rank's share is just a contiguous slice of it. So any DP/TP/PP layout sees exactly
the same examples as a single device, and resuming only needs the step number.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

TOKEN_FORMAT = "fived-tokens-v1"


class ByteTokenizer:
    """UTF-8 bytes as tokens: no files, no dependencies, works on any text."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        # A model can emit a byte sequence that is not valid UTF-8; show it, don't fail.
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizer.json`, for users who bring their own vocabulary."""

    def __init__(self, path: str | Path):
        try:
            import tokenizers  # imported here so the byte path needs no extra package
        except ImportError as e:
            raise ImportError(
                f"tokenizer {str(path)!r} needs the Hugging Face tokenizers package: "
                "pip install tokenizers"
            ) from e
        if not Path(path).is_file():
            raise ValueError(f"tokenizer file not found: {path}")
        self.path = str(path)
        self._tok = tokenizers.Tokenizer.from_file(self.path)
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def load_tokenizer(name: str):
    """"byte" -> ByteTokenizer; anything else is taken as a path to a tokenizer.json."""
    if name == "byte":
        return ByteTokenizer()
    return HFTokenizer(name)


def bundled_corpus_path() -> Path:
    """The small English corpus shipped with the package (see assets/CORPUS.md)."""
    return Path(__file__).parent / "assets" / "corpus.txt"


def _token_dtype(vocab_size: int):
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
    return np.asarray(tok.encode(text), dtype=_token_dtype(tok.vocab_size))


def _split_output(path: str | Path) -> tuple[Path, Path]:
    """`x` or `x.bin` -> (x.bin, x.json)."""
    p = str(path)
    base = p[: -len(".bin")] if p.endswith(".bin") else p
    return Path(base + ".bin"), Path(base + ".json")


def prepare_data(inputs: list[str | Path], output: str | Path, tokenizer: str = "byte") -> Path:
    """Tokenize text files (in order) into `<output>.bin` plus a `<output>.json` sidecar.

    Both are written to temporary files and renamed into place at the end, so a failure
    never leaves a half-written file behind or clobbers a good one.
    """
    inputs = [Path(p) for p in inputs]
    if not inputs:
        raise ValueError("prepare_data needs at least one input file")
    for p in inputs:  # check everything before creating anything
        if not p.is_file():
            raise ValueError(f"data file not found: {p}")
    tok = load_tokenizer(tokenizer)
    dtype = _token_dtype(tok.vocab_size)
    bin_path, json_path = _split_output(output)
    bin_path.parent.mkdir(parents=True, exist_ok=True)

    tmp_paths = []
    try:
        fd, tmp_bin = tempfile.mkstemp(dir=bin_path.parent, prefix=bin_path.name + ".", suffix=".tmp")
        tmp_paths.append(tmp_bin)
        num_tokens = 0
        with os.fdopen(fd, "wb") as f:
            for p in inputs:  # one file at a time keeps memory bounded by the largest file
                ids = np.asarray(tok.encode(_read_text(p)), dtype=dtype)
                ids.tofile(f)
                num_tokens += ids.size
        meta = {
            "format": TOKEN_FORMAT,
            "dtype": np.dtype(dtype).name,
            "num_tokens": num_tokens,
            "vocab_size": tok.vocab_size,
            "tokenizer": tokenizer,
        }
        fd, tmp_json = tempfile.mkstemp(dir=json_path.parent, prefix=json_path.name + ".", suffix=".tmp")
        tmp_paths.append(tmp_json)
        with os.fdopen(fd, "w") as f:
            json.dump(meta, f, indent=2)
            f.write("\n")
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_json, json_path)
    except BaseException:
        for t in tmp_paths:
            if os.path.exists(t):
                os.remove(t)
        raise
    return bin_path


def load_tokens(path: str | Path | None, tokenizer: str = "byte") -> np.ndarray:
    """A 1-D integer token array: the bundled corpus, a prepared token file, or a text file.

    Prepared files are memory-mapped read-only, so corpora larger than RAM work.
    """
    if path is None or str(path) == "":
        return _tokenize(_read_text(bundled_corpus_path()), tokenizer)
    bin_path, json_path = _split_output(path)
    if str(path).endswith(".bin") or (json_path.is_file() and bin_path.is_file()):
        if not bin_path.is_file() or not json_path.is_file():
            raise ValueError(f"token file needs both {bin_path} and {json_path}")
        meta = json.loads(json_path.read_text())
        if meta.get("format") != TOKEN_FORMAT:
            raise ValueError(f"{json_path}: not a {TOKEN_FORMAT} sidecar")
        dtype, n = np.dtype(meta["dtype"]), int(meta["num_tokens"])
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

    def global_batch_at(self, step: int) -> torch.Tensor:
        """LongTensor [global_batch, seq_len + 1] for `step`."""
        return self._rows(int(step) * self.global_batch, self.global_batch)

    def local_batch_at(self, step: int, dp_rank: int, dp_size: int) -> torch.Tensor:
        """Rows dp_rank*b .. (dp_rank+1)*b of the global batch, b = global_batch // dp_size."""
        if dp_size < 1 or self.global_batch % dp_size != 0:
            raise ValueError(f"global_batch ({self.global_batch}) must be divisible by dp_size ({dp_size})")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
        b = self.global_batch // dp_size
        return self._rows(int(step) * self.global_batch + dp_rank * b, b)

    def next_global_batch(self) -> torch.Tensor:
        batch = self.global_batch_at(self.step)
        self.step += 1
        return batch

    def __iter__(self):
        while True:
            yield self.next_global_batch()

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed, "seq_len": self.seq_len,
                "global_batch": self.global_batch, "num_windows": self.num_windows}

    def load_state_dict(self, state: dict) -> None:
        # Resuming with different settings would silently change the data order.
        for key in ("seed", "seq_len", "global_batch", "num_windows"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]}, this sampler has {getattr(self, key)}")
        self.step = int(state["step"])


def check_data(cfg) -> np.ndarray:
    """The data a run needs, checked before any rank starts (and by each rank as a guard); returns
    the tokens. Errors are ConfigErrors: one line naming the field."""
    from fived.config import ConfigError

    d, t = cfg.data, cfg.train
    if d.tokenizer != "byte" and not Path(d.tokenizer).is_file():
        raise ConfigError("data.tokenizer", d.tokenizer, "file not found",
                          "give the path of a Hugging Face tokenizer.json, or 'byte'")
    if d.path and not Path(d.path).exists():
        raise ConfigError("data.path", d.path, "file not found",
                          "give a .bin from `fived prepare-data`, a text file, or leave it empty for the bundled corpus")
    try:
        vocab = load_tokenizer(d.tokenizer).vocab_size
        tokens = load_tokens(d.path, d.tokenizer)
    except (ValueError, ImportError) as e:
        raise ConfigError("data", d.path or "bundled corpus", str(e).splitlines()[0]) from None
    if vocab > cfg.model.vocab_size:
        raise ConfigError("model.vocab_size", cfg.model.vocab_size, f"smaller than the tokenizer's vocabulary ({vocab})",
                          f"set --model.vocab_size {vocab}")
    windows = max(0, (len(tokens) - 1) // t.seq_len)
    if windows < t.global_batch:
        raise ConfigError("train.global_batch", t.global_batch,
                          f"the data holds only {windows} sequences of seq_len={t.seq_len}",
                          "use more data, a shorter seq_len or a smaller global batch")
    if t.trace and Path(t.trace).exists():
        raise ConfigError("train.trace", t.trace, "file exists; fived does not overwrite it", "name a new file")
    return tokens
