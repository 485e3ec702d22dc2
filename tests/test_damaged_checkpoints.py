"""Damaged checkpoints: verified before they are trusted; a damaged newest one sends resume, restarts,
export and generate to the newest intact one (one line), and an explicitly named damaged one is
refused in one line naming the damaged file and the intact alternative."""

import errno
import json
import shutil

import pytest

import fived.hf.export
from fived.checkpoint.checkpointer import find_checkpoint, read_manifest
from fived.checkpoint.verify import damage
from fived.cli.main import main
from fived.config import ConfigError
from fived.testing import run_on_ranks, tiny_config
from fived.training.trainer import run_training


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 4-step run with checkpoints step-2 and step-4."""
    run = tmp_path_factory.mktemp("saved") / "run"
    cfg = tiny_config("tiny", train__steps=4, checkpoint__every=2, train__output_dir=str(run))
    run_on_ranks(1, run_training, cfg, True, False, False)
    return run


@pytest.fixture
def run(saved, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(saved, copy)
    return copy


def _shard(checkpoint):
    return sorted(checkpoint.glob("*.distcp"))[0]


def _truncate(c):
    path = _shard(c)
    path.write_bytes(path.read_bytes()[:100])
    return path.name


def _delete(c):
    _shard(c).unlink()
    return ".distcp is missing"


def _flip_a_byte(c):
    path = _shard(c)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return "has changed since it was saved"


def _step_not_a_number(c):
    manifest = read_manifest(c)
    (c / "fived.json").write_text(json.dumps({**manifest, "step": "four"}))
    return "gives step 'four'"


def _no_index(c):
    (c / ".metadata").unlink()
    return ".metadata: not a readable checkpoint index"


DAMAGES = {
    "truncated-shard": _truncate,
    "deleted-shard": _delete,
    "flipped-byte": _flip_a_byte,
    "step-not-a-number": _step_not_a_number,
    "deleted-index": _no_index,
}


@pytest.mark.parametrize("how", list(DAMAGES))
def test_a_damaged_newest_checkpoint_falls_back_to_the_intact_one(how, run, capsys):
    newest = run / "checkpoints" / "step-4"
    assert damage(newest) is None
    named = DAMAGES[how](newest)
    assert named in damage(newest)
    assert find_checkpoint(run) == run / "checkpoints" / "step-2"
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "checkpoint step-4 is damaged" in err and named in err, err
    with pytest.raises(ConfigError, match="^--resume=.*step-4: damaged: .*; use the intact .*step-2$"):
        find_checkpoint(newest, "--resume")


def test_resume_and_export_use_the_newest_intact_checkpoint(run, tmp_path, capsys):
    _truncate(run / "checkpoints" / "step-4")
    assert main(["export", str(run), "--output", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").is_file()
    assert main(["export", str(run / "checkpoints" / "step-4"), "--output", str(tmp_path / "hf2")]) == 2
    assert not (tmp_path / "hf2").exists()
    (tmp_path / "hf3").mkdir()  # an existing empty directory is replaced in one step
    assert main(["export", str(run), "--output", str(tmp_path / "hf3")]) == 0
    assert (tmp_path / "hf3" / "config.json").is_file()
    assert main(["train", "--resume", str(run), "--steps", "3"]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "checkpoint step-4 is damaged" in err, err
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_a_run_whose_every_checkpoint_is_damaged_is_refused_not_started_over(run, capsys):
    for c in (run / "checkpoints").glob("step-*"):
        _truncate(c)
    assert find_checkpoint(run) is None
    warnings = capsys.readouterr().err.strip().splitlines()
    endings = [w.split(";")[-1].strip() for w in warnings]
    assert endings == ["using an older one", "no older checkpoint is left"], warnings
    logged = (run / "metrics.jsonl").read_text()
    for resume in ("auto", str(run)):
        assert main(["train", "--resume", resume, "--train.output_dir", str(run), "--steps", "6"]) == 2
        err = capsys.readouterr().err
        refusal = [line for line in err.splitlines() if "error" in line]
        assert len(refusal) == 1 and "Traceback" not in err, err
        assert f"{run} holds 2 checkpoint(s) but no intact one: the newest, step-4, is damaged (" in refusal[0]
        assert _shard(run / "checkpoints" / "step-4").name in refusal[0]
        assert f"move or remove {run / 'checkpoints'}, or use another --train.output_dir" in refusal[0]
    assert (run / "metrics.jsonl").read_text() == logged  # (no new run beside the damaged checkpoints)


def test_a_failing_export_leaves_no_partial_output(run, tmp_path, monkeypatch, capsys):
    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "hf" / "tokenizer.json"))

    monkeypatch.setattr(fived.hf.export, "_write_tokenizer", full)
    assert main(["export", str(run), "--output", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "No space left on device" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no output, no temporary directory


def test_a_save_without_room_is_skipped_and_the_next_one_tries_again(tmp_path, monkeypatch, capsys):
    """Free space is checked before a save: the save of step 2 is skipped with one warning line,
    training goes on, and the save of step 4 (room again) is written."""
    import fived.checkpoint.checkpointer

    real, calls = shutil.disk_usage, []

    def usage(path):
        calls.append(path)
        found = real(path)
        return found._replace(free=1000) if len(calls) == 1 else found

    monkeypatch.setattr(fived.checkpoint.checkpointer.shutil, "disk_usage", usage)
    cfg = tiny_config("tiny", train__steps=4, checkpoint__every=2, train__output_dir=str(tmp_path))
    result = run_on_ranks(1, run_training, cfg, True, False, False)[0]
    assert result.metrics[-1]["step"] == 4
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-4"]


def test_a_full_disk_during_a_save_is_one_line_and_loses_nothing(run, monkeypatch):
    import fived.checkpoint.checkpointer
    from fived.launch.ranks import RankFailed

    real = fived.checkpoint.checkpointer._fsync_write

    def full(path, text):
        if path.name == "fived.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, text)

    monkeypatch.setattr(fived.checkpoint.checkpointer, "_fsync_write", full)
    cfg = tiny_config("tiny", train__steps=6, checkpoint__every=2, train__output_dir=str(run))
    with pytest.raises(RankFailed) as failed:
        run_on_ranks(1, run_training, cfg, True, False, False, str(run / "checkpoints" / "step-4"))
    (summary,) = failed.value.summaries
    assert summary["kind"] == "write_failed"
    assert (
        "checkpoint save of step 6 failed:" in summary["line"]
        and ".tmp-step-6/fived.json: no space left" in summary["line"]
    )
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2", "step-4"]  # no partial directory


def _resume_choice(run, flaky_rank):
    import torch.distributed as dist

    import fived.checkpoint.checkpointer
    from fived.cli.main import build_parser
    from fived.launch.run_setup import prepare_training
    from fived.launch.training_run import agreed_run

    real = fived.checkpoint.checkpointer.cached_damage
    if dist.get_rank() == flaky_rank:  # a transient read error on this rank alone
        fived.checkpoint.checkpointer.cached_damage = lambda c, crc=True: "EIO" if c.name == "step-4" else real(c, crc)
    ns = build_parser().parse_args(["train", "--resume", "auto", "--steps", "6", "--train.output_dir", str(run)])
    mine = prepare_training(ns, 1)
    agreed = agreed_run(mine)
    return mine.resume, agreed.resume, agreed.resumed_step


def test_under_torchrun_every_rank_resumes_the_checkpoint_rank_0_verified(run):
    """Under torchrun (as in forked ranks: RANK and WORLD_SIZE set) each rank chooses before the
    process group exists; rank 0's choice is the one every rank resumes."""
    newest = str(run / "checkpoints" / "step-4")
    (mine0, agreed0, step0), (mine1, agreed1, step1) = run_on_ranks(2, _resume_choice, run, 1)
    assert (mine0, mine1) == (newest, str(run / "checkpoints" / "step-2"))  # rank 1 alone saw an error
    assert agreed0 == agreed1 == newest and step0 == step1 == 4
    _flip_a_byte(run / "checkpoints" / "step-4")  # damage only a CRC finds: rank 1 does not read it whole
    (mine0, agreed0, _), (mine1, agreed1, _) = run_on_ranks(2, _resume_choice, run, None)
    assert mine1 == newest and agreed0 == agreed1 == mine0 == str(run / "checkpoints" / "step-2")


