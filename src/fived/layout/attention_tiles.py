"""The query tiles fived's blockwise attention kernels (`fived.model.attention`) cut a row into, and
the (query, key) pairs a windowed layer's kernel calls compute, counted from those tiles and from
the halves layout's chunks (`fived.layout.cp_chunks`): what the planner prices for a windowed layer.

A row's queries go in tiles: a long document's in tiles of QUERY_TILE, consecutive short documents'
together up to PACKED_TILE; a windowed layer's tiles hold at most `window` queries. A windowed
tile's keys run from its first query's position - window + 1 to its last query, all of them
computed (with a mask: no kernel skips a block), in the rank's own block and in the halo block it
receives (`fived.parallel.context_window`), each a contiguous range of that block's keys.
"""

from __future__ import annotations

import bisect
import itertools
from functools import lru_cache

from fived.layout.cp_chunks import member_chunks, needed_spans

QUERY_TILE = 512
PACKED_TILE = 128  # short documents' queries share a tile up to this many


def query_tiles(bounds: list[int], tile: int = QUERY_TILE, packed: int = PACKED_TILE) -> list[tuple[int, int]]:
    """[first, end) of each query tile of one row whose documents start at `bounds` (and the row
    ends at its last): a long document's queries in tiles of `tile`, consecutive short documents
    packed while the tile stays within `packed` (a packed tile computes every (query, key) pair of
    its span, so its waste is bounded by its length)."""
    tiles, open_at = [], 0
    for start, end in itertools.pairwise(bounds):
        if end - open_at <= packed:
            continue  # (the open tile grows to `end`)
        if start > open_at:
            tiles.append((open_at, start))
        if end - start <= packed:
            open_at = start
            continue
        tiles += [(t, min(t + tile, end)) for t in range(start, end, tile)]
        open_at = end
    if open_at < bounds[-1]:
        tiles.append((open_at, bounds[-1]))
    return tiles


def split_tiles(tiles: list[tuple[int, int]], window: int) -> list[tuple[int, int]]:
    """Tiles of at most `window` queries (0: as they are)."""
    if not window:
        return tiles
    return [(t, min(t + window, z)) for a, z in tiles for t in range(a, z, window)]


class _Held:
    """Sorted disjoint [start, end) position spans: the i-th position, and how many lie below x."""

    def __init__(self, spans: list[tuple[int, int]]):
        self.spans = spans
        self.before = list(itertools.accumulate((z - a for a, z in spans), initial=0))

    def position(self, i: int) -> int:
        at = bisect.bisect_right(self.before, i) - 1
        return self.spans[at][0] + i - self.before[at]

    def below(self, x: int) -> int:
        return sum(min(max(x - a, 0), z - a) for a, z in self.spans)


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, z in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], z))
        else:
            out.append((a, z))
    return out


def _minus(spans: list[tuple[int, int]], held: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """`spans` without the positions in `held` (both merged)."""
    out = []
    for a, z in spans:
        for ha, hz in held:
            if ha < z and hz > a:
                out.append((a, ha))
                a = max(a, hz)
        out.append((a, z))
    return _merged(out)


@lru_cache(maxsize=256)
def window_pairs(seq_len: int, cp: int, window: int, ulysses: int = 1) -> tuple[int, ...]:
    """(query, key) pairs the kernel calls of a windowed layer (`window` > 0) compute for one sequence
    on each ring member (cp / ulysses of them; one member: the whole sequence, without context
    parallelism or under Ulysses alone), halves layout: its own block's and its received halo's."""
    chunk = seq_len // (2 * cp)
    pairs = []
    for chunks in member_chunks(cp, ulysses):
        own = _Held(_merged([(c * chunk, (c + 1) * chunk) for c in chunks]))
        halo = _Held(_minus(needed_spans(chunks, chunk, window), own.spans))
        count = 0
        for a, z in split_tiles(query_tiles([0, len(chunks) * chunk]), window):
            first, last = own.position(a), own.position(z - 1)
            for keys in (own, halo):
                count += (z - a) * max(0, keys.below(last + 1) - keys.below(first - window + 1))
        pairs.append(count)
    return tuple(pairs)
