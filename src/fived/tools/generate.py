"""`fived generate SOURCE --prompt TEXT`: continue a prompt with a trained model, in one process
(CPU or one GPU). SOURCE is a run directory or checkpoint (its newest complete one; whatever layout
wrote it), or a Hugging Face model directory.

Greedy by default; --temperature T > 0 samples (after --top-p nucleus filtering) with --seed.
Keys and values are cached: the prompt runs once, then each step runs only the new token. The cache
is a replacement of each attention's core (the same seam context parallelism uses), so the model
code knows nothing of generation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fived.config import ConfigError
from fived.layout.spec import cached_positions
from fived.model.latent_attention import LatentAttention
from fived.model.transformer import Transformer


class KVCachedAttentionCore(nn.Module):
    """Causal attention over every position seen so far, keeping the keys and values of earlier
    calls in a cache allocated once, at the prompt, for a sequence of `capacity` positions (the
    prompt and every output token: what a serving engine reserves for a sequence). The first call
    (the prompt) is causal attention over its own keys; each later one brings one new position,
    which sees every cached key.

    A windowed layer (`window` > 0) caches only the last `window` positions
    (`fived.layout.spec.cached_positions`, which `fived plan --serve` prices too): a ring whose slot
    p % window holds position p, so a new position overwrites the one its query no longer sees.
    The keys are cached after the rotation, so a slot's order does not matter; the masks read each
    slot's position (`_key_positions`). `sinks` (GPT-OSS's per-head logits) join every row's
    softmax (`_local_attention`).

    `key_mask` ([batch, capacity], True for a real token): left-padded prompts of a batch. A query
    then sees the real keys up to it, and a padding query only itself (a row with no key would be NaN
    and flow into the next layer's keys and the experts' routing)."""

    def __init__(self, capacity: int, key_mask: torch.Tensor | None = None, *, window: int = 0):
        super().__init__()
        self.capacity, self.key_mask, self.window = capacity, key_mask, window
        self.slots = cached_positions(window, capacity)
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.length = 0  # positions seen so far

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds (keys and values, every slot)."""
        return sum(t.untyped_storage().nbytes() for t in (self.keys, self.values) if t is not None)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents=None, positions=None, sinks=None
    ) -> torch.Tensor:
        """(`documents`, `positions`: a prompt is one document; the rotation already used its positions.)"""
        start, s = self.length, q.shape[1]
        if self.keys is None or self.values is None:
            shape = (k.shape[0], self.slots) + tuple(k.shape[2:])
            self.keys, self.values = k.new_zeros(shape), v.new_zeros(shape)
        self._claim(s)
        self._store(self.keys, k)
        self._store(self.values, v)
        if not start:  # (the prompt sees its own keys, the ones a ring already dropped included)
            return self._attend(q, k, v, start, sinks)
        held = min(self.length, self.slots)
        return self._attend(q, self.keys[:, :held], self.values[:, :held], start, sinks)

    def _store(self, cache: torch.Tensor, new: torch.Tensor) -> None:
        """Write the new positions (the last `slots` of them) to their slots, p % slots: up to the
        ring's end, the rest from its start (plain slices: a decode step's op count stays the same)."""
        kept = min(new.shape[1], self.slots)
        if kept < new.shape[1]:
            new = new[:, -kept:]
        first = (self.length - kept) % self.slots
        head = min(kept, self.slots - first)
        cache[:, first : first + head] = new[:, :head] if head < kept else new
        if head < kept:
            cache[:, : kept - head] = new[:, head:]

    def _key_positions(self, start: int, device: torch.device) -> torch.Tensor:
        """The position of each key `_attend` gets: the prompt's own, or each held slot's (the latest
        p < length with p % slots == slot)."""
        if not start or self.length <= self.slots:  # (the prompt, or a ring not yet wrapped)
            return torch.arange(self.length, device=device)
        slot = torch.arange(self.slots, device=device)
        return slot + (self.length - 1 - slot) // self.slots * self.slots

    def _claim(self, s: int) -> None:
        """Take the next `s` positions of the sequence (the prompt, then one at a time)."""
        if self.length and s != 1:
            raise ValueError("after the prompt, each call brings one new position")
        if self.length + s > self.capacity:
            raise ValueError(f"the cache holds {self.capacity} positions; position {self.length + s - 1} does not fit")
        self.length += s

    def _attend(self, q, k, v, start: int, sinks) -> torch.Tensor:
        """Queries of positions start.. over the keys and values `_key_positions` names."""
        s = q.shape[1]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        gqa = q.shape[1] != k.shape[1]
        if self.window or sinks is not None:
            out = _local_attention(q, k, v, self._allowed(start, s, self._key_positions(start, q.device)), sinks)
        elif self.key_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=start == 0, enable_gqa=gqa)
        else:
            mask = self._mask(start, s, self._key_positions(start, q.device))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return out.transpose(1, 2)

    def _mask(self, start: int, s: int, key_positions: torch.Tensor) -> torch.Tensor:
        """[batch, 1, queries, keys]: causal over real keys; a padding query sees itself."""
        assert self.key_mask is not None  # (only a left-padded batch masks keys)
        query = torch.arange(start, start + s, device=key_positions.device)[:, None]
        key = key_positions[None, :]
        real = self.key_mask[:, None, key_positions]
        return ((key <= query) & real | (key == query))[:, None]

    def _allowed(self, start: int, s: int, key_positions: torch.Tensor) -> torch.Tensor:
        """[batch or 1, 1, queries, keys]: `_mask` (or causal), within the window."""
        query = torch.arange(start, start + s, device=key_positions.device)[:, None]
        key = key_positions[None, :]
        allowed = self._mask(start, s, key_positions) if self.key_mask is not None else (key <= query)[None, None]
        return allowed & (key > query - self.window) if self.window else allowed


