import os

# One thread per rank; must be set before torch is imported (forked ranks inherit it).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

torch.set_num_threads(1)

# Imported here once rather than in every forked rank that first needs them (~0.3-0.9 s each, most of
# the multi-rank tests have 4-16 ranks): the trainer, pipelining, and numpy.ma (np.unique in the data
# loader imports it).
import numpy.ma  # noqa: E402, F401
import pytest  # noqa: E402
import torch.distributed.pipelining  # noqa: E402

from fived.tools import verification  # noqa: E402
from fived.training import trainer  # noqa: E402

# One single-process reference per configuration for the whole session: the verifications share them.
verification.REFERENCE_CACHE = {}

# The host's matmul rate (the MFU's denominator) read once here, so that no forked rank of the session
# spends its own reading (about 1 s per rank in bfloat16, 0.1 s in float64).
for _dtype in (torch.float64, torch.float32, torch.bfloat16):
    trainer.host_peak_tflops(_dtype, 0.0, "cpu")


@pytest.fixture(autouse=True)
def _references_only_from_unpatched_code(request):
    """A test that patches anything (it or one of its fixtures uses monkeypatch) neither reads nor
    fills the reference cache: its verifications train their own reference with the patched code."""
    if "monkeypatch" not in request.fixturenames:
        yield
        return
    cache, verification.REFERENCE_CACHE = verification.REFERENCE_CACHE, None
    try:
        yield
    finally:
        verification.REFERENCE_CACHE = cache
