"""The test suite's reference cache (verification.REFERENCE_CACHE, on in conftest.py): keyed by the
reference run's whole configuration (data files by their contents), handing out copies, and off in
tests that patch code. No rank is started here."""

from pathlib import Path

import torch

from fived.testing import tiny_config, write_documents
from fived.tools import verification
from fived.tools.verification import reference_config, reference_run
from fived.training.trainer import TrainResult


def _key(**over):
    return verification._cache_key(reference_config(tiny_config("tiny-moe", **over)))


def test_the_key_is_the_reference_runs_configuration():
    assert _key(parallel__tp=2, train__microbatches=2) == _key(parallel__dp=4, parallel__zero=3)  # same reference
    assert _key(train__output_dir="elsewhere") == _key()  # (the reference writes nothing)
    assert _key(train__steps=2) != _key()
    assert _key(model__qk_norm=True) != _key()
    assert _key(train__seed=1) != _key()
    assert _key(data__path="tokens.bin") is None and _key(train__init_from="run") is None


def test_data_files_are_keyed_by_what_they_hold(tmp_path):
    """Each test writes its documents at a path of its own: the same bytes share a reference, other
    bytes (or another file beside it, e.g. a token file's sidecar) do not."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, second = (write_documents(tmp_path / d / "docs.txt") for d in ("a", "b"))
    assert _key(data__path=first, data__document_mask=True) == _key(data__path=second, data__document_mask=True)
    assert _key(data__path=first, data__val_path=second) == _key(data__path=second, data__val_path=first)
    assert _key(data__path=first) != _key()
    (tmp_path / "b" / "docs.json").write_text("{}")
    assert _key(data__path=first) != _key(data__path=second)
    Path(second).write_text(Path(first).read_text()[1:])
    (tmp_path / "b" / "docs.json").unlink()
    assert _key(data__path=first) != _key(data__path=second)
    assert _key(data__path=str(tmp_path / "missing.bin")) is None and _key(data__path=str(tmp_path)) is None


def test_a_cached_reference_is_handed_out_as_a_copy():
    ref = reference_config(tiny_config("tiny"))
    cached = TrainResult(metrics=[{"step": 1, "loss": 2.0}], state={"w": torch.ones(3, dtype=torch.float64)})
    # (a cache of its own: the session's is shared with the other test workers, whose tiny runs this is not)
    session_cache, verification.REFERENCE_CACHE = verification.REFERENCE_CACHE, {}
    verification.REFERENCE_CACHE[verification._cache_key(ref)] = cached  # (no rank is started for it)
    try:
        got = reference_run(ref)
        assert got.metrics == cached.metrics and torch.equal(got.state["w"], cached.state["w"])
        got.state["w"].add_(1)
        got.metrics[0]["loss"] = 0.0
        assert cached.state["w"].tolist() == [1.0] * 3 and cached.metrics[0]["loss"] == 2.0
    finally:
        verification.REFERENCE_CACHE = session_cache


def test_on_in_the_suite():
    assert verification.REFERENCE_CACHE is not None


def test_off_where_a_test_patches(monkeypatch):
    assert verification.REFERENCE_CACHE is None


def test_a_reference_one_worker_made_is_read_by_another(tmp_path):
    """The test workers' shared cache (conftest.SharedReferences): what one worker's cache stores,
    another's over the same directory finds, whole; a key never stored is not found."""
    from conftest import SharedReferences

    made, other = SharedReferences(tmp_path), SharedReferences(tmp_path)
    result = TrainResult(metrics=[{"step": 1, "loss": 2.0}], state={"w": torch.arange(3, dtype=torch.float64)})
    made["key"] = result
    assert "key" in other and other["key"].metrics == result.metrics
    assert torch.equal(other["key"].state["w"], result.state["w"])
    assert "another key" not in other
    assert [p.suffix for p in tmp_path.iterdir()] == [".pkl"]  # (no partial file left behind)
