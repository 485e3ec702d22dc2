"""Weighted blends of token sources: `--data.blend "0.6 web.bin 0.3 code.bin 0.1 math.bin"`.

Which source a global sample comes from is a pure function of its index in the run's endless sample
sequence, so it is the same at every layout, after a resume and after a reshard. The assignment is
Megatron-LM's BlendedDataset rule, deterministic and low-discrepancy: sample n goes to the source
whose achieved count lags its weight's share of n + 1 samples most (ties: the earlier source). It is
computed once for a period of PERIOD samples and repeats, so any sample's source is found without
history; within every prefix of a period each source's count is within one sample of its share,
and over k periods within k samples (a share error of at most 1 / (PERIOD x weight)).
Each source walks its own windows in its own order (fived.data.loader.WindowOrder); running out
starts a new epoch of that source only.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

from fived.errors import ConfigError

PERIOD = 1 << 16  # samples after which the assignment repeats (see the module's text)
EXAMPLE = '"0.7 web.bin 0.3 code.bin"'


@dataclass(frozen=True)
class BlendSource:
    path: str  # as given (the key of tokens_by_source and loss_by_source)
    weight: float  # normalised: the weights of a blend add up to 1


def parse_blend(text: str, *, field: str = "data.blend") -> tuple[BlendSource, ...]:
    """Megatron's weight-path list -> sources with normalised weights; () for an empty string.
    Bad input is a one-line ConfigError naming `field`."""
    items = text.split()
    if len(items) % 2:
        raise ConfigError(field, text, f"{len(items)} items: expected weight-path pairs", f"e.g. {EXAMPLE}")
    pairs = list(zip(items[0::2], items[1::2]))
    weights = []
    for given, path in pairs:
        try:
            weight = float(given)
        except ValueError:
            raise ConfigError(
                field, text, f"{given!r} (before {path!r}) is not a weight", f"a number > 0 before each path: {EXAMPLE}"
            ) from None
        if not (math.isfinite(weight) and weight > 0):
            raise ConfigError(field, text, f"weight {given} of {path!r} must be a finite number > 0", EXAMPLE)
        weights.append(weight)
    seen: dict[str, str] = {}
    for _, path in pairs:
        key = str(Path(path).expanduser().resolve())
        if key in seen:
            raise ConfigError(
                field,
                text,
                f"{path!r} is given twice (as {seen[key]!r} too)",
                "list each source once, its weights added",
            )
        seen[key] = path
    # normalised exactly (the decimals as written: 0.6 + 0.3 + 0.1 is 1, not float's 0.9999999999999999),
    # so that weights in other words (6 3 1, 60 30 10) are the same floats and draw the same samples
    exact = [_exact(given, weight) for (given, _), weight in zip(pairs, weights)]
    total = sum(exact)
    return tuple(BlendSource(path, float(w / total)) for (_, path), w in zip(pairs, exact))


def same_weights(a, b) -> bool:
    """Whether two blends' normalised weights are the same blend (None: no blend): equal to 1e-12, as
    one blend in other words, or one normalised in floats by fived before 2026-11-30 (0.6 0.3 0.1
    was then 0.6000000000000001, 0.30000000000000004, 0.10000000000000002)."""
    if a is None or b is None:
        return a is None and b is None
    return len(a) == len(b) and all(abs(x - y) <= 1e-12 for x, y in zip(a, b))


def _exact(given: str, weight: float) -> Fraction:
    """The weight as written, exactly (a decimal string); else the float it parsed to."""
    try:
        return Fraction(given)
    except ValueError:  # (what float() reads and Fraction does not, e.g. digits with underscores)
        return Fraction(weight)


@functools.lru_cache(maxsize=4)  # (a run builds its blend's once per sampler; a period is ~0.2 s)
def lagging_assignment(weights: tuple[float, ...], count: int) -> np.ndarray:
    """Sources of samples 0 .. count-1: each the source whose count lags weight x (n + 1) most."""
    taken = [0] * len(weights)
    out = np.empty(count, dtype=np.int32)
    for n in range(count):
        lags = [w * (n + 1) - c for w, c in zip(weights, taken)]
        chosen = lags.index(max(lags))
        taken[chosen] += 1
        out[n] = chosen
    out.flags.writeable = False  # (shared by the cache)
    return out


class BlendSchedule:
    """Global sample index -> (source, that source's own sample index), vectorised, history-free."""

    def __init__(self, weights: list[float] | tuple[float, ...], period: int = PERIOD):
        self.period = int(period)
        self.source = lagging_assignment(tuple(weights), self.period)
        self.per_period = np.bincount(self.source, minlength=len(weights)).astype(np.int64)
        # how many earlier samples of the period came from the same source
        self.rank_in_period = np.empty(self.period, dtype=np.int64)
        for s in range(len(weights)):
            where = np.flatnonzero(self.source == s)
            self.rank_in_period[where] = np.arange(len(where))

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, ordinal within the source) of each global sample position."""
        cycle, offset = np.divmod(np.asarray(positions, dtype=np.int64), self.period)
        source = self.source[offset]
        return source, cycle * self.per_period[source] + self.rank_in_period[offset]
