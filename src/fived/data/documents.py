"""Documents in packed sequences: what document masking gives the model, and which tokens of a
sequence each context-parallel rank holds.

A packed window holds the ends of documents (each ends with the end-of-document token, which belongs
to the document it ends); with `data.document_mask` a token attends only to earlier tokens of its own
document and its rotary position restarts at its document's first token. Both are computed from the
tokens alone, per window, so every layout derives the same (documents, positions) for every token:
the document structure reaches attention as data (`Transformer.forward(..., documents=, positions=)`).

Context parallelism cuts each sequence into equal chunks and gives every cp rank the same number of
them (tensors keep one shape). Without document masking the chunks are the halves layout (2*cp chunks,
rank i holds i and 2cp-1-i: even causal work for one document). With document masking the work of a
chunk is the number of (query, key) pairs its queries attend to — the sum over its tokens of their
position in their document, plus one — and depends on where the documents fall, so `cp_balance="work"`
chooses the chunks per sequence: CHUNKS_PER_RANK chunks per rank (fewer when seq_len does not divide),
assigned largest work first, each to the rank with the least work so far among those not yet full
(ties: lower chunk index, lower rank). Deterministic, a function of the tokens only, so every rank
computes the same assignment without communication, and a resumed or resharded run the same again.
A rank's chunks are kept in sequence order (its tokens' order keys increase, which the
document-masked kernels rely on).
"""

from __future__ import annotations

import torch

from fived.layout.cp_chunks import CHUNKS_PER_RANK, chunks_per_rank, halves_chunks  # noqa: F401 (re-exported)

NO_TARGET = -100  # multi-token prediction: a future token past the sequence's end


def document_structure(inputs: torch.Tensor, end_of_document: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(documents, positions), each [b, s] int64: the index of each token's document in its window
    (a window starts inside its first document) and the token's position inside that document."""
    ends = (inputs == end_of_document).long()
    documents = torch.cumsum(ends, dim=1) - ends  # the end token belongs to the document it ends
    index = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
    starts = torch.where(documents != torch.nn.functional.pad(documents, (1, -1), value=-1), index, 0)
    return documents, index - torch.cummax(starts, dim=1).values


def balanced_chunks(work: list[int], cp: int) -> list[list[int]]:
    """The chunks (indices) each of `cp` ranks holds, len(work)/cp each, attention work balanced
    (see the module's docstring); each rank's list in sequence order."""
    per_rank = len(work) // cp
    load = [0] * cp
    held: list[list[int]] = [[] for _ in range(cp)]
    for chunk in sorted(range(len(work)), key=lambda c: (-work[c], c)):
        rank = min((r for r in range(cp) if len(held[r]) < per_rank), key=lambda r: (load[r], r))
        held[rank].append(chunk)
        load[rank] += work[chunk]
    return [sorted(h) for h in held]


def chunk_assignment(positions: torch.Tensor, cp: int, balance: str) -> list[list[list[int]]]:
    """Per sequence of `positions` [b, S] (in-document positions), the chunks each cp rank holds."""
    n = cp * chunks_per_rank(positions.shape[1], cp, balance)
    if balance == "halves":
        return [halves_chunks(cp)] * positions.shape[0]
    work = (positions + 1).reshape(positions.shape[0], n, -1).sum(dim=-1).tolist()
    return [balanced_chunks(row, cp) for row in work]


def rank_work(positions: torch.Tensor, assignment: list[list[list[int]]]) -> list[int]:
    """Attention work ((query, key) pairs) of each cp rank's tokens under `assignment`, summed over
    the sequences of `positions` [b, S]."""
    cp = len(assignment[0])
    per_chunk = (positions + 1).reshape(positions.shape[0], cp * len(assignment[0][0]), -1).sum(dim=-1).tolist()
    return [sum(per_chunk[b][c] for b, ranks in enumerate(assignment) for c in ranks[r]) for r in range(cp)]


def local_token_index(assignment: list[list[list[int]]], seq_len: int, rank: int, device=None) -> torch.Tensor:
    """[b, S/cp]: the sequence indices of the tokens cp rank `rank` holds, per sequence, in order."""
    chunk = seq_len // (len(assignment[0]) * len(assignment[0][rank]))
    rows = [torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in ranks[rank]]) for ranks in assignment]
    return torch.stack(rows).to(device)


