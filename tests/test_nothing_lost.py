"""Nothing lost, round two (issue 34): fived writes only files it created (fived.files), never through
a link, never reports success for a run it did not save, and reads back every file it wrote even
when a crash tore it. Real processes: `fived` commands in this process (their ranks forked) or in a
subprocess (signals)."""

import dataclasses
import hashlib
import json
import os
import random
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from fived import files
from fived.cli.main import main
from fived.config import ConfigError

TRAIN = ["train", "--nproc", "1", "--train.warmup_steps", "1", "--train.breakdown", "false"]


def _train(run_dir: Path, *extra: str, steps: int = 2) -> int:
    return main([*TRAIN, "--steps", str(steps), "--train.output_dir", str(run_dir), *extra])


def test_the_writer_refuses_links_and_foreign_files_and_ends_a_torn_line(tmp_path):
    run = files.claim_run_dir(tmp_path / "run")
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    (run / "metrics.jsonl").symlink_to(outside)
    with pytest.raises(files.Refused, match="symbolic link"):
        files.append_line(run, "metrics.jsonl", "{}")
    with pytest.raises(files.Refused, match="symbolic link"):
        files.check_run_dir(run)  # (before any rank starts)
    (run / "metrics.jsonl").unlink()
    (run / "profile").symlink_to(tmp_path)  # a link to a directory on the way
    with pytest.raises(files.Refused, match="symbolic link"):
        files.write_file(run, "profile/trace.json", "{}")
    (run / "profile").unlink()
    (run / "config.toml").write_text("mine")  # a user's file in fived's directory
    with pytest.raises(files.Refused, match="fived did not write it"):
        files.write_file(run, "config.toml", "x")
    files.append_line(run, "log.jsonl", '{"step": 1}')
    with open(run / "log.jsonl", "a") as f:
        f.write('{"step": 2, "lo')  # a crash mid-line
    files.append_line(run, "log.jsonl", '{"step": 3}')
    assert (run / "log.jsonl").read_text().splitlines() == ['{"step": 1}', '{"step": 2, "lo', '{"step": 3}']
    assert [r["step"] for r in files.read_json_lines(run / "log.jsonl")] == [1, 3]
    with pytest.raises(ConfigError, match="holds files fived did not write"):
        files.claim_run_dir(tmp_path)  # (not fived's, not empty)
    older = tmp_path / "older"  # a run of fived before the manifest: adopted, its files only
    (older / "checkpoints").mkdir(parents=True)
    for name in ("launches.jsonl", "config.toml", "notes.txt"):
        (older / name).write_text("x\n")
    files.claim_run_dir(older)
    files.write_file(older, "config.toml", "y")
    with pytest.raises(files.Refused, match="fived did not write it"):
        files.write_file(older, "notes.txt", "y")
    new = tmp_path / "new.tmp"
    new.write_text("new")
    with pytest.raises(files.Refused, match="exists"):
        files.publish(new, outside)
    assert outside.read_text() == "keep" and (run / "config.toml").read_text() == "mine"


def test_a_run_whose_final_save_found_no_room_exits_non_zero_naming_the_newest_safe_step(tmp_path, monkeypatch, capsys):
    real, calls = shutil.disk_usage, []

    def usage(path):  # room for the first save (step 1), none for the final one (step 2)
        calls.append(path)
        return real(path) if len(calls) == 1 else real(path)._replace(free=0)

    monkeypatch.setattr("fived.checkpoint.checkpointer.shutil.disk_usage", usage)
    code = _train(tmp_path / "run", "--checkpoint.every", "1")
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert code == 1, err
    assert "the final checkpoint (step 2) could not be written" in line and "checkpoints/step-1" in line, line
    assert "Traceback" not in err


