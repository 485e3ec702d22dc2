"""Data and configs checked before launch: token ids beyond the vocabulary, a model state that
cannot fit this machine, numbers far out of range, negative values after a space: one line each."""

import json

import numpy as np
import pytest

from fived.cli.main import join_negative_values, main
from fived.data.loader import largest_token_id


def _token_file(tmp_path, tokens, vocab=256):
    bin_path = tmp_path / "tokens.bin"
    np.asarray(tokens, dtype=np.uint16).tofile(bin_path)
    meta = {
        "format": "fived-tokens-v1",
        "dtype": "uint16",
        "num_tokens": len(tokens),
        "vocab_size": vocab,
        "tokenizer": "byte",
    }
    (tmp_path / "tokens.json").write_text(json.dumps(meta))
    return bin_path


def _refused(capsys, argv, *phrases):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    for phrase in phrases:
        assert phrase in err, err


def test_token_ids_beyond_the_vocabulary_are_refused_before_start_and_cached(tmp_path, capsys):
    tokens = np.arange(4000) % 200
    tokens[3000] = 300
    path = _token_file(tmp_path, tokens)
    _refused(
        capsys,
        ["train", "--nproc", "1", "--data.path", str(path), "--train.output_dir", str(tmp_path / "r")],
        "data.path=",
        "holds token id 300",
        "model.vocab_size=256",
        "--model.vocab_size 301",
    )
    cached = json.loads((tmp_path / "tokens.json").read_text())["max_token_id"]
    assert cached["value"] == 300
    tokens.astype(np.uint16).tofile(path)  # the same bytes, but a new file time: read again
    assert largest_token_id(str(path), np.memmap(path, dtype=np.uint16, mode="r")) == 300


def test_a_sidecar_that_cannot_be_updated_leaves_no_temporary_file(tmp_path, monkeypatch):
    import errno
    import os

    import fived.files

    def refused(src, dst):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(src))

    path = _token_file(tmp_path, np.arange(100) % 50)
    monkeypatch.setattr(fived.files.os, "replace", refused)  # (the sidecar is fived's: replaced by fived.files)
    assert largest_token_id(str(path), np.memmap(path, dtype=np.uint16, mode="r")) == 49
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokens.bin", "tokens.json"]


@pytest.mark.parametrize(
    "flags, phrases",
    [
        (["--model.n_layers", "100000"], ["model.n_layers=100000: must be <= 4096"]),
        (["--model.dim", "1000000"], ["model.dim=1000000: must be <= 131072"]),
        (["--train.steps", "1e23"], ["train.steps=1e23"]),
        (["--train.lr", "-1e-3"], ["train.lr=-0.001: must be > 0"]),
        (["--model", "llama3-8b"], ["GiB of model state per rank", "bytes"]),
    ],
)
def test_impossible_runs_are_refused_in_one_line(flags, phrases, tmp_path, capsys):
    _refused(capsys, ["train", "--nproc", "1", *flags, "--train.output_dir", str(tmp_path / "r")], *phrases)


def test_negative_values_after_a_space_are_values():
    assert join_negative_values(["train", "--train.lr", "-1e-3", "--seed", "-2", "--sp", "--steps", "3"]) == [
        "train",
        "--train.lr=-1e-3",
        "--seed=-2",
        "--sp",
        "--steps",
        "3",
    ]
