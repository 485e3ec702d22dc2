import hashlib
import os
import pickle
from pathlib import Path

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
import torch.distributed.tensor.debug  # noqa: E402  (fived.compat.forget_dtensor_meshes: at every rank's close)

from fived.tools import verification  # noqa: E402
from fived.training import trainer  # noqa: E402

# One single-process reference per configuration for the whole session: the verifications share them
# (and the test workers, `_references_shared_by_the_workers`).
verification.REFERENCE_CACHE = {}

# The host's matmul rate (the MFU's denominator) read once here, so that no forked rank of the session
# spends its own reading (about 1 s per rank in bfloat16, 0.1 s in float64).
for _dtype in (torch.float64, torch.float32, torch.bfloat16):
    trainer.host_peak_tflops(_dtype, 0.0, "cpu")


# pytest-xdist hands out whole modules (--dist loadfile) in collection order: the longest first (by
# their seconds on 2 workers in .ci/run, 2026-11-29), so that the workers end together rather than one
# running a long module alone at the end. Modules not named keep their order after these.
LONGEST_FIRST = (
    "test_pages.py",
    "test_zero.py",
    "test_checkpoint.py",
    "test_dryrun.py",
    "test_planner.py",
    "test_faults.py",
    "test_muon.py",
    "test_pipeline.py",
    "test_tensor_overlap.py",
    "test_muon_checkpoint.py",
    "test_fp8.py",
    "test_tensor.py",
    "test_diagnose.py",
    "test_five_d.py",
    "test_gpu_acceptance.py",
    "test_slurm.py",
)
MAX_WORKERS = 8
GIB_PER_WORKER = 6  # (room to spare: tests/test_dryrun.py's 70B stage alone peaks at 8.3 GB in one process)


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core, at most MAX_WORKERS and one per GIB_PER_WORKER of memory."""
    memory_gib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS, int(memory_gib // GIB_PER_WORKER)))


def pytest_collection_modifyitems(config, items):
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # (stable: the rest keep their order)


class SharedReferences(dict):
    """The session's references, in this worker's memory and as files in one directory every worker
    of the session reads (in its pytest temporary root, which pytest prunes to the last three
    sessions'): a reference one worker made is not made again by another. A file is written under a temporary name, then renamed: a reader sees
    a whole file or none (two workers making the same reference write the same thing)."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def _path(self, key: str) -> Path:
        return self.root / (hashlib.sha256(key.encode()).hexdigest() + ".pkl")

    def __contains__(self, key) -> bool:
        if super().__contains__(key):
            return True
        try:
            with open(self._path(key), "rb") as f:
                super().__setitem__(key, pickle.load(f))
        except FileNotFoundError:
            return False
        return True

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        path = self._path(key)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        with open(partial, "wb") as f:
            pickle.dump(value, f)
        os.replace(partial, path)


@pytest.fixture(scope="session", autouse=True)
def _references_shared_by_the_workers(tmp_path_factory, worker_id):
    if worker_id == "master":  # (one process: its memory is the whole session)
        yield
        return
    root = tmp_path_factory.getbasetemp().parent / "references"  # (the workers' common temporary root)
    root.mkdir(exist_ok=True)
    own, verification.REFERENCE_CACHE = verification.REFERENCE_CACHE, SharedReferences(root)
    try:
        yield
    finally:
        verification.REFERENCE_CACHE = own


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
