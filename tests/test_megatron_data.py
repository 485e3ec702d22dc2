"""Megatron-LM's indexed datasets (.bin + .idx), checked against the real megatron-core: fived reads
what megatron-core's IndexedDatasetBuilder writes, token for token and document for document, and
megatron-core's IndexedDataset reads what `fived prepare-data --format megatron` writes; fived trains
on a pair; a damaged or mismatched pair is one line before any rank starts."""

import functools
import importlib.util
import json
import struct
import sys
import types

import numpy as np
import pytest
import torch

from fived.cli.main import main
from fived.data.indexed import HEADER, read_index
from fived.data.loader import load_tokenizer, load_tokens, token_file_paths
from fived.data.prepare import prepare_data
from fived.data.prepare_megatron import prepare_megatron
from fived.files import read_json_lines
from fived.testing import run_forked

DOCS = [f"Document {i}: {'the quick brown fox. ' * (i % 5 + 1)}caf\u00e9 {i}\n" for i in range(60)]


@functools.cache
def _megatron_indexed():
    """megatron-core's own indexed_dataset module (its IndexedDataset and IndexedDatasetBuilder),
    imported without the package's __init__, which imports megatron-core's whole training stack (11 s
    on this machine) and nothing the reader and builder use; the full import where that fails (a
    later megatron-core laid out otherwise)."""
    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("megatron-core is not installed (pip install 'fived[megatron]')")
    try:
        return _import_alone(next(iter(spec.submodule_search_locations)))
    except ImportError:
        return importlib.import_module("megatron.core.datasets.indexed_dataset")


def _import_alone(root: str):
    """The parent packages as bare namespaces, and megatron.core.utils as the one function the module
    takes from it (log_single_rank, from megatron.core._rank_utils, where utils gets it); sys.modules
    is left as it was found."""
    saved = {name: module for name, module in sys.modules.items() if name.startswith("megatron")}
    try:
        for name, sub in (("megatron", ""), ("megatron.core", "/core"), ("megatron.core.datasets", "/core/datasets")):
            package = types.ModuleType(name)
            package.__path__ = [root + sub]
            sys.modules[name] = package
        utils = types.ModuleType("megatron.core.utils")
        utils.log_single_rank = importlib.import_module("megatron.core._rank_utils").log_single_rank
        sys.modules["megatron.core.utils"] = utils
        return importlib.import_module("megatron.core.datasets.indexed_dataset")
    finally:
        for name in [n for n in sys.modules if n.startswith("megatron")]:
            del sys.modules[name]
        sys.modules.update(saved)


