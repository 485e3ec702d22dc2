"""The test suite's reference cache (verification.REFERENCE_CACHE, on in conftest.py): keyed by the
reference run's whole configuration, never for runs that read files, handing out copies, and off in
tests that patch code. No rank is started here."""

import torch

from fived.testing import tiny_config
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


def test_a_cached_reference_is_handed_out_as_a_copy():
    ref = reference_config(tiny_config("tiny"))
    cached = TrainResult(metrics=[{"step": 1, "loss": 2.0}], state={"w": torch.ones(3, dtype=torch.float64)})
    verification.REFERENCE_CACHE[verification._cache_key(ref)] = cached  # (no rank is started for it)
    try:
        got = reference_run(ref)
        assert got.metrics == cached.metrics and torch.equal(got.state["w"], cached.state["w"])
        got.state["w"].add_(1)
        got.metrics[0]["loss"] = 0.0
        assert cached.state["w"].tolist() == [1.0] * 3 and cached.metrics[0]["loss"] == 2.0
    finally:
        del verification.REFERENCE_CACHE[verification._cache_key(ref)]


def test_on_in_the_suite():
    assert verification.REFERENCE_CACHE is not None


def test_off_where_a_test_patches(monkeypatch):
    assert verification.REFERENCE_CACHE is None
