"""`fived prepare-data` reads .txt, .jsonl, .parquet and saved Hugging Face datasets into the same
tokens (each document ended by the end-of-document token), streaming; holds out a validation split
at a document end; writes files every user can read; names its tokenizer so that training on the
result needs no tokenizer or vocabulary flags."""

import json
import os
import sys
import tracemalloc

import numpy as np
import pytest

import fived.data.prepare
from fived.cli.main import main
from fived.config import tomllib
from fived.data.loader import load_tokenizer, load_tokens
from fived.data.prepare import MissingExtra, prepare_data
from fived.testing import run_forked

DOCS = [
    f"Document {i}: {'the quick brown fox jumps over the lazy dog. ' * (i % 4 + 1)}caf\u00e9 {i}\n" for i in range(40)
]


def _expected(tokenizer="byte", docs=DOCS):
    tok = load_tokenizer(tokenizer)
    return np.concatenate([np.asarray(tok.encode(d) + [tok.eot_id]) for d in docs])


def _write_inputs(tmp_path) -> dict:
    """The same documents in each format: one .txt file per document, and one file of each other kind."""
    txt = []
    for i, doc in enumerate(DOCS):
        path = tmp_path / f"doc{i:02d}.txt"
        path.write_text(doc, encoding="utf-8")
        txt.append(path)
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(DOCS)))
    paths = {"txt": txt, "jsonl": [jsonl]}
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(DOCS))), "body": DOCS}), tmp_path / "docs.parquet", row_group_size=7)
    paths["parquet"] = [tmp_path / "docs.parquet"]
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"body": DOCS}).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"body": DOCS}), "test": datasets.Dataset.from_dict({"body": DOCS[:2]})}
    ).save_to_disk(str(tmp_path / "saved_dict"))
    paths["dataset"] = [tmp_path / "saved"]
    paths["dataset_dict"] = [tmp_path / "saved_dict"]
    return paths


