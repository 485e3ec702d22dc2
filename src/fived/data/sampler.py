"""The deterministic global-batch sampler.

The sampler is the piece the parallelism checks lean on: the batch for a step is a pure function of
(tokens, seq_len, global_batch, seed, step), and a data-parallel rank's share is just a contiguous
slice of it. So any DP/TP/PP layout sees exactly the same examples as a single device, and resuming
only needs the step number. A weighted blend of sources (fived.data.blend) keeps all of that: which
source a sample comes from is a function of its index alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fived.data.blend import BlendSchedule, BlendSource, same_weights


@dataclass(frozen=True)
class BlendedTokens:
    """The token arrays of a weighted blend's sources (fived.data.blend), in the blend's order."""

    sources: tuple[BlendSource, ...]
    tokens: tuple[np.ndarray, ...]


class WindowOrder:
    """One token source's (seq_len + 1)-token windows in the order a run visits them.

    Window i is tokens[i*seq_len : i*seq_len + seq_len + 1] (inputs = w[:-1], targets = w[1:]), so
    neighbours share one token and every token is predicted once per epoch. Windows are visited in
    a permutation drawn from default_rng([*key, epoch]), epoch after epoch, so the window at any
    position of the endless order is known without history.
    """

    def __init__(self, tokens, seq_len: int, key: tuple[int, ...]):
        self.tokens = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens)
        if self.tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {self.tokens.shape}")
        self.seq_len, self.key = int(seq_len), tuple(int(k) for k in key)
        self.num_windows = max(0, (len(self.tokens) - 1) // self.seq_len)
        # Permutations are pure functions of (key, epoch): keep the last two (a batch of a single
        # source touches at most two epochs; a blend's small source may touch more, recomputed).
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng([*self.key, epoch]).permutation(self.num_windows)
        return self._perms[epoch]

    def rows(self, positions: np.ndarray) -> np.ndarray:
        """int64 [len(positions), seq_len + 1]: the windows at these positions of the order."""
        epochs, idx = np.divmod(np.asarray(positions, dtype=np.int64), self.num_windows)
        windows = np.empty(len(idx), dtype=np.int64)
        for e in np.unique(epochs):
            mask = epochs == e
            windows[mask] = self._perm(int(e))[idx[mask]]
        offsets = windows[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        return np.asarray(self.tokens[offsets], dtype=np.int64)


class GlobalBatchSampler:
    """Deterministic, layout-independent batches of (seq_len + 1)-token windows.

    Step t takes samples t*B .. t*B+B-1 of the run's endless sample sequence, so a batch may
    straddle two epochs and any step can be computed without history. One token source: sample n
    is position n of its WindowOrder (key [seed]). A blend (BlendedTokens): sample n is the next
    sample of the source fived.data.blend assigns it, each source walking its own WindowOrder (key
    [seed, source index]).
    """

    def __init__(self, tokens, seq_len: int, global_batch: int, seed: int):
        if seq_len < 1 or global_batch < 1:
            raise ValueError(f"seq_len ({seq_len}) and global_batch ({global_batch}) must be >= 1")
        self.seq_len, self.global_batch, self.seed = int(seq_len), int(global_batch), int(seed)
        self.schedule: BlendSchedule | None = None
        self.sources: tuple[str, ...] = ()  # a blend's paths, as given
        if isinstance(tokens, BlendedTokens):
            self.orders = [WindowOrder(t, seq_len, (seed, k)) for k, t in enumerate(tokens.tokens)]
            self.schedule = BlendSchedule([s.weight for s in tokens.sources])
            self.sources = tuple(s.path for s in tokens.sources)
            self.weights = [s.weight for s in tokens.sources]
            self.num_windows: int | list[int] = [o.num_windows for o in self.orders]
            for path, order in zip(self.sources, self.orders):
                if order.num_windows < 1:
                    raise ValueError(f"blend source {path} holds fewer than seq_len+1={self.seq_len + 1} tokens")
        else:
            self.orders = [WindowOrder(tokens, seq_len, (seed,))]
            self.num_windows = self.orders[0].num_windows
            if self.num_windows < self.global_batch:
                raise ValueError(
                    f"corpus of {len(self.orders[0].tokens)} tokens has {self.num_windows} windows of "
                    f"{self.seq_len}+1 tokens, fewer than global_batch={self.global_batch}; "
                    "use more data, a shorter seq_len or a smaller batch"
                )
        self.step = 0  # the next step __iter__ / next_global_batch will return
        # [step, count]: from `step` on, batches come `count` positions later (a divergence rollback
        # skipped the data it diverged on; see fived.training.divergence)
        self.skips: list[list[int]] = []

    @property
    def tokens(self):
        """The tokens of a single-source sampler."""
        if self.schedule is not None:
            raise AttributeError("a blend has one token array per source: sampler.orders[i].tokens")
        return self.orders[0].tokens

    def _positions(self, first: int, count: int) -> np.ndarray:
        return np.arange(first, first + count, dtype=np.int64)

    def _rows(self, first: int, count: int) -> torch.Tensor:
        """Samples first .. first+count-1 of the endless sample sequence."""
        pos = self._positions(first, count)
        if self.schedule is None:
            return torch.from_numpy(self.orders[0].rows(pos))
        source, ordinal = self.schedule.locate(pos)
        out = np.empty((count, self.seq_len + 1), dtype=np.int64)
        for s in np.unique(source):
            mask = source == s
            out[mask] = self.orders[int(s)].rows(ordinal[mask])
        return torch.from_numpy(out)

    def _sources(self, first: int, count: int) -> np.ndarray:
        """The source index of samples first .. first+count-1 (all 0 without a blend)."""
        if self.schedule is None:
            return np.zeros(count, dtype=np.int64)
        return self.schedule.locate(self._positions(first, count))[0].astype(np.int64)

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
        return self._rows(*self._local_span(step, dp_rank, dp_size))

    def _local_span(self, step: int, dp_rank: int, dp_size: int) -> tuple[int, int]:
        """(first sample, count) of a dp rank's rows of `step`'s global batch."""
        if dp_size < 1 or self.global_batch % dp_size != 0:
            raise ValueError(f"global_batch ({self.global_batch}) must be divisible by dp_size ({dp_size})")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
        b = self.global_batch // dp_size
        return self.data_position(step) * self.global_batch + dp_rank * b, b

    def global_sources_at(self, step: int) -> np.ndarray:
        """The source index of each row of `step`'s global batch (all 0 without a blend)."""
        return self._sources(self.data_position(step) * self.global_batch, self.global_batch)

    def local_sources_at(self, step: int, dp_rank: int, dp_size: int) -> np.ndarray:
        """The source index of each row local_batch_at returns."""
        return self._sources(*self._local_span(step, dp_rank, dp_size))

    def next_global_batch(self) -> torch.Tensor:
        batch = self.global_batch_at(self.step)
        self.step += 1
        return batch

    def __iter__(self):
        while True:
            yield self.next_global_batch()

    def state_dict(self) -> dict:
        state: dict = {
            "step": self.step,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "num_windows": self.num_windows,
        }
        if self.schedule is not None:  # (a changed weight would change the sample order)
            state["weights"] = list(self.weights)
        return {**state, "skips": [list(s) for s in self.skips]} if self.skips else state

    def load_state_dict(self, state: dict) -> None:
        # Resuming with different settings would silently change the data order.
        mine = self.state_dict()
        for key in ("seed", "seq_len", "global_batch", "num_windows"):
            if key in state and state[key] != mine.get(key):
                raise ValueError(f"sampler state has {key}={state.get(key)}, this sampler has {mine.get(key)}")
        # a blend's weights, absent without one (either side lacking them is a change too); the same blend
        # in other floats (`same_weights`) continues the checkpoint's order: its own weights, exactly
        if not same_weights(state.get("weights"), mine.get("weights")):
            raise ValueError(
                f"sampler state has weights={state.get('weights')}, this sampler has {mine.get('weights')}"
            )
        if state.get("weights") is not None and state["weights"] != self.weights:
            self.weights = [float(w) for w in state["weights"]]
            self.schedule = BlendSchedule(self.weights)
        self.step = int(state["step"])
        self.skips = [[int(at), int(count)] for at, count in state.get("skips", [])]
