"""`fived diagnose`: small CPU runs on real gloo ranks that exhibit each failure mode, each named with
its evidence, and a balanced run where none is; the measured breakdown adds up to the step time.

Each run trains a few steps of a tiny model (`Trainer` on forked ranks, as `fived train` runs it),
writes run.json as `fived train` does, and asks `fived diagnose` (its --json output, and its last
line) what it sees."""

from __future__ import annotations

import json

import pytest

from fived.cli.main import main
from fived.config import build_config
from fived.testing import run_forked, run_on_ranks
from fived.tools.diagnose import RECOMPUTE_SHARE, Measured, _recompute, _uneven_micro, diagnose
from fived.training.report import write_run_json
from fived.training.trainer import Trainer


def _train(cfg, favour_expert: bool):
    trainer = Trainer(cfg, log=True)
    if favour_expert:  # a router forced onto expert 0: every token's first choice
        for moe in trainer.moe_layers:
            moe.router_bias[0] = 100.0
    return trainer.result(trainer.fit(progress=False))


def run_dir_of(tmp_path, world: int, favour_expert: bool = False, **fields) -> str:
    """Train the tiny model on `world` ranks with config `fields` ("section__field": value); the run
    directory, with run.json as `fived train` writes it."""
    base = {
        "model.name": "tiny",
        "train.steps": 8,
        "train.seq_len": 64,
        "train.global_batch": 16,
        "train.log_every": 1000,
        "train.device": "cpu",
        "train.warmup_steps": 1,
        "train.output_dir": str(tmp_path / "run"),
    }
    base.update({k.replace("__", "."): v for k, v in fields.items()})
    cfg = build_config(overrides=base)
    results = run_on_ranks(world, _train, cfg, favour_expert)
    write_run_json(cfg, world, results)
    return cfg.train.output_dir