@pytest.mark.parametrize("tokenizer", ["byte", "hf"])
def test_every_format_gives_the_same_tokens(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setattr(fived.data.prepare, "ROWS_PER_BATCH", 5)  # several record batches per file
    name = "byte" if tokenizer == "byte" else _hf_tokenizer(tmp_path)
    expected = _expected(name)
    for kind, inputs in _write_inputs(tmp_path).items():
        out = prepare_data(inputs, tmp_path / f"out-{kind}", name, text_field="body")
        tokens = load_tokens(out, name)
        assert np.array_equal(tokens, expected), kind
        meta = json.loads(out.with_suffix(".json").read_text())
        assert meta["documents"] == len(DOCS) and meta["eot_id"] == load_tokenizer(name).eot_id, kind


def _peak_bytes(path, out) -> int:
    tracemalloc.start()
    try:
        prepare_data([path], out)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_streaming_memory_does_not_grow_with_the_file(tmp_path, monkeypatch):
    """Text through 16 kB blocks: Python's peak allocation is the same for a 2 MB and an 8 MB file
    (a few blocks plus fixed costs), far below either."""
    monkeypatch.setattr(fived.data.prepare, "TEXT_BLOCK_CHARS", 1 << 14)
    line = "streamed line of text, not read whole. " * 3 + "\n"
    peaks = {}
    for mb in (2, 8):
        big = tmp_path / f"big{mb}.txt"
        big.write_text(line * (mb * 1_000_000 // len(line)))
        peaks[mb] = _peak_bytes(big, tmp_path / f"big{mb}")
        tokens = load_tokens(tmp_path / f"big{mb}.bin")
        assert len(tokens) == big.stat().st_size + 1 and tokens[-1] == 0  # every byte once, then the end
        assert bytes(np.asarray(tokens[-201:-1], dtype=np.uint8)) == big.read_bytes()[-200:]
    assert peaks[8] < 1.5 * peaks[2] and peaks[8] < 1_000_000 / 2, peaks


def test_validation_split_at_a_document_end(tmp_path):
    inputs = _write_inputs(tmp_path)["jsonl"]
    umask = os.umask(0o022)  # the usual one: files 0644, as open() would make them
    try:
        out = prepare_data(inputs, tmp_path / "split", text_field="body", val_fraction=0.2)
        hf_out = prepare_data(inputs, tmp_path / "hf", _hf_tokenizer(tmp_path), text_field="body")
    finally:
        os.umask(umask)
    train, val = load_tokens(out), load_tokens(tmp_path / "split.val.bin")
    whole = _expected()
    assert np.array_equal(np.concatenate([train, val]), whole)  # nothing lost, nothing repeated
    assert train[-1] == 0 and val[-1] == 0  # both end at a document end
    assert abs(len(val) / len(whole) - 0.2) < 0.05
    meta, val_meta = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("split", "split.val"))
    assert meta["validation"] == "split.val.bin" and meta["num_tokens"] == len(train)
    assert val_meta["num_tokens"] == len(val) and val_meta["split"] == "validation"
    for path in tmp_path.glob("split*"):
        assert path.stat().st_mode & 0o777 == 0o644, path  # readable by others (not mkstemp's 0600)
    for path in (hf_out, hf_out.with_suffix(".json"), tmp_path / "hf.tokenizer.json"):
        assert path.stat().st_mode & 0o777 == 0o644, path


def test_errors_are_one_line(tmp_path, monkeypatch, capsys):
    inputs = _write_inputs(tmp_path)
    assert main(["prepare-data", str(inputs["jsonl"][0]), "--output", str(tmp_path / "a")]) == 2
    assert "no field 'text'" in capsys.readouterr().err
    assert main(["prepare-data", str(inputs["parquet"][0]), "--output", str(tmp_path / "b"), "--text-field", "x"]) == 2
    assert "no column 'x' (columns: id, body" in capsys.readouterr().err
    assert (
        main(
            [
                "prepare-data",
                str(inputs["dataset_dict"][0]),
                "--output",
                str(tmp_path / "c"),
                "--text-field",
                "body",
                "--split",
                "validation",
            ]
        )
        == 2
    )
    assert "no split 'validation' (splits: train, test" in capsys.readouterr().err
    (tmp_path / "array.json").write_text(json.dumps([{"text": d} for d in DOCS], indent=1))
    assert main(["prepare-data", str(tmp_path / "array.json"), "--output", str(tmp_path / "a")]) == 2
    assert "array.json:1: not JSON lines" in capsys.readouterr().err
    (tmp_path / "not_a_dataset").mkdir()
    assert main(["prepare-data", str(tmp_path / "not_a_dataset"), "--output", str(tmp_path / "d")]) == 2
    assert "not a saved Hugging Face dataset" in capsys.readouterr().err
    for module, path in (("pyarrow", inputs["parquet"][0]), ("datasets", inputs["dataset"][0])):
        monkeypatch.setitem(sys.modules, module, None)  # as if the extra were not installed
        with pytest.raises(MissingExtra, match=r"pip install 'fived\[data\]'"):
            prepare_data([path], tmp_path / "e", text_field="body")
        assert main(["prepare-data", str(path), "--output", str(tmp_path / "e"), "--text-field", "body"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and f"needs {module}" in err and "pip install 'fived[data]'" in err, err
    assert not list(tmp_path.glob("[a-e].*"))  # nothing half-written


def _hf_tokenizer(tmp_path) -> str:
    """A word-level tokenizer with more than 256 ids (so the byte defaults would not fit) and </s>."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    words = " ".join(f"w{i}" for i in range(400))
    tok.train_from_iterator(DOCS + [words], trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def test_training_needs_no_tokenizer_or_vocab_flags(tmp_path):
    """prepare-data with a 400+-word tokenizer and a validation split, the directory moved, then
    `fived train` with only --data.path: the sidecar gives the tokenizer and vocabulary size."""
    tok = _hf_tokenizer(tmp_path)
    vocab = load_tokenizer(tok).vocab_size
    assert vocab > 256
    text = tmp_path / "corpus.jsonl"
    words = [f"w{i}" for i in range(400)]
    text.write_text("".join(json.dumps({"text": " ".join(words[j:] + words[:j])}) + "\n" for j in range(0, 400, 7)))
    # (fived.testing.run_forked: `python -m fived` without its second import of torch)
    prep = run_forked(
        main,
        [
            "prepare-data",
            str(text),
            "--output",
            str(tmp_path / "made" / "toks"),
            "--tokenizer",
            tok,
            "--val-fraction",
            "0.1",
        ],
    )
    assert prep.returncode == 0, prep.stderr
    os.rename(tmp_path / "made", tmp_path / "moved")  # the tokenizer copy moves with the tokens
    os.remove(tok)
    run = run_forked(
        main,
        [
            "train",
            "--nproc",
            "1",
            "--steps",
            "4",
            "--seq-len",
            "16",
            "--global-batch",
            "4",
            "--train.eval_every",
            "2",
            "--data.path",
            str(tmp_path / "moved" / "toks.bin"),
            "--train.output_dir",
            str(tmp_path / "run"),
        ],
    )
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4]
    resolved = tomllib.loads((tmp_path / "run" / "config.toml").read_text())
    assert resolved["model"]["vocab_size"] == vocab
    assert resolved["data"]["tokenizer"] == str(tmp_path / "moved" / "toks.tokenizer.json")