def test_a_second_sigterm_during_the_preemption_save_says_the_save_was_abandoned(tmp_path, capfd):
    run = tmp_path / "run"

    def preempt_twice():  # (the launcher is this process: its handlers get the signals)
        while not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").stat().st_size):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=preempt_twice, daemon=True).start()
    code = _train(run, steps=100000)
    err = capfd.readouterr().err
    assert code == 143 and "the save was abandoned" in err.strip().splitlines()[-1], err
    assert not list((run / "checkpoints").glob("step-*")) if (run / "checkpoints").is_dir() else True


def test_torn_files_are_skipped_with_one_warning_and_the_next_line_starts_afresh(tmp_path, capfd):
    capsys = capfd  # (the rank's warning: the forked process writes to the file descriptor)
    run = tmp_path / "run"
    assert _train(run, "--checkpoint.every", "1", "--train.breakdown", "true") == 0  # (the report diagnoses)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')
    with open(run / "launches.jsonl", "a") as f:
        f.write('{"ti')
    capsys.readouterr()
    assert main(["report", str(run)]) == 0  # (a whole run.json: the page's diagnosis reads metrics.jsonl again)
    assert capsys.readouterr().err.count("metrics.jsonl: line 3 is torn") == 1
    whole = (run / "run.json").read_bytes()
    (run / "run.json").write_bytes(whole[: len(whole) // 2])
    assert main(["report", str(run)]) == 0
    err = capsys.readouterr().err
    assert "metrics.jsonl: line 3 is torn" in err and "launches.jsonl: line 2 is torn" in err, err
    assert "run.json: torn" in err and "Traceback" not in err
    assert main(["diagnose", str(run)]) == 2  # (no step breakdown in a torn run.json: one line)
    err = capsys.readouterr().err
    assert "run.json: torn" in err and err.count("fived: error") == 1 and "Traceback" not in err, err
    assert main(["train", "--resume", str(run), "--steps", "3", "--train.output_dir", str(tmp_path / "b")]) == 2
    assert "a resumed run stays in its own directory" in capsys.readouterr().err  # (it was ignored)
    assert main(["train", "--resume", str(run), "--steps", "3"]) == 0
    assert "torn" in capsys.readouterr().err
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    launches = (run / "launches.jsonl").read_text().splitlines()
    assert launches[1] == '{"ti' and json.loads(launches[2])["event"] == "resume"


def _snapshot(root: Path) -> dict[str, str]:
    """Every path under `root` (links not followed): its bytes' hash, or where it links."""
    out = {}
    for folder, dirs, names in os.walk(root):
        for name in dirs + names:
            path = Path(folder, name)
            rel = str(path.relative_to(root))
            if path.is_symlink():
                out[rel] = "-> " + os.readlink(path)
            elif path.is_file():
                out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _tree(root: Path) -> None:
    """Foreign files and links: a project with its own config, data, an unrelated sidecar, links out."""
    (root / "myproj").mkdir(parents=True)
    (root / "myproj" / "config.toml").write_text("[train]\nsteps = 7  # mine\n")
    (root / "data").mkdir()
    (root / "data" / "d.txt").write_text("hello world. " * 400)
    (root / "data" / "settings.json").write_text('{"mine": true}\n')
    (root / "secret.txt").write_text("outside the run\n")
    (root / "link-out").symlink_to(root / "secret.txt")


def _plant_link(root: Path) -> int:
    """A hostile edit: the run's metrics.jsonl replaced by a link to a file outside the run."""
    metrics = root / "runs" / "a" / "metrics.jsonl"
    if metrics.parent.is_dir():
        metrics.unlink(missing_ok=True)
        metrics.symlink_to(root / "secret.txt")
    return 0


COMMANDS = {
    "train": lambda root: _train(root / "runs" / "a"),
    "train-foreign": lambda root: _train(root / "myproj"),
    "resume": lambda root: main(["train", "--resume", str(root / "runs" / "a"), "--steps", "3"]),
    "prepare": lambda root: main(["prepare-data", str(root / "data" / "d.txt"), "--output", str(root / "data" / "d")]),
    "prepare-over": lambda root: main(
        ["prepare-data", str(root / "data" / "d.txt"), "--output", str(root / "data" / "settings")]
    ),
    "report": lambda root: main(["report", str(root / "runs" / "a")]),
    "diagnose": lambda root: main(["diagnose", str(root / "runs" / "a")]),
    "link-in": _plant_link,
    "trace-over": lambda root: _train(root / "runs" / "b", "--train.trace", str(root / "secret.txt")),
    "report-over": lambda root: main(["report", str(root / "runs" / "a"), "--output", str(root / "link-out")]),
    "export": lambda root: main(["export", str(root / "runs" / "a"), "--output", str(root / "exported")]),
    "export-over": lambda root: main(["export", str(root / "runs" / "a"), "--output", str(root / "data" / "d.txt")]),
}


def test_an_output_at_a_users_path_is_new_or_fiveds_own_and_never_a_link(tmp_path):
    from fived.tools.pages import check_page

    mine, link = tmp_path / "mine.html", tmp_path / "link.html"
    mine.write_text("mine")
    link.symlink_to(tmp_path / "target.html")
    ours = files.starts_with(b"<fived>")
    page = files.write_output(tmp_path / "page.html", "<fived>1", "--output", ours)
    files.write_output(page, "<fived>2", "--output", ours)  # its own: replaced whole
    assert page.read_text() == "<fived>2"
    for path in (mine, link):
        with pytest.raises(files.Refused, match="did not write it|symbolic link"):
            files.write_output(path, "<fived>3", "--output", ours)
        with pytest.raises(files.Refused, match=path.name):
            check_page(path)  # (explore, report: before the work)
    with pytest.raises(files.Refused, match="never writes over an earlier output"):
        files.write_output(page, "{}", "train.trace", ours=None)  # (a trace: each launch's is kept)
    with pytest.raises(ConfigError, match="is a file"), files.new_directory(mine, "--output"):
        pass
    with files.new_directory(tmp_path / "new", "--output") as building:
        (building / "a").write_text("a")
        assert not (tmp_path / "new").exists()
    assert (tmp_path / "new" / "a").read_text() == "a"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.html", "mine.html", "new", "page.html"]
    assert mine.read_text() == "mine" and not (tmp_path / "target.html").exists()


def test_no_sequence_of_commands_changes_a_byte_outside_fiveds_own_files(tmp_path, capsys):
    rng = random.Random(60)  # (seeded: the 3 sequences include every kind of foreign write)
    for case in range(3):
        root = tmp_path / f"case{case}"
        _tree(root)
        before = _snapshot(root)
        sequence = ["train", *rng.sample(sorted(COMMANDS), 4), "resume"]  # (a resume last: after any link-in)
        for name in sequence:
            code = COMMANDS[name](root)
            err = capsys.readouterr().err
            assert isinstance(code, int) and "Traceback" not in err, (sequence, name, err)
        after = _snapshot(root)  # (every path of `before` is foreign: fived had not run yet)
        changed = [p for p, digest in before.items() if after.get(p) != digest]
        assert not changed, (sequence, changed)


def test_settings_that_meant_nothing_are_refused(tmp_path):
    """A sidecar edited to another dtype (it trained on garbage ids); input that is not UTF-8 (the codec's
    message without the file); a MoE model without an MoE layer."""
    from fived.config import build_config
    from fived.data.loader import load_tokens
    from fived.data.prepare import prepare_data
    from fived.layout.bounds import number_errors

    (tmp_path / "t.txt").write_text("hello world. " * 50)
    prepare_data([tmp_path / "t.txt"], tmp_path / "tok")
    meta = json.loads((tmp_path / "tok.json").read_text())
    assert len(load_tokens(tmp_path / "tok.bin")) == meta["num_tokens"]
    (tmp_path / "tok.json").write_text(json.dumps({**meta, "dtype": "uint8"}))
    with pytest.raises(ValueError, match="dtype uint8 is not the one prepare-data writes"):
        load_tokens(tmp_path / "tok.bin")
    for damaged in ("{'format': 1}", "[1, 2]"):  # not JSON; JSON but not a sidecar: the file named, a way out
        (tmp_path / "tok.json").write_text(damaged)
        with pytest.raises(ValueError, match=r"tok\.json: not (valid JSON|a .* sidecar).*; restore the sidecar, or"):
            load_tokens(tmp_path / "tok.bin")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    with pytest.raises(ValueError, match="latin1.txt: not UTF-8 text .*convert it to UTF-8"):
        prepare_data([tmp_path / "latin1.txt"], tmp_path / "latin1")
    assert not list(tmp_path.glob("latin1.*[bn]"))  # (nothing written: no latin1.bin, no latin1.json)
    cfg = build_config(overrides={"model.name": "tiny-moe", "model.n_dense_layers": 10})
    assert [e.field for e in number_errors(cfg)] == ["model.n_dense_layers"]
    cfg.model = dataclasses.replace(cfg.model, n_dense_layers=cfg.model.n_layers - 1)
    assert number_errors(cfg) == []


def test_the_planner_refuses_a_model_or_a_cluster_that_cannot_exist(tmp_path, capsys):
    """`fived plan` gets the model checks a training run gets (a TOML [model] with dim = -5 was priced,
    MFU -1076%), and a cluster of whole nodes (8 GPUs at 3 per node was priced): one line, exit 2."""
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\nname = "tiny"\ndim = -5\n')
    cluster = ["--seq", "64", "--global-batch-tokens", "1024"]
    assert main(["plan", "--model", str(bad), "--gpus", "8", *cluster]) == 2
    assert capsys.readouterr().err.strip().startswith("fived: error: model.dim=-5:")
    assert main(["plan", "--model", "tiny", "--gpus", "8", "--gpus-per-node", "3", *cluster]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fived: error: --gpus-per-node=3: must divide --gpus 8") and "\n" not in err
    assert main(["plan", "--model", "tiny", "--gpus", "8", "--gpus-per-node", "4", "--top", "1", *cluster]) == 0


def test_verify_writes_nothing_into_a_run_directory_it_does_not_use(tmp_path, monkeypatch, capsys):
    """`fived verify` runs in temporary directories only: a train.output_dir holding files fived did not
    write (here: the default runs/default of the working directory) is neither refused nor touched."""
    monkeypatch.chdir(tmp_path)
    foreign = tmp_path / "runs" / "default" / "checkpoints"
    foreign.mkdir(parents=True)
    (foreign.parent / "notes.txt").write_text("mine")
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert main(["verify", "--dp", "2", "--nproc", "2", "--model", "tiny", "--steps", "2"]) == 0
    assert capsys.readouterr().out.strip().endswith(tuple("0123456789"))  # the last line's figure
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
    assert (foreign.parent / "notes.txt").read_text() == "mine"


def test_a_hand_edited_config_toml_is_refused_on_resume_and_left_as_edited(tmp_path, capsys):
    """A resumed run takes its settings from the checkpoint and the flags: an edit to the run's
    config.toml would be ignored and overwritten, so the resume is refused in one line naming the
    change and its flag; with the file removed, the resume runs and writes it again."""
    run = tmp_path / "run"
    assert _train(run, "--checkpoint.every", "2") == 0
    toml = run / "config.toml"
    edited = toml.read_text().replace("\nlr = 0.003", "\nlr = 0.5", 1)
    assert edited != toml.read_text()
    toml.write_text(edited)
    capsys.readouterr()
    assert main([*TRAIN, "--resume", str(run), "--steps", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "was edited since fived wrote it (train.lr 0.003 -> 0.5)" in err, err
    assert "--train.lr 0.5" in err and toml.read_text() == edited  # (not overwritten)
    toml.unlink()
    assert main([*TRAIN, "--resume", str(run), "--steps", "3"]) == 0
    assert "\nlr = 0.003" in toml.read_text()


def test_generate_names_a_tokenizer_left_behind_and_warns_past_the_trained_context(tmp_path, monkeypatch, capsys):
    """A run records its tokenizer's path as given: from another directory `fived generate` says so in
    one line (it was a traceback); a prompt longer than the trained context gets one warning line."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the a of and to in"], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    (tmp_path / "first").mkdir()
    tok.save(str(tmp_path / "first" / "tokenizer.json"))
    monkeypatch.chdir(tmp_path / "first")
    assert _train(Path("run"), "--data.tokenizer", "tokenizer.json", "--model.vocab_size", "16") == 0
    capsys.readouterr()
    assert main(["generate", "run", "--prompt", "the " * 70, "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "reach 72 tokens, past the 64 the model was trained on" in err, err
    monkeypatch.chdir(tmp_path)
    assert main(["generate", "first/run", "--prompt", "the", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "was trained with the tokenizer 'tokenizer.json', not found from here" in err, err


def test_a_multi_rank_generate_of_damaged_weights_is_one_line_before_any_rank(tmp_path, capsys):
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64}
    config.update(intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    (hf / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": torch.zeros(256, 64)}, str(hf / "model.safetensors"))
    os.truncate(hf / "model.safetensors", 5000)  # (a download cut short)
    generate = ["generate", str(hf), "--prompt", "a", "--prompt", "b", "--nproc", "2", "--max-new-tokens", "1"]
    assert main(generate) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"fived: error: source={hf}/model.safetensors: not a readable safetensors file (Error while deserializing "
        "header: incomplete metadata, file not fully covered); download or export the model again"
    ]
    (hf / "model.safetensors.index.json").write_text('{"weight_map": {"a"')  # (torn)
    assert main(generate) == 2
    assert "not a safetensors index" in capsys.readouterr().err


def test_hostile_values_and_paths_are_one_line_before_any_rank(tmp_path, capsys):
    """Round three's cases that were tracebacks or said the wrong thing (docs/robustness.md 105..)."""
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"\xff\xdb\x00garbage")
    train = [*TRAIN, "--train.output_dir", str(tmp_path / "run")]
    cases = [
        ([*train, "--model.n_heads", "0"], "model.n_heads=0: must be >= 1"),  # (a ZeroDivisionError)
        ([*train, "--seq-len", "0"], "train.seq_len=0: must be >= 2"),  # (it named model.mtp_depth)
        ([*train, "--config", str(binary)], "not UTF-8 text (byte 0xff at offset 0)"),  # (a UnicodeDecodeError)
        ([*train, "--train.output_dir", str(tmp_path / ("b" * 300))], "cannot be written (File name too long)"),
        (["export", str(tmp_path), "--output", str(tmp_path / "e"), "--max-shard-gb", "nan"], "must be > 0 and finite"),
        (["prepare-data", str(binary), "--output", ""], "names no file"),  # (it wrote .bin, .json in the cwd)
        (["config", "--train.lr", "nan"], "train.lr=nan: must be > 0 and finite"),  # (printed as a config)
    ]
    for argv, line in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and line in err[0], (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin.toml"]  # (nothing written)
    run = files.claim_run_dir(tmp_path / "run")
    (run / "metrics.jsonl").mkdir()  # (a rank's IsADirectoryError traceback on --resume)
    with pytest.raises(files.Refused, match="metrics.jsonl: is a directory where fived keeps one of its files"):
        files.check_run_dir(run)


def _unpicklable_result():
    return lambda: None  # (a rank's result the launcher cannot be sent)


def test_a_rank_whose_report_cannot_be_written_whole_leaves_none():
    """A rank's report is written whole or not at all (`ranks._rank_main`: a temporary name, then
    replaced): its writing failing part-way, or a second SIGTERM killing it there, left a torn file
    whose reading was a traceback ("EOFError: Ran out of input"); now the rank is reported as failed."""
    from fived.launch.ranks import RankFailed, run_ranks

    with pytest.raises(RankFailed, match="rank 0 exited with code 2, without a report"):
        run_ranks(1, _unpicklable_result)