def modes(run_dir: str, capsys) -> list[str]:
    """The failure modes `fived diagnose` names: its last line, checked against its --json."""
    assert main(["diagnose", run_dir]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("failure modes: ")
    named = [] if last == "failure modes: none" else last[len("failure modes: ") :].split(", ")
    assert main(["diagnose", run_dir, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["failure_modes"] == named
    return named


def measured_modes(tmp_path, capsys, world: int, wanted, attempts: int = 3, **fields) -> list[str]:
    """The modes diagnose names for a fresh run, retried (at most `attempts` runs) until `wanted(named)`:
    the rules read measured step times, and a CPU shared with other jobs can hide a mode in one run (a
    rule that never names it still fails every attempt)."""
    named: list[str] = []
    for attempt in range(attempts):
        named = modes(run_dir_of(tmp_path / f"attempt{attempt}", world, **fields), capsys)
        if wanted(named):
            break
    return named


def test_a_balanced_run_names_no_failure_mode(tmp_path, capsys):
    def wanted(named):
        return named == []

    assert wanted(measured_modes(tmp_path, capsys, 2, wanted, parallel__dp=2, parallel__zero=1, train__microbatches=2))


def test_breakdown_components_add_up_to_the_step_time(tmp_path):
    """Per rank and step, the named components (without "other": time outside every span) cover the
    measured step within 5%; and the step the trainer logs is the breakdown's total."""
    run = run_dir_of(tmp_path, 2, parallel__pp=2, parallel__dp=1, train__microbatches=4)
    run_json = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run_json["breakdown"]["predicted"]["compute"] > 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        b = record["breakdown"]
        named = sum(v for k, v in b["components"].items() if k != "other")
        assert abs(sum(b["components"].values()) - b["total_s"]) < 1e-9
        assert named >= 0.95 * b["total_s"], b
        assert b["total_s"] == pytest.approx(record["step_time_s"], rel=0.05)
        assert {"forward", "backward", "bubble", "optimizer", "data"} <= set(b["components"])
        # the clipping norm's all-reduce over pp is a gradient reduction, as the planner prices it (dp > 0
        # there at dp 1): timed as dp's, not pp's
        assert b["components"].get("comm_dp", 0) > 0 and "comm_pp" not in b["components"], b
    assert run_json["breakdown"]["predicted"]["dp"] > 0
    assert diagnose(run)["step_s"] > 0


def test_too_much_tensor_parallelism(tmp_path, capsys):
    def wanted(named):
        return "too-much-tp" in named

    assert wanted(measured_modes(tmp_path, capsys, 4, wanted, parallel__dp=1, parallel__tp=4))


def test_pipeline_imbalance(tmp_path, capsys):
    """Five of six layers on the first stage (the measured stage times: up to three fresh runs, as
    `measured_modes`). Three of four left too thin a margin: the first stage also holds the embedding
    and the last the head and loss, so 3,1 measured ~2x (the rule needs 1.67x at two stages) and
    a loaded CI machine once named nothing in three runs; 5,1 measures ~2.5-3x."""
    for attempt in range(3):
        run = run_dir_of(
            tmp_path / f"attempt{attempt}",
            2,
            parallel__dp=1,
            parallel__pp=2,
            parallel__pp_layers="5,1",
            model__n_layers=6,
            train__microbatches=4,
        )
        found, named = diagnose(run), modes(run, capsys)
        if "pipeline-imbalance" in named and found["pipeline_ranks"]["0"] > 1.25 * found["pipeline_ranks"]["1"]:
            break
    assert "pipeline-imbalance" in named
    assert found["pipeline_ranks"]["0"] > 1.25 * found["pipeline_ranks"]["1"]


def test_too_few_microbatches(tmp_path, capsys):
    def wanted(named):
        return "too-few-microbatches" in named

    assert wanted(measured_modes(tmp_path, capsys, 2, wanted, parallel__dp=1, parallel__pp=2, train__microbatches=2))


def test_too_many_microbatches(tmp_path, capsys):
    """16 micro-batches of one 64-token sequence over two stages: per-micro-batch costs dominate."""

    def wanted(named):
        return "too-many-microbatches" in named and "too-few-microbatches" not in named

    assert wanted(measured_modes(tmp_path, capsys, 2, wanted, parallel__dp=1, parallel__pp=2, train__microbatches=16))


def test_expert_all_to_all_dominating(tmp_path, capsys):
    def wanted(named):
        return "expert-all-to-all" in named

    fields = dict(model__name="tiny-moe", parallel__dp=2, parallel__ep=2, train__seq_len=32)
    assert wanted(measured_modes(tmp_path, capsys, 2, wanted, **fields))


def test_router_forced_onto_one_expert(tmp_path, capsys):
    """At a small learning rate the router stays near its (balanced) initialisation; forced onto one
    expert it is not. (At the default 3e-3 the tiny model's routers collapse within a few steps, and
    diagnose says so too.)"""
    run = run_dir_of(tmp_path, 1, favour_expert=True, model__name="tiny-moe", train__lr=1e-4)
    assert modes(run, capsys) == ["expert-imbalance"]
    balanced = run_dir_of(tmp_path / "b", 1, model__name="tiny-moe", train__lr=1e-4)
    assert "expert-imbalance" not in modes(balanced, capsys)


def test_context_parallel_ring_exposed(tmp_path, capsys):
    def wanted(named):
        return "cp-communication-exposed" in named

    assert wanted(measured_modes(tmp_path, capsys, 2, wanted, parallel__dp=1, parallel__cp=2, train__seq_len=32))


def test_context_parallel_work_imbalance_with_documents(tmp_path, capsys):
    """Each sequence: one long document then short ones. The halves layout gives one cp rank ~3x the
    attention work (named, with the advice to balance by work); the work-balanced one does not."""
    data = tmp_path / "skewed.txt"
    data.write_text(("y" * 127 + "\0" + ("x" * 63 + "\0") * 2) * 40 + "\0", newline="")  # windows of 256: 128, 64, 64
    found = {}
    for balance in ("halves", "work"):
        run = run_dir_of(
            tmp_path / balance,
            2,
            parallel__dp=1,
            parallel__cp=2,
            train__seq_len=256,
            train__global_batch=2,
            data__path=str(data),
            data__document_mask=True,
            parallel__cp_balance=balance,
        )
        found[balance] = modes(run, capsys)
        assert diagnose(run)["cp_work_spread"] > (1.25 if balance == "halves" else 0.99)
    assert "cp-imbalance" in found["halves"] and "cp-imbalance" not in found["work"]


def test_full_checkpointing_under_a_pipeline_is_named(tmp_path, capsys):
    """A model wide enough that its matmuls dominate (as on GPUs): full checkpointing recomputes each
    block's forward in backward, about a quarter of the step, and diagnose names it. (Whether
    selective's element-wise recomputation stays under the threshold is a timing on a loaded CPU, so
    the threshold itself is tested on given figures below.)"""
    wide = dict(
        model__dim=256,
        model__ffn_dim=1024,
        train__seq_len=128,
        train__global_batch=8,
        train__steps=6,
        parallel__dp=1,
        parallel__pp=2,
        train__microbatches=4,
    )

    def wanted(named):
        return "recompute-on-critical-path" in named

    assert wanted(measured_modes(tmp_path, capsys, 2, wanted, train__activation_checkpointing="full", **wide))


def test_recompute_rule_reads_the_share_of_the_step_in_a_pipeline():
    cfg = build_config(overrides={"parallel.dp": 1, "parallel.pp": 2, "train.microbatches": 2})
    flat = build_config()
    small = Measured(1.0, {}, {"recompute": RECOMPUTE_SHARE * 0.9}, {}, [])
    large = Measured(1.0, {}, {"recompute": RECOMPUTE_SHARE * 1.1}, {}, [])
    assert _recompute(small, cfg, {}) is None
    assert _recompute(large, flat, {}) is None  # no pipeline: recomputation is not on a bubble's path
    found = _recompute(large, cfg, {})
    assert found.name == "recompute-on-critical-path" and "on every pipeline stage" in found.evidence


def test_uneven_microbatches_rule():
    """Packed fixed-length windows make every micro-batch alike on CPU: the rule on measured figures."""
    even = Measured(1.0, {}, {}, {}, [[0.10, 0.11, 0.10, 0.12], [0.2, 0.21]])
    uneven = Measured(1.0, {}, {}, {}, [[0.10, 0.11, 0.10, 0.12], [0.10, 0.25, 0.10, 0.11]])
    assert _uneven_micro(even, None, {}) is None
    found = _uneven_micro(uneven, None, {})
    assert found.name == "uneven-microbatches" and "2.50x" in found.evidence


def test_diagnose_refuses_a_directory_without_a_run(tmp_path, capsys):
    assert main(["diagnose", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no run.json" in err[0]


def _profiled_run(tmp_path, *flags: str) -> dict:
    """`fived train --train.profile 2:3` on 4 ranks; the merged trace's events per rank."""
    run_dir = tmp_path / "run"
    # (forked from this process: no `python -m fived` paying its import of torch again)
    train = run_forked(
        main,
        [
            "train",
            "--nproc",
            "4",
            "--steps",
            "3",
            "--global-batch",
            "8",
            "--train.warmup_steps",
            "1",
            "--train.profile",
            "2:3",
            "--train.output_dir",
            str(run_dir),
            *flags,
        ],
    )
    assert train.returncode == 0, train.stderr
    assert "merged -> " in train.stdout
    for rank in range(4):  # each rank's own torch.profiler trace loads as Chrome trace JSON
        assert json.loads((run_dir / "profile" / f"rank{rank}.json").read_text())["traceEvents"]
    merged = json.loads((run_dir / "profile" / "trace.json").read_text())
    names: dict[int, set[str]] = {}
    for event in merged["traceEvents"]:
        if event.get("ph") == "X":
            assert event["ts"] >= 0 and event["dur"] >= 0
            names.setdefault(event["pid"], set()).add(event["name"])
    assert sorted(names) == [0, 1, 2, 3]
    return names


def _labels(names: set[str], prefix: str) -> set[str]:
    return {n for n in names if n.startswith(prefix)}


def test_profile_traces_show_every_dimension_and_every_ranks_forward_backward(tmp_path):
    """A pipeline of MoE layers with expert and data parallelism, and tensor x context parallelism:
    every rank's trace has its forward and backward spans (per stage and micro-batch under the
    pipeline) and the collectives of each of its mesh dimensions, by name."""
    names = _profiled_run(
        tmp_path / "a", "--model", "tiny-moe", "--dp", "2", "--pp", "2", "--ep", "2", "--microbatches", "2"
    )
    for rank, seen in names.items():
        assert _labels(seen, "fived/forward stage") and _labels(seen, "fived/backward stage"), rank
        for dim in ("dp", "ep", "pp"):
            assert _labels(seen, f"fived/comm/{dim}/"), (rank, dim)
        assert "fived/bubble" in seen and "fived/optimizer" in seen
    names = _profiled_run(tmp_path / "b", "--tp", "2", "--cp", "2")
    for rank, seen in names.items():
        assert _labels(seen, "fived/forward mb") and _labels(seen, "fived/backward mb"), rank
        for dim in ("tp", "cp", "dp"):
            assert _labels(seen, f"fived/comm/{dim}/"), (rank, dim)


def _collectives_untouched(cfg):
    """During a step (at the model's forward): torch.distributed's functions are torch's own."""
    import torch.distributed as dist
    import torch.distributed.pipelining.schedules as schedules

    names = (
        "all_reduce",
        "all_gather_single",
        "reduce_scatter_single",
        "all_to_all_single",
        "batch_isend_irecv",
        "send",
        "recv",
        "broadcast",
    )
    originals = [getattr(dist, n) for n in names] + [schedules._batch_p2p]
    trainer = Trainer(cfg, log=False)
    seen = []
    trainer.model.register_forward_pre_hook(
        lambda *_: seen.append([getattr(dist, n) for n in names] + [schedules._batch_p2p] == originals)
    )
    trainer.fit(progress=False)
    return seen, trainer.timer.recorder.summary()


def test_no_process_wide_patching_of_collectives():
    """fived's collectives are recorded by its own layer, while torch.distributed stays as it is."""
    cfg = build_config(
        overrides={
            "model.name": "tiny-moe",
            "parallel.dp": 2,
            "parallel.pp": 2,
            "parallel.ep": 2,
            "parallel.zero": 1,
            "train.microbatches": 2,
            "train.steps": 2,
            "train.global_batch": 8,
            "train.device": "cpu",
            "train.log_every": 1000,
        }
    )
    for seen, comm in run_on_ranks(4, _collectives_untouched, cfg):
        assert seen and all(seen)
        assert {"pp/send", "pp/recv"} <= set(comm) and any(k.endswith("/all_to_all_single") for k in comm)