class LatentCachedAttentionCore(KVCachedAttentionCore):
    """The cache of a multi-head latent attention (fived.model.latent_attention): per position the
    normed kv latent and the rotated rope key all heads share (kv_lora_rank + qk_rope_head_dim
    elements, whole on every tensor-parallel rank), not per-head keys and values. The attention hands
    them to `remember_latent` and up-projects what it returns (every position so far) each step: the
    same products as the uncached forward, so the same ids."""

    def __init__(self, capacity: int, key_mask: torch.Tensor | None = None):
        super().__init__(capacity, key_mask)
        self.latent: torch.Tensor | None = None
        self.rope_key: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds (latents and rope keys, the whole capacity)."""
        return sum(t.untyped_storage().nbytes() for t in (self.latent, self.rope_key) if t is not None)

    def remember_latent(self, latent: torch.Tensor, rope_key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache the new positions' latent [b, s, rank] and rope key [b, s, 1, rope]; every position's so far."""
        start, s = self.length, latent.shape[1]
        if self.latent is None or self.rope_key is None:
            self.latent = latent.new_zeros((latent.shape[0], self.capacity) + tuple(latent.shape[2:]))
            self.rope_key = rope_key.new_zeros((rope_key.shape[0], self.capacity) + tuple(rope_key.shape[2:]))
        self._claim(s)
        self.latent[:, start : start + s], self.rope_key[:, start : start + s] = latent, rope_key
        return self.latent[:, : self.length], self.rope_key[:, : self.length]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents=None, positions=None, sinks=None
    ) -> torch.Tensor:
        """k, v: up-projected from `remember_latent`'s answer (every position); q: the new positions."""
        return self._attend(q, k, v, self.length - q.shape[1], sinks)


def cache_core(attention: nn.Module, capacity: int, key_mask: torch.Tensor | None = None) -> KVCachedAttentionCore:
    """The generation cache replacing one attention's core: latent and rope key for a multi-head
    latent attention, else keys and values (a rolling cache of the layer's sliding window, if any)."""
    if isinstance(attention, LatentAttention):
        return LatentCachedAttentionCore(capacity, key_mask)
    return KVCachedAttentionCore(capacity, key_mask, window=getattr(attention.core, "window", 0))


