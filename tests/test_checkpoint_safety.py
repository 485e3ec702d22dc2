"""Nothing is ever lost: SIGKILL at any point of a save leaves the previous checkpoint loadable and the
resumed run equal to the uninterrupted one; saving and loading a sharded layout never holds the whole
model on a rank; a checkpoint's metadata cannot smuggle in code."""

import io
import json
import os
import pickle
import resource
import signal

import pytest
import torch
import torch.distributed as dist

import fived.checkpoint.checkpointer
import fived.checkpoint.dcp_io
from fived.checkpoint.checkpointer import MANIFEST, MARKER, Checkpointer, complete_checkpoints, find_checkpoint
from fived.launch.ranks import RankFailed
from fived.testing import run_on_ranks, tiny_config
from fived.training.trainer import Trainer, run_training

STEPS, EVERY, KILLED_SAVE = 6, 2, 4
ARMED = {"now": False}  # set, in the rank that dies, when the save of step KILLED_SAVE starts


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def _arm_on_save(monkeypatch, rank: int):
    real = Checkpointer.save

    def save(self, step, background=False):
        ARMED["now"] = step == KILLED_SAVE and dist.get_rank() == rank
        return real(self, step, background)

    monkeypatch.setattr(Checkpointer, "save", save)


def _kill_writing_shards(monkeypatch):
    real = fived.checkpoint.dcp_io._SavePlanner.lookup_object

    def lookup(self, index):
        if ARMED["now"]:
            _die()
        return real(self, index)

    monkeypatch.setattr(fived.checkpoint.dcp_io._SavePlanner, "lookup_object", lookup)


def _kill_at_file(name: str, after: bool):
    def patch(monkeypatch):
        real = fived.checkpoint.checkpointer._fsync_write

        def write(path, text):
            if ARMED["now"] and path.name == name and not after:
                _die()
            real(path, text)
            if ARMED["now"] and path.name == name and after:
                _die()

        monkeypatch.setattr(fived.checkpoint.checkpointer, "_fsync_write", write)

    return patch


def _kill_pruning(monkeypatch):
    # (keep=1 keeps the newest checkpoint known healthy besides the one just written: the first
    # pruning is at the final save, of step 6, which deletes step-2)
    def discard(path):
        _die()

    monkeypatch.setattr(fived.checkpoint.checkpointer, "_discard", discard)


# name: (how it dies, which rank, background save, the newest complete checkpoint afterwards)
KILLS = {
    "while-shards-are-written": (_kill_writing_shards, 1, False, EVERY),
    "while-a-background-save-writes": (_kill_writing_shards, 1, True, EVERY),
    "before-the-manifest": (_kill_at_file(MANIFEST, after=False), 0, False, EVERY),
    "after-the-marker-before-the-rename": (_kill_at_file(MARKER, after=True), 0, False, EVERY),
    "while-pruning-older-ones": (_kill_pruning, 0, False, STEPS),
}


@pytest.mark.parametrize("point", list(KILLS))
def test_sigkill_during_a_save_loses_nothing(point, tmp_path, monkeypatch):
    how, rank, background, survivor = KILLS[point]
    cfg = tiny_config(
        "tiny",
        train__steps=STEPS,
        parallel__dp=2,
        parallel__zero=1,
        checkpoint__every=EVERY,
        checkpoint__keep=1,
        checkpoint__async=background,
    )
    whole = run_on_ranks(2, run_training, cfg, False, False, True)[0]
    cfg.train.output_dir = str(tmp_path)
    with monkeypatch.context() as patch:
        _arm_on_save(patch, rank)
        how(patch)
        with pytest.raises(RankFailed):
            run_on_ranks(2, run_training, cfg, True, False, False)
    assert [step for step, _ in complete_checkpoints(tmp_path)][-1] == survivor
    resumed = run_on_ranks(2, run_training, cfg, True, False, True, str(find_checkpoint(tmp_path)))[0]
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in logged] == [m["loss"] for m in whole.metrics]
    for name, value in whole.state.items():
        assert torch.equal(value, resumed.state[name]), name
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))  # the crashed save was cleared away