def _documents(count=40, seed=0):
    """Documents of random token ids, each ended by the end token 0 (as Megatron's --append-eod)."""
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(1, 250, size=int(rng.integers(1, 90))), 0) for _ in range(count)]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (megatron-core's numpy.array(tensor, ...))
def test_fived_reads_what_megatron_core_writes(tmp_path):
    mcore = _megatron_indexed()
    docs = _documents()
    builder = mcore.IndexedDatasetBuilder(str(tmp_path / "corpus.bin"), dtype=np.uint16)
    for i, doc in enumerate(docs):
        if i % 3 == 0:  # a document of two sequences (a sentence-split corpus)
            cut = len(doc) // 2
            builder.add_document(torch.from_numpy(doc), [cut, len(doc) - cut])
        else:
            builder.add_item(torch.from_numpy(doc))
            builder.end_document()
    builder.finalize(str(tmp_path / "corpus.idx"))
    theirs = mcore.IndexedDataset(str(tmp_path / "corpus"))
    ours = read_index(tmp_path / "corpus.bin")
    stream = np.concatenate([theirs[i] for i in range(len(theirs))])
    np.testing.assert_array_equal(load_tokens(tmp_path / "corpus.bin"), stream)
    np.testing.assert_array_equal(load_tokens(tmp_path / "corpus"), stream)  # the prefix, as Megatron names it
    np.testing.assert_array_equal(ours.document_indices, theirs.document_indices)
    np.testing.assert_array_equal(ours.sequence_lengths, theirs.sequence_lengths)
    np.testing.assert_array_equal(ours.document_ends(), np.cumsum([len(d) for d in docs]))
    assert ours.dtype == np.uint16 and stream.size == sum(len(d) for d in docs)


@pytest.mark.parametrize("val_fraction", [0.0, 0.2])
def test_megatron_core_reads_what_fived_writes(tmp_path, val_fraction):
    mcore = _megatron_indexed()
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    ours = prepare_megatron([jsonl], tmp_path / "mega", val_fraction=val_fraction)
    plain = prepare_data([jsonl], tmp_path / "plain", val_fraction=val_fraction)  # fived's own token file
    tok = load_tokenizer("byte")
    expected = [np.asarray(tok.encode(d) + [tok.eot_id]) for d in DOCS]
    theirs = mcore.IndexedDataset(str(tmp_path / "mega"))
    parts = [(theirs, load_tokens(ours), load_tokens(plain))]
    if val_fraction:
        val = mcore.IndexedDataset(str(tmp_path / "mega.val"))
        parts.append((val, load_tokens(tmp_path / "mega.val.bin"), load_tokens(tmp_path / "plain.val.bin")))
        assert 0 < len(val) < len(DOCS) and len(theirs) + len(val) == len(DOCS)
    got = [theirs[i] for i in range(len(theirs))] + ([val[i] for i in range(len(val))] if val_fraction else [])
    assert len(got) == len(DOCS)
    for doc, want in zip(got, expected):
        np.testing.assert_array_equal(doc, want)  # one document per sequence, its end token included
    for dataset, fived_reads, fived_file in parts:
        np.testing.assert_array_equal(np.concatenate([dataset[i] for i in range(len(dataset))]), fived_reads)
        np.testing.assert_array_equal(fived_reads, fived_file)  # the same stream as fived's own format
        assert dataset.index.dtype == np.uint16


def _pair(tmp_path, docs, name="corpus", dtype=np.uint16):
    from fived.data.indexed import write_index

    np.concatenate(docs).astype(dtype).tofile(tmp_path / f"{name}.bin")
    write_index(tmp_path / f"{name}.idx", dtype=dtype, document_lengths=np.array([len(d) for d in docs]))
    return tmp_path / f"{name}.bin"


def _losses(tmp_path, data, name):
    run = run_forked(
        main,
        [
            "train", "--nproc", "1", "--data.path", str(data), "--data.document_mask", "true", "--steps", "2",
            "--seq-len", "32", "--global-batch", "4", "--train.warmup_steps", "1",
            "--train.output_dir", str(tmp_path / name),
        ],
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    return [record["loss"] for record in read_json_lines(tmp_path / name / "metrics.jsonl") if "loss" in record]


def test_training_on_a_megatron_pair_equals_training_on_fived_tokens(tmp_path):
    """The same documents as Megatron's pair and as fived's token file: the same batches, documents
    (masked by the end token) and so the same losses, step for step."""
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    mega = prepare_megatron([jsonl], tmp_path / "mega")
    plain = prepare_data([jsonl], tmp_path / "plain")
    losses = _losses(tmp_path, mega, "on_mega")
    assert len(losses) == 2 and losses == _losses(tmp_path, plain, "on_plain")


def _refused(capsys, argv, *phrases):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    for phrase in phrases:
        assert phrase in err, err


def _train(tmp_path, path, *flags):
    return ["train", "--nproc", "1", "--data.path", str(path), "--train.output_dir", str(tmp_path / "r"), *flags]


def test_a_bad_pair_is_one_line_before_start(tmp_path, capsys):
    docs = _documents(count=200)
    path = good_path = _pair(tmp_path, docs)
    idx = tmp_path / "corpus.idx"
    good = idx.read_bytes()
    idx.unlink()
    _refused(capsys, _train(tmp_path, path), "data.path=", "needs corpus.json", "or corpus.idx")
    idx.write_bytes(b"NOTANIDX" + good[8:])
    _refused(capsys, _train(tmp_path, path), "not a Megatron index")
    idx.write_bytes(good[:-8])
    _refused(capsys, _train(tmp_path, path), "truncated or damaged")
    idx.write_bytes(good[:17] + struct.pack("<B", 7) + good[18:])  # float32 tokens
    _refused(capsys, _train(tmp_path, path), "float32, not integers")
    idx.write_bytes(good[:17] + struct.pack("<B", 4) + good[18:])  # int32: its pointers are for uint16
    _refused(capsys, _train(tmp_path, path), "int32 tokens before it end", "dtype code or the pointers are wrong")
    idx.write_bytes(good)
    with open(path, "ab") as f:
        f.write(b"\0\0")  # one token more than indexed
    _refused(capsys, _train(tmp_path, path), "do not belong together")
    path = _pair(tmp_path, docs)
    wide = _pair(tmp_path, [*docs[:-1], np.array([300, 0])], name="wide")  # an id past the byte vocabulary
    _refused(capsys, _train(tmp_path, wide), "holds token id 300", "model.vocab_size=256", "--model.vocab_size 301")
    ended = [d[:-1] if i == 5 else d for i, d in enumerate(docs)]  # one document without its end token
    path = _pair(tmp_path, ended, name="open")
    _refused(capsys, _train(tmp_path, path, "--data.document_mask", "true"), "1 of the 200 documents", "--append-eod")
    val = ["--data.val_path", str(path), "--train.eval_every", "1", "--data.document_mask", "true"]
    _refused(capsys, _train(tmp_path, good_path, *val), "1 of the 200 documents")  # validation pairs too
    negative = _pair(tmp_path, [np.array([3, -1, 0])] * 400, name="neg", dtype=np.int32)
    _refused(capsys, _train(tmp_path, negative), "holds token id -1, below 0")
    assert HEADER.size == 34 and token_file_paths(path)[0] == path


def test_prepare_data_megatron_never_writes_over_a_file(tmp_path, capsys):
    text = tmp_path / "a.txt"
    text.write_text("hello world\n")
    (tmp_path / "out.idx").write_text("mine")
    argv = ["prepare-data", str(text), "--output", str(tmp_path / "out.bin"), "--format", "megatron"]
    assert main(argv) == 2
    assert "out.idx exists" in capsys.readouterr().err
    assert (tmp_path / "out.idx").read_text() == "mine" and not (tmp_path / "out.bin").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "out.idx"]
    (tmp_path / "out.idx").unlink()
    assert main(argv) == 0
    assert "wrote" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "out.bin", "out.idx"]
    np.testing.assert_array_equal(load_tokens(tmp_path / "out.bin"), [*b"hello world\n", 0])
    broken = tmp_path / "b.jsonl"
    broken.write_text('{"text": "one"}\nnot json\n')
    with pytest.raises(ValueError, match="not JSON lines"):
        prepare_megatron([broken], tmp_path / "half", val_fraction=0.5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.jsonl", "out.bin", "out.idx"]  # no temporary
