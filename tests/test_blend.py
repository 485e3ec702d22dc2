"""Weighted blends of token sources (`--data.blend`): each source's share of the samples, bad blends
refused in one line before launch, and on real gloo ranks the identical sample sequence and
per-source losses at dp1, dp4, tp2 x pp2 and after a resume onto another layout (float64)."""

import numpy as np
import pytest

from fived.cli.main import main
from fived.config import ConfigError
from fived.data.blend import PERIOD, BlendSchedule, parse_blend
from fived.data.loader import bundled_corpus_path, check_data, load_tokens
from fived.data.prepare import prepare_data
from fived.testing import run_on_ranks, tiny_config
from fived.training.trainer import Trainer, run_training

STEPS, SEQ = 4, 32
# (math.bin holds 3 windows and draws ~6 samples in 4 steps: it wraps into new epochs of its own)
SOURCES = {"web": (0, 20_000), "code": (40_000, 9_000), "math": (60_000, 100)}


@pytest.fixture(scope="module")
def blend(tmp_path_factory):
    """Three prepared token files cut from the bundled corpus, and the blend string naming them."""
    root = tmp_path_factory.mktemp("blend")
    text = bundled_corpus_path().read_text()
    for name, (at, size) in SOURCES.items():
        (root / f"{name}.txt").write_text(text[at : at + size])
        prepare_data([root / f"{name}.txt"], root / name)
    return f"0.5 {root}/web.bin 0.3 {root}/code.bin 0.2 {root}/math.bin"


@pytest.mark.parametrize("weights", [(0.6, 0.3, 0.1), (0.9, 0.07, 0.03)])
@pytest.mark.parametrize("first", [0, 10**9 + 12_345])
def test_each_source_share_is_within_one_percent_over_1000_steps(weights, first):
    """1,000 steps of 8 samples (every sample is seq_len tokens, so the share of samples is the
    share of tokens), from the start and from far into a run (across a period's end)."""
    schedule = BlendSchedule(weights)
    source, ordinal = schedule.locate(np.arange(first, first + 1000 * 8))
    share = np.bincount(source, minlength=len(weights)) / len(source)
    assert np.all(np.abs(share - weights) <= 0.01 * np.asarray(weights)), share
    # each source walks its own samples in order: consecutive ordinals, across the period too
    for s in range(len(weights)):
        mine = ordinal[source == s]
        assert np.array_equal(mine, np.arange(mine[0], mine[0] + len(mine)))
    source, ordinal = schedule.locate(np.arange(3 * PERIOD))
    for s in range(len(weights)):
        assert np.array_equal(ordinal[source == s], np.arange(np.sum(source == s)))


@pytest.mark.parametrize(
    "text, phrase",
    [
        ("0.5 a.bin 0.5", "3 items: expected weight-path pairs"),
        ("heavy a.bin", "'heavy' (before 'a.bin') is not a weight"),
        ("-1 a.bin 2 b.bin", "weight -1 of 'a.bin' must be a finite number > 0"),
        ("nan a.bin", "must be a finite number > 0"),
        ("0 a.bin", "must be a finite number > 0"),
        ("1 a.bin 1 ./a.bin", "'./a.bin' is given twice (as 'a.bin' too)"),
    ],
)
def test_a_bad_blend_is_one_line(text, phrase):
    with pytest.raises(ConfigError) as refused:
        parse_blend(text)
    assert phrase in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
    assert str(refused.value).startswith(f"data.blend={text}: ")


def test_parse_blend_normalises_the_weights():
    sources = parse_blend("6 web.bin 3 code.bin 1 math.bin")
    assert [s.path for s in sources] == ["web.bin", "code.bin", "math.bin"]
    assert [s.weight for s in sources] == [0.6, 0.3, 0.1]
    # the same blend in other words draws the same samples (0.6 + 0.3 + 0.1 is 0.9999999999999999 in
    # floats: normalised by it, the weights moved and broke the assignment's ties otherwise)
    for other in ("0.6 web.bin 0.3 code.bin 0.1 math.bin", "60 web.bin 30 code.bin 10 math.bin"):
        assert [s.weight for s in parse_blend(other)] == [0.6, 0.3, 0.1], other
    schedules = [
        BlendSchedule([s.weight for s in parse_blend(f"{a} x {b} y {c} z")]) for a, b, c in ((6, 3, 1), (0.6, 0.3, 0.1))
    ]
    assert np.array_equal(schedules[0].source, schedules[1].source)