class RankBatches:
    """A rank's batch rows [b, S+1] -> (inputs, targets, model keyword arguments): this cp rank's
    tokens, and with document masking each token's document and in-document position."""

    def __init__(
        self,
        *,
        end_of_document: int | None,
        cp: int,
        cp_rank: int,
        balance: str,
        fixed_positions: torch.Tensor | None,
        mtp_depth: int = 0,
    ):
        """`end_of_document`: None without document masking; `fixed_positions`: the halves layout's
        positions of this cp rank (context parallelism without document masking), else None;
        `mtp_depth` > 0: also each token's next tokens (`future_tokens`), cut like the inputs."""
        self.end_of_document, self.cp, self.cp_rank, self.balance = end_of_document, cp, cp_rank, balance
        self.mtp_depth = mtp_depth
        self.fixed_positions = fixed_positions
        self.last_rank_work: list[int] = []  # attention work per cp rank of the last batch (document masking)

    def work_spread(self) -> dict:
        """{"cp_work_spread": the last batch's attention work on the busiest cp rank over the mean}
        (document masking under context parallelism; else {}): for the step's record and `fived diagnose`."""
        if not self.last_rank_work:
            return {}
        return {
            "cp_work_spread": max(self.last_rank_work) * len(self.last_rank_work) / max(sum(self.last_rank_work), 1)
        }

    def __call__(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        # (computed on the whole sequence, then cut: a shift across a cp chunk's edge reads the right token)
        future = {"mtp_tokens": future_tokens(batch, self.mtp_depth)} if self.mtp_depth else {}
        if self.end_of_document is None:
            if self.fixed_positions is not None:
                inputs, targets = inputs[:, self.fixed_positions], targets[:, self.fixed_positions]
                future = {k: v[:, self.fixed_positions] for k, v in future.items()}
            return inputs, targets, future
        documents, positions = document_structure(inputs, self.end_of_document)
        if self.cp > 1:
            assignment = chunk_assignment(positions, self.cp, self.balance)
            self.last_rank_work = rank_work(positions, assignment)
            index = local_token_index(assignment, positions.shape[1], self.cp_rank, positions.device)
            inputs, targets, documents, positions = (
                t.gather(1, index) for t in (inputs, targets, documents, positions)
            )
            future = {k: v.gather(1, index[..., None].expand(-1, -1, v.shape[-1])) for k, v in future.items()}
        return inputs, targets, {"documents": documents, "positions": positions, **future}


def future_tokens(batch: torch.Tensor, depth: int) -> torch.Tensor:
    """[b, S, depth+1]: for each input position t of rows [b, S+1], the tokens t+1 .. t+depth+1 (column
    0: the targets), NO_TARGET past the row's end (fived.model.mtp reads a negative id as no target)."""
    s = batch.shape[1] - 1
    padded = torch.cat([batch, batch.new_full((batch.shape[0], depth), NO_TARGET)], dim=1)
    return torch.stack([padded[:, 1 + j : 1 + j + s] for j in range(depth + 1)], dim=-1)


def split_micro_batches(inputs: torch.Tensor, targets: torch.Tensor, extra: dict, micro: int):
    """[(inputs, targets, keyword arguments)] of each of `micro` micro-batches (rows split evenly)."""
    pieces = {key: value.chunk(micro) for key, value in extra.items()}
    return [
        (i, t, {key: chunks[n] for key, chunks in pieces.items()})
        for n, (i, t) in enumerate(zip(inputs.chunk(micro), targets.chunk(micro)))
    ]