def _local_attention(q, k, v, allowed: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """[b, h, s, d] attention on explicit scores under `allowed`, with the sinks' column in each
    row's softmax (dropped after it), as transformers' eager GPT-OSS attention."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        column = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, column], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., : k.shape[2]]
    return probs @ v


@dataclass
class Sampling:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """Greedy, or a draw from the smallest set of most likely tokens whose probability reaches top_p."""
    if sampling.temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.double() / sampling.temperature, dim=-1)
    ordered, order = probs.sort(descending=True)
    keep = (ordered.cumsum(0) - ordered) < sampling.top_p  # (the most likely token always stays)
    kept = ordered * keep
    choice = torch.multinomial((kept / kept.sum()).cpu(), 1, generator=generator)
    return int(order[choice.to(order.device)])


@torch.no_grad()
def generate(
    model: Transformer, prompt: list[int], sampling: Sampling, stop_ids: frozenset[int] | set[int] = frozenset()
) -> list[int]:
    """The ids generated after `prompt` (at most max_new_tokens; ends early at a stop id)."""
    model.eval()
    for block in model.blocks():
        block.attention.core = cache_core(block.attention, len(prompt) + sampling.max_new_tokens)
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(sampling.seed)
    logits = model(torch.tensor([prompt], device=device), positions=torch.arange(len(prompt), device=device))
    out: list[int] = []
    while len(out) < sampling.max_new_tokens:
        token = next_token(logits[0, -1], sampling, generator)
        out.append(token)
        if token in stop_ids:
            break
        position = torch.tensor([len(prompt) + len(out) - 1], device=device)
        logits = model(torch.tensor([[token]], device=device), positions=position)
    return out


def describe_source(source: str):
    """(model config, tokenizer name or path, stop ids) of a run, a checkpoint or a Hugging Face directory."""
    from fived.hf.init import is_hf_directory

    if is_hf_directory(source):
        from fived.hf.config_map import model_config_from_hf, read_config, special_token_ids

        cfg = model_config_from_hf(read_config(source), source)
        tokenizer_file = Path(source) / "tokenizer.json"
        tokenizer = str(tokenizer_file) if tokenizer_file.is_file() else "byte"
        stop = special_token_ids(source).get("eos_token_id")
    else:
        from fived.hf.export import run_special_tokens

        run = _saved_run(source)
        cfg, tokenizer = run.model, run.data.tokenizer
        stop = run_special_tokens(run).get("eos_token_id")
    return cfg, tokenizer, frozenset(stop if isinstance(stop, list) else [] if stop is None else [stop])


def trained_context(source: str) -> int | None:
    """The sequence length a run trained at, or a Hugging Face model's max_position_embeddings."""
    from fived.hf.init import is_hf_directory

    if is_hf_directory(source):
        from fived.hf.config_map import read_config

        return read_config(source).get("max_position_embeddings")
    return _saved_run(source).train.seq_len


def load_model(source: str, dtype: torch.dtype, device: str):
    """(model, tokenizer name or path, stop ids) from a run, a checkpoint or a Hugging Face directory."""
    from fived.hf.init import is_hf_directory
    from fived.model.transformer import build_model, materialize

    cfg, tokenizer, stop_ids = describe_source(source)
    if is_hf_directory(source):
        from fived.hf.init import whole_state

        state = whole_state(source, cfg, dtype)
    else:
        state = _checkpoint_state(source, cfg)
    model = build_model(cfg, "meta", dtype)
    materialize(model, device)
    for _, buffer in model.named_buffers():
        buffer.zero_()
    missing, _ = model.load_state_dict(state, strict=False)
    missing = [
        m for m in missing if not m.endswith("router_bias") and not (cfg.tie_embeddings and m == "output.weight")
    ]
    if missing:
        raise ConfigError("source", source, f"has no value for {missing[0]}", "give a complete model")
    return model, tokenizer, stop_ids


def _saved_run(source: str):
    """The config a run or checkpoint was saved with."""
    from fived.checkpoint.checkpointer import find_checkpoint, saved_config

    checkpoint = find_checkpoint(source, "source") if Path(source).is_dir() else None
    if checkpoint is None:
        raise ConfigError(
            "source",
            source,
            "is neither a fived run or checkpoint nor a Hugging Face model directory (config.json)",
            "give one of those",
        )
    return saved_config(checkpoint, "source")[1]


def _checkpoint_state(source: str, cfg) -> dict:
    from fived.checkpoint import dcp_io
    from fived.checkpoint.checkpointer import find_checkpoint
    from fived.model.transformer import build_model, canonical_name

    meta = build_model(cfg)
    names = [canonical_name(n) for n, _ in [*meta.named_parameters(), *meta.named_buffers()]]
    checkpoint = find_checkpoint(source, "source")
    assert checkpoint is not None  # (describe_source found the run's checkpoint)
    whole = dcp_io.read_whole(checkpoint, [f"model.{n}" for n in names])
    return {n: whole[f"model.{n}"] for n in names}