@pytest.mark.parametrize("background", [False, True])
def test_each_rank_digests_only_the_files_it_wrote(background, tmp_path, monkeypatch):
    """Rank 0 does not read every rank's shards inside a save (that would hold the other ranks in
    their next collectives): each rank digests its own `__<rank>_*` files (rank 0 also the index),
    and the manifest records every file, as a load verifies them."""
    import os

    import fived.checkpoint.verify

    real, log = fived.checkpoint.verify.crc32_of, tmp_path / "digested"

    def logged(path):
        with open(log, "a") as f:
            f.write(f"{os.environ.get('RANK', '-')} {path.parent.name} {path.name}\n")
        return real(path)

    monkeypatch.setattr(fived.checkpoint.verify, "crc32_of", logged)
    cfg = tiny_config(
        "tiny",
        train__steps=4,
        parallel__dp=2,
        parallel__zero=2,
        checkpoint__every=2,
        checkpoint__async=background,
        train__output_dir=str(tmp_path / "run"),
    )
    run_on_ranks(2, run_training, cfg, True, False, False)
    read = [line.split() for line in log.read_text().splitlines() if line.split()[1].startswith(".tmp-step-")]
    for step in (2, 4):
        checkpoint = tmp_path / "run" / "checkpoints" / f"step-{step}"
        files = sorted(p.name for p in checkpoint.iterdir() if p.name not in ("fived.json", "COMPLETE"))
        assert any(f.startswith("__1_") for f in files)  # (both ranks wrote shards)
        by_rank = {r: sorted(n for rr, d, n in read if rr == r and d == f".tmp-step-{step}") for r in ("0", "1")}
        assert by_rank["1"] == [f for f in files if f.startswith("__1_")]
        assert by_rank["0"] == [f for f in files if not f.startswith("__1_")]
        assert sorted(read_manifest(checkpoint)["files"]) == files and damage(checkpoint) is None