@pytest.mark.parametrize(
    "flags, phrases",
    [
        (["--data.blend", "1 {root}/web.bin 1 {root}/none.bin"], ["data.blend=", "none.bin", "file not found"]),
        (["--data.blend", "1 {root}/web.bin", "--data.path", "{root}/web.bin"], ["given together with data.path"]),
        (["--data.blend", "1 {root}/web.bin 1 {root}/web.bin"], ["is given twice"]),
        (["--data.blend", "1 {root}/web.bin 1 {short}"], ["short.txt", "not one sequence of seq_len=256"]),
        (
            ["--data.valid_blend", "1 {root}/web.bin", "--data.val_path", "{root}/web.bin", "--train.eval_every", "2"],
            ["data.valid_blend=", "given together with data.val_path"],
        ),
    ],
)
def test_bad_blends_are_refused_before_launch(blend, flags, phrases, tmp_path, capsys):
    root, short = blend.split()[1].rsplit("/", 1)[0], tmp_path / "short.txt"
    short.write_text("x" * 150)  # (shorter than one sequence)
    flags = [f.format(root=root, short=short) for f in flags]
    argv = ["train", "--nproc", "1", "--train.seq_len", "256", *flags, "--train.output_dir", str(tmp_path / "r")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    for phrase in phrases:
        assert phrase in err, err
    assert not (tmp_path / "r").exists()  # (refused before anything started)


def _train_recording(cfg, resume=None):
    """Train on this rank, recording the rows each step's batch held (by dp rank), and the metrics."""
    trainer = Trainer(cfg, log=resume is not None, resume=resume)
    seen, take = {}, trainer.sampler.local_batch_at

    def recording(step, dp_rank, dp_size):
        batch = take(step, dp_rank, dp_size)
        seen[step] = (dp_rank, batch.clone())
        return batch

    trainer.sampler.local_batch_at = recording
    return seen, trainer.fit(progress=False)


def _global_batches(results, dp):
    """step -> the global batch's rows, assembled from the dp ranks (every rank of a dp rank agreeing)."""
    by_step = {}
    for seen, _ in results:
        for step, (dp_rank, rows) in seen.items():
            parts = by_step.setdefault(step, [None] * dp)
            assert parts[dp_rank] is None or parts[dp_rank].equal(rows)
            parts[dp_rank] = rows
    return {step: np.concatenate([p.numpy() for p in parts]) for step, parts in by_step.items()}


def _same_figures(reference, metrics):
    assert [m["step"] for m in metrics] == [m["step"] for m in reference]
    assert [m["step"] for m in metrics if "val_loss" in m] == [m["step"] for m in reference if m["step"] % 2 == 0]
    for ref, got in zip(reference, metrics):
        assert abs(got.get("val_loss", 0) - ref.get("val_loss", 0)) <= 1e-9 * ref.get("val_loss", 1)
        assert got["tokens_by_source"] == ref["tokens_by_source"]
        for name, expected in ref["loss_by_source"].items():
            value = got["loss_by_source"][name]
            assert (value is None and expected is None) or abs(value - expected) <= 1e-9 * abs(expected), name


LAYOUTS = {
    "dp4": (4, dict(parallel__dp=4)),
    "tp2-pp2": (4, dict(parallel__tp=2, parallel__pp=2, train__microbatches=2)),
}


def _config(blend, **over):
    """A blend run with an evaluation at steps 2 and 4 on a validation blend (the same files)."""
    return tiny_config(
        train__steps=STEPS, train__seq_len=SEQ, data__blend=blend, data__valid_blend=blend, train__eval_every=2, **over
    )


@pytest.fixture(scope="module")
def one_process(blend):
    return run_on_ranks(1, _train_recording, _config(blend))[0]


def test_the_one_process_run_trains_on_each_source_own_windows(blend, one_process):
    """Every row is a window of the source the schedule names, each source's in its own order; the
    per-source losses add up to the step's loss."""
    seen, metrics = one_process
    sources = [load_tokens(p) for p in blend.split()[1::2]]
    schedule = BlendSchedule([0.5, 0.3, 0.2])
    for step, (_, rows) in seen.items():
        source, ordinal = schedule.locate(np.arange(step * 8, step * 8 + 8))
        for row, s, n in zip(rows.numpy(), source, ordinal):
            windows = (len(sources[s]) - 1) // SEQ
            perm = np.random.default_rng([0, int(s), int(n // windows)]).permutation(windows)
            start = perm[n % windows] * SEQ
            assert np.array_equal(row, sources[s][start : start + SEQ + 1])
    assert sum(metrics[-1]["tokens_by_source"].values()) == 8 * SEQ
    for m in metrics:
        tokens, losses = m["tokens_by_source"], m["loss_by_source"]
        mixed = sum(tokens[k] * losses[k] for k in tokens if tokens[k]) / sum(tokens.values())
        assert abs(mixed - m["loss"]) <= 1e-12 * m["loss"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_trains_on_the_same_samples_with_the_same_source_losses(blend, one_process, layout):
    world, over = LAYOUTS[layout]
    cfg = _config(blend, **over)
    results = run_on_ranks(world, _train_recording, cfg)
    reference = _global_batches([one_process], 1)
    got = _global_batches(results, over.get("parallel__dp", 1))
    assert sorted(got) == sorted(reference) == list(range(STEPS))
    for step in reference:
        assert np.array_equal(got[step], reference[step]), step
    _same_figures(one_process[1], results[0][1])


def test_a_resume_onto_another_layout_trains_on_the_same_samples(blend, one_process, tmp_path, capsys):
    """Steps 1-2 at dp2, checkpointed; steps 3-4 resumed at tp2 x pp2: the rows and the per-source
    figures of steps 3-4 are the one-process run's."""
    first = _config(blend, parallel__dp=2)
    first.train.output_dir = str(tmp_path)
    run_on_ranks(2, run_training, first, True, False, False, None, STEPS // 2)
    second = _config(blend, **LAYOUTS["tp2-pp2"][1])
    second.train.output_dir = str(tmp_path)
    results = run_on_ranks(4, _train_recording, second, str(tmp_path / "checkpoints" / f"step-{STEPS // 2}"))
    reference = _global_batches([one_process], 1)
    got = _global_batches(results, 1)
    assert sorted(got) == list(range(STEPS // 2, STEPS))
    for step in got:
        assert np.array_equal(got[step], reference[step]), step
    _same_figures(one_process[1][STEPS // 2 :], results[0][1])
    # `fived train --resume` keeps the checkpoint's blend: another one is refused in one line
    other = blend.replace("0.5 ", "0.6 ", 1)
    assert main(["train", "--resume", str(tmp_path), "--steps", "6", "--data.blend", other]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"fived: error: data.blend={other}: a resumed run keeps the checkpoint's") and "\n" not in err
    # the same blend in other words (weights 5:3:2 for 0.5:0.3:0.2) is the checkpoint's: it resumes
    same = blend.replace("0.5 ", "5 ", 1).replace("0.3 ", "3 ", 1).replace("0.2 ", "2 ", 1)
    assert main(["train", "--resume", str(tmp_path), "--steps", "5", "--data.blend", same]) == 0


def test_a_resume_with_other_weights_is_refused(blend, tmp_path):
    """The checkpoint's sampler holds the blend's weights: other weights would change the sample
    order, so resuming with them is a one-line refusal."""
    cfg = tiny_config(train__steps=STEPS, train__seq_len=SEQ, data__blend=blend)
    tokens = check_data(cfg)
    from fived.data.sampler import GlobalBatchSampler

    saved = GlobalBatchSampler(tokens, SEQ, 8, 0).state_dict()
    other = tiny_config(train__steps=STEPS, train__seq_len=SEQ, data__blend=blend.replace("0.5 ", "0.6 ", 1))
    from fived.launch.run_setup import check_same_data

    check_same_data(cfg, tokens, saved)  # (the same blend: accepted)
    with pytest.raises(ConfigError, match="the checkpoint's run trained on a blend of weights"):
        check_same_data(other, check_data(other), saved)
    with pytest.raises(ValueError, match="weights"):
        GlobalBatchSampler(check_data(other), SEQ, 8, 0).load_state_dict(saved)


def test_a_checkpoint_of_float_normalised_weights_resumes_in_its_own_order(blend):
    """A checkpoint written before the weights were normalised exactly holds 0.6 0.3 0.1 as
    0.6000000000000001, ...: the same blend, accepted on resume, continuing the checkpoint's own
    sample order (its floats, not today's), not refused as changed data."""
    import dataclasses

    from fived.data.blend import BlendSource
    from fived.data.sampler import GlobalBatchSampler
    from fived.launch.run_setup import check_same_data

    cfg = tiny_config(
        train__steps=STEPS, train__seq_len=SEQ, data__blend=blend.replace("0.5 ", "0.6 ").replace("0.2 ", "0.1 ")
    )
    tokens = check_data(cfg)
    assert [s.weight for s in tokens.sources] == [0.6, 0.3, 0.1]
    old_floats = [0.6 / 0.9999999999999999, 0.3 / 0.9999999999999999, 0.1 / 0.9999999999999999]
    old_tokens = dataclasses.replace(
        tokens, sources=tuple(BlendSource(s.path, w) for s, w in zip(tokens.sources, old_floats))
    )
    before = GlobalBatchSampler(old_tokens, SEQ, 8, 0)
    for _ in range(3):
        before.next_global_batch()
    saved = before.state_dict()
    assert saved["weights"] == old_floats != [0.6, 0.3, 0.1]
    check_same_data(cfg, tokens, saved)  # (accepted: the same blend)
    after = GlobalBatchSampler(tokens, SEQ, 8, 0)
    after.load_state_dict(saved)
    for _ in range(200):  # (the old floats' order, which today's would leave within these steps)
        assert np.array_equal(after.next_global_batch(), before.next_global_batch())


def test_verify_a_blend_across_a_reshard(blend, capsys):
    """`fived verify` with a blend: steps 1-2 at dp2, resumed at tp2 x pp2, against one process,
    the per-source losses included, within 1e-9."""
    argv = ["verify", "--nproc", "4", "--tp", "2", "--pp", "2", "--microbatches", "2", "--steps", str(STEPS)]
    argv += ["--seq-len", str(SEQ), "--global-batch", "8", "--train.warmup_steps", "1", "--data.blend", blend]
    assert main([*argv, "--reshard-from", "--dp 2"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("max relative difference in loss_by_source: "))
    assert float(line.split(": ")[1]) <= 1e-9 and "OK: tolerance 1e-09" in out, out
