"""`fived prepare-data --format megatron`: the same documents and tokens as fived's own token file,
written as Megatron-LM's indexed dataset (`<output>.bin` + `<output>.idx`, fived.data.indexed).

Each document is one sequence ending with the end-of-document token (Megatron's preprocess_data with
`--append-eod`), so fived finds the documents again for document masking, and megatron-core's
`IndexedDataset` reads each one as `dataset[i]`. No sidecar is written (Megatron's readers would not
read one): training on the pair takes `--data.tokenizer` (and `--model.vocab_size`) as given.
`val_fraction` holds out the last documents, cut at the document end nearest the fraction, as
`<output>.val.bin` + `.val.idx`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fived.data.indexed import megatron_dtype, pair_paths, write_index
from fived.data.prepare import checked_inputs, count_tokens, move_tail, publishing, refuse_existing, temporary


def validation_documents(lengths: np.ndarray, fraction: float) -> int:
    """How many leading documents stay training data: the cut is the document end nearest
    (1 - fraction) of the tokens that leaves both parts a document."""
    if len(lengths) < 2:
        raise ValueError(f"{len(lengths)} document(s) cannot be split into training and validation data")
    ends = np.cumsum(lengths)[:-1]  # a cut after each document but the last
    target = round(int(lengths.sum()) * (1.0 - fraction))
    return int(np.abs(ends - target).argmin()) + 1


def prepare_megatron(
    inputs: list[str | Path],
    output: str | Path,
    *,
    tokenizer: str = "byte",
    text_field: str = "text",
    val_fraction: float = 0.0,
    split: str = "train",
) -> Path:
    """Tokenize `inputs` (in order; as fived.data.prepare.prepare_data reads them) into the pair;
    returns the .bin. Temporary files renamed into place at the end, the .idx last: a failure leaves
    nothing behind."""
    paths, tok = checked_inputs(inputs, tokenizer, val_fraction)
    dtype = megatron_dtype(tok.vocab_size)
    bin_path, idx_path = pair_paths(output)
    val_bin, val_idx = pair_paths(str(bin_path)[: -len(".bin")] + ".val")
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    refuse_existing([bin_path, idx_path, *([val_bin, val_idx] if val_fraction > 0 else [])], paths)
    with publishing([]) as moves:
        tmp_bin = temporary(bin_path, moves)
        batches: list[np.ndarray] = []
        with open(tmp_bin, "wb") as f:
            num_tokens, _ = count_tokens(paths, tok, dtype, f, text_field, split, batches)
        lengths = np.concatenate(batches) if batches else np.zeros(0, np.int64)
        if val_fraction > 0:
            keep = validation_documents(lengths, val_fraction)
            cut = int(lengths[:keep].sum())
            move_tail(tmp_bin, dtype=dtype, num_tokens=num_tokens, cut=cut, to=temporary(val_bin, moves))
            write_index(temporary(val_idx, moves), dtype=dtype, document_lengths=lengths[keep:])
            lengths = lengths[:keep]
        write_index(temporary(idx_path, moves), dtype=dtype, document_lengths=lengths)
    return bin_path