def _big(**over):
    """A model whose whole parameters (27M, 109 MB in float32) dwarf what a step or a save needs
    transiently on one of 4 ranks, so a rank holding a whole copy would show in its peak memory."""
    return tiny_config(
        "tiny",
        model__dim=512,
        model__n_heads=8,
        model__n_kv_heads=8,
        model__ffn_dim=1536,
        model__n_layers=8,
        train__dtype="float32",
        train__seq_len=16,
        train__global_batch=8,
        checkpoint__final=False,
        **over,
    )


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _save(cfg, run_dir):
    cfg.train.output_dir = run_dir
    trainer = Trainer(cfg)
    trainer.step(0)  # gradients and Adam's moments exist
    trainer.sampler.step = 1
    before = _peak_mb()
    trainer.checkpointer.save(1)
    return before, _peak_mb()


def _load(cfg, run_dir):
    cfg.train.output_dir = run_dir
    trainer = Trainer(cfg)
    trainer.step(0)  # (Adam's moments exist before the load, as they will after it)
    before = _peak_mb()
    trainer.checkpointer.load(find_checkpoint(run_dir))
    return before, _peak_mb()


def test_no_rank_holds_the_whole_model_while_saving_or_loading(tmp_path):
    """Peak resident memory of each of 4 ranks grows by less than a quarter of the model's
    parameters while it saves (ZeRO-3), and while it loads that checkpoint into ZeRO-3 or tp2 x pp2."""
    from fived.model.transformer import build_model

    whole_mb = sum(p.numel() for p in build_model(_big().model).parameters()) * 4 / 2**20
    zero3 = _big(parallel__dp=4, parallel__zero=3)
    for before, after in run_on_ranks(4, _save, zero3, str(tmp_path), timeout_s=120):
        assert after - before < whole_mb / 4, ("save", before, after, whole_mb)
    for cfg in (zero3, _big(parallel__tp=2, parallel__pp=2, train__microbatches=2)):
        for before, after in run_on_ranks(4, _load, cfg, str(tmp_path), timeout_s=120):
            assert after - before < whole_mb / 4, ("load", before, after, whole_mb)


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_checkpoint_metadata_cannot_run_code(tmp_path):
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Evil(tmp_path / "owned")))
    with pytest.raises(fived.checkpoint.dcp_io.CheckpointError, match="posix.system|os.system"):
        fived.checkpoint.dcp_io.tensor_shapes(tmp_path)
    assert not (tmp_path / "owned").exists()


def test_a_checkpoint_entry_of_pickled_bytes_is_refused(tmp_path):
    """DCP would torch.load(weights_only=False) an entry recorded as bytes: fived refuses the
    checkpoint before reading anything."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    cfg = tiny_config("tiny", train__steps=1, train__output_dir=str(tmp_path))
    run_on_ranks(1, run_training, cfg, True, False, False)
    checkpoint = find_checkpoint(tmp_path)
    with open(checkpoint / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    payload = io.BytesIO()
    torch.save(_Evil(tmp_path / "owned"), payload)
    (checkpoint / "evil.distcp").write_bytes(payload.getvalue())
    name = "optimizer.tok_embeddings.weight.exp_avg"
    metadata.state_dict_metadata[name] = BytesStorageMetadata()
    metadata.storage_data = {k: v for k, v in metadata.storage_data.items() if k.fqn != name}
    metadata.storage_data[MetadataIndex(name)] = _StorageInfo("evil.distcp", 0, len(payload.getvalue()))
    with open(checkpoint / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(RankFailed, match="BytesStorageMetadata, which fived does not load"):
        run_on_ranks(1, run_training, cfg, True, False, False, str(checkpoint))
    assert not (tmp_path / "owned").exists()
