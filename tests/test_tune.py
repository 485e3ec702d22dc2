"""`fived tune`: the planner's top layouts measured on real ranks, a failing trial reported and
skipped, the refit, and the fastest measured layout with the command that runs it."""

import re

from fived.cli.main import main


def test_tune_measures_the_top_layouts_skips_a_failing_one_and_names_the_fastest(monkeypatch, capsys):
    from fived.training.trainer import Trainer

    step = Trainer.step

    def fails_in_a_pipeline(self, *args, **kwargs):  # (inherited by the forked ranks)
        if self.cfg.parallel.pp > 1:
            raise RuntimeError("out of memory (injected)")
        return step(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "step", fails_in_a_pipeline)
    code = main(["tune", "--model", "tiny", "--nproc", "2", "--minutes", "0.4", "--top", "3"])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = re.findall(r"^\s+(\d)\s+(\S.*?)\s{2,}([\d.]+)\s+([\d.]+)\s+[+-][\d.]+%\s+([\d.]+)", out, re.M)
    failed = re.findall(
        r"^\s+\d\s+(dp\S+ ZeRO-\d pp2 .*?)\s{2,}[\d.]+\s+failed: .*out of memory \(injected\)", out, re.M
    )
    assert len(rows) >= 1 and len(failed) >= 1, out  # (the planner's top 3 on 2 ranks: dp2 and pp2 shapes)
    measured = {layout: float(ms) for _, layout, _, ms, _ in rows}
    fastest = min(measured, key=measured.get)
    assert f"fastest measured: {fastest}, {measured[fastest]:.1f} ms/step" in out, out
    run = re.search(r"run it: fived train --model tiny --nproc 2 (.*)", out)
    assert run and "--parallel.pp 1" in run.group(1), out
    took = float(re.search(r"tune took (\d+) s", out).group(1))
    assert took <= 0.4 * 60 + 10, out  # (its budget, and one trial's start-up past it at most)
    assert "median |error| on the trials:" in out and "after the refit" in out
    # (a median over a few trials hides one far off: the worst is printed beside it)
    assert re.search(r"after the refit \(the worst trial \d+\.\d%; fitted on these trials", out), out


def test_tune_refuses_layout_flags_and_an_empty_budget(capsys):
    assert main(["tune", "--model", "tiny", "--tp", "2"]) == 2
    assert "fived tune chooses the layout" in capsys.readouterr().err
    assert main(["tune", "--model", "tiny", "--minutes", "0"]) == 2
    assert "--minutes=0" in capsys.readouterr().err


def test_a_profile_of_another_dtype_is_warned_of_in_one_line(capsys, tmp_path, monkeypatch):
    """A CPU profile measured float32 matmuls; a bf16 run's first ranking is priced at those rates (a
    CPU's bf16 matmuls run several times slower): one line says so before anything is measured."""
    import fived.tools.tune as tuning
    from fived.tools.calibrate import calibrate

    profile = str(tmp_path / "machine.json")
    doc = calibrate(profile, nproc=2, minutes=0.02, quick=True)
    assert doc["dtype"] == "float32"
    seen = []
    monkeypatch.setattr(tuning, "tune", lambda cfg, world, **kw: seen.append(cfg) or {"winner": None, "trials": []})
    monkeypatch.setattr("fived.cli.tune.report", lambda *a: "")
    capsys.readouterr()
    for dtype, warned in (("bfloat16", True), ("bfloat16-autocast", True), ("float32", False)):
        code = main(["tune", "--model", "tiny", "--nproc", "2", "--machine", profile, "--train.dtype", dtype])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 1  # (the stand-in tune measured nothing: no winner)
        if warned:
            assert (
                len(err) == 1
                and err[0].startswith("fived: warning: --machine")
                and "e.g. --train.dtype float32" in err[0]
            ), err
        else:
            assert not err, err
    assert [c.train.dtype for c in seen] == ["bfloat16", "bfloat16-autocast", "float32"]
