"""Context parallelism's chunk layouts, and which tokens a windowed layer's halo exchange moves
(`fived.parallel.context_window`), counted from them: what the planner prices.

Without document masking a sequence of S tokens is cut into 2*cp chunks and cp rank i holds chunks
i and 2cp-1-i (the halves layout). A query at position p of a layer with window w sees the keys
p-w+1 .. p, so a chunk starting at c needs the keys [max(0, c-w+1), c) before it; those held by
another rank travel to it, once per (holder, receiver) pair. A ring member of hybrid context
parallelism holds the chunks of its Ulysses group (u consecutive cp ranks). With document masking
the chunks are chosen per sequence (`fived.data.documents`); documents shorter than the window cut
the halo, so the count there is a bound.
"""

from __future__ import annotations

from functools import lru_cache

CHUNKS_PER_RANK = 8  # document masking's work-balanced layout (`fived.data.documents`)


def chunks_per_rank(seq_len: int, cp: int, balance: str) -> int:
    if balance == "halves":
        return 2
    return next(c for c in (CHUNKS_PER_RANK, 4, 2) if seq_len % (c * cp) == 0)


def halves_chunks(cp: int) -> list[list[int]]:
    """The chunks (of 2*cp) each cp rank holds in the halves layout."""
    return [[r, 2 * cp - 1 - r] for r in range(cp)]


def member_chunks(cp: int, ulysses: int = 1) -> list[list[int]]:
    """The chunks (of 2*cp) each ring member holds: a Ulysses group's u consecutive cp ranks'."""
    halves = halves_chunks(cp)
    return [[c for r in range(m * ulysses, (m + 1) * ulysses) for c in halves[r]] for m in range(cp // ulysses)]


def needed_spans(held: list[int], chunk: int, window: int) -> list[tuple[int, int]]:
    """[start, end) ranges, merged, of the positions before the chunks in `held` their windows reach."""
    spans = sorted((max(0, c * chunk - window + 1), c * chunk) for c in held)
    merged: list[tuple[int, int]] = []
    for a, z in spans:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], z))
        elif z > a:
            merged.append((a, z))
    return merged


@lru_cache(maxsize=256)
def halo_tokens(seq_len: int, cp: int, window: int, ulysses: int = 1) -> tuple[tuple[int, int], ...]:
    """(sent, received) tokens of each ring member (cp / ulysses of them) for one sequence of a
    windowed layer in the halves layout; window 0: no halo."""
    chunk = seq_len // (2 * cp)
    held = member_chunks(cp, ulysses)
    # moved[j][m]: tokens member j holds that member m's windows reach
    moved = [[0] * len(held) for _ in held]
    for m, chunks in enumerate(held):
        for a, z in needed_spans(chunks, chunk, window) if window else []:
            for j, theirs in enumerate(held):
                if j != m:
                    moved[j][m] += sum(max(0, min(z, (c + 1) * chunk) - max(a, c * chunk)) for c in theirs)
    return tuple((sum(moved[m]), sum(row[m] for row in moved)) for m in range(len(held)))


def busiest_halo(
    seq_len: int, cp: int, window: int, ulysses: int, chunks: int, kv: int, dkv: int, fwd: int
) -> tuple[int, int]:
    """(bytes sent, bytes received) per sequence by the ring member that sends the most: K, V of
    the tokens its peers' windows reach, `fwd` times forward, and the received tokens' dK, dV home
    (kv, dkv: bytes of one token's K or V, dK or dV). `chunks`: each cp rank's chunks with document
    masking (a bound: each chunk receives the window - 1 tokens before it), 0 without."""
    if chunks:
        bound = min(chunks * ulysses * max(window - 1, 0), seq_len - seq_len * ulysses // cp)
        members: tuple[tuple[int, int], ...] = ((bound, bound),)
    else:
        members = halo_tokens(seq_len, cp, window, ulysses)
    sent, received = max(members, key=lambda t: fwd * t[0] * kv + t[1] * dkv)
    return fwd * sent * 2 * kv + received * 2 * dkv, fwd * received * 2 * kv + sent * 2 * dkv
