"""Published runs: a reader that never crashes, what it reads (MoE, first dense layers, ZeRO/FSDP
wording, FP8, GPU variants, open and inconsistent layout fields), validation in and out of sample, and
what a prediction says of its basis."""

import csv
import json
from dataclasses import replace
from pathlib import Path

import pytest

from fived.config import ConfigError, model_preset
from fived.layout.layout import Layout
from fived.planner.basis import basis
from fived.planner.calibration import spearman, validate
from fived.planner.constants import CALIBRATION, Constants, file_sha256, load_calibration, save_calibration
from fived.planner.fitting import GRIDS, ThroughputMemo, batch, calibrate, coverage, predict
from fived.planner.hardware import CPU, hardware
from fived.planner.published import read_runs
from fived.planner.runtimes import FIVED, PLANNED_RUNTIMES, zero_stage
from fived.planner.search import plan
from fived.planner.timing import Cluster, step_time

CALIBRATION_FILE = Path(__file__).parent / "data" / "published_runs.csv"
BASE = dict(
    source_short="test",
    model="gpt",
    num_layers="24",
    hidden="2048",
    heads="16",
    vocab="51200",
    seq_len="2048",
    gpu_type="A100-SXM4-80GB",
    num_gpus="16",
    gpus_per_node="8",
    tp="2",
    pp="1",
    dp="8",
    micro_batch="2",
    global_batch_seqs="256",
    framework="Megatron-LM (2022)",
    tokens_per_s_per_gpu="5000",
)


def _write(path: Path, rows: list[dict]) -> Path:
    columns = sorted({k for r in rows for k in r})
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for r in rows:
            writer.writerow(r)
    return path


def test_zero_wording():
    for text, stage in [
        ("FSDP", 3),
        ("FULL_SHARD", 3),
        ("HYBRID_SHARD", 3),
        ("SHARD_GRAD_OP", 2),
        ("ZeRO-3-like", 3),
        ("zero stage 2", 2),
        ("distributed optimizer", 1),
        ("ZeRO-1", 1),
        ("DDP", 0),
        ("none (DDP torch/local)", 0),
        ("", None),
        ("n/a", None),
    ]:
        assert zero_stage(text) == stage, text


def test_what_the_flagperf_moe_runs_ran():
    """Read from their rows: a rank's experts in one grouped GEMM only with --moe-grouped-gemm (the
    Qwen-MoE script passes none: Megatron-Core's SequentialMLP), row 97's network the 2x200 Gb/s per
    node of FlagPerf's DGX A100 40G environment, and causal attention in a fused kernel for every
    runtime but Megatron-LM 2021/2022's."""
    rows = {r.row_id: r for r in read_runs(CALIBRATION_FILE)[0]}
    assert [rows[i].runtime.grouped_experts for i in ("66", "67", "97")] == [True, False, True]
    assert rows["97"].cluster.hardware.network_gbps == 2 * 200 / 8 / 8
    unfused = {r.source for r in rows.values() if not r.runtime.causal_skip}
    assert unfused == {"Narayanan2021-SC21", "Korthikanti2022"}


def test_a_fused_causal_kernel_halves_the_attention_on_gpus():
    """The causal mask's half of QK^T and AV is skipped by a fused kernel (GPUs); CPU ranks' fitted
    efficiency prices attention whole."""
    m, layout = model_preset("llama3-8b"), Layout(dp=8)
    for gpu, halved in (("h100", True), ("cpu", False)):
        hw = hardware(gpu) if gpu != "cpu" else CPU
        t = {
            skip: step_time(m, layout, Cluster(hw, 8, 8), 8192, 8, runtime=replace(FIVED, causal_skip=skip))
            for skip in (True, False)
        }
        assert (t[True].compute < t[False].compute) == halved


def test_reader_never_crashes(tmp_path):
    """Every row is predicted or skipped with one reason; open fields are filled and shown, an
    inconsistent dp derived and noted, MoE columns and first dense layers read, FP8 understood."""
    rows = [
        dict(BASE, row_id="1", tp="", dp=""),  # missing layout fields: the planner's choice
        dict(BASE, row_id="2", dp="5", micro_batch="n/a", global_batch_seqs="n/a", global_batch_tokens="524288"),
        dict(
            BASE,
            row_id="3",
            model="moe",
            kv_heads="4",
            moe_experts="8",
            moe_top_k="2",
            moe_ffn_hidden="1024",
            moe_shared_experts="1",
            moe_first_dense_layers="2",
            zero_or_fsdp="FULL_SHARD",
            tp="1",
            dp="16",
            framework="PyTorch FSDP",
            precision="FP8 (torchao float8)",
            gpu_type="H100 SXM 80GB",
        ),
        dict(
            BASE,
            row_id="4",
            zero_or_fsdp="SHARD_GRAD_OP",
            framework="DeepSpeed",
            tp="1",
            dp="16",
            pp="",
            gpu_type="A100-SXM4-40GB",
        ),
        dict(BASE, row_id="5", hidden="abc"),
        dict(BASE, row_id="6", tokens_per_s_per_gpu="", tflops_per_gpu="n/a"),
        dict(BASE, row_id="7", gpu_type="tpu-v5"),
        dict(BASE, row_id="8", num_gpus="15"),
        dict(
            BASE,
            row_id="9",
            model="folded",
            kv_heads="4",
            moe_experts="16",
            moe_top_k="2",
            moe_ffn_hidden="1024",
            ep="16",
            etp="",
            framework="Megatron-Core",
            gpu_type="NVIDIA H100 80GB HBM3",
            first_k_dense_replace="1",
        ),
    ]
    path = _write(tmp_path / "runs.csv", rows)
    read, skipped = read_runs(path)
    assert [r.row_id for r in read] == ["1", "2", "3", "4", "9"]
    assert skipped == [
        "row 5 skipped: hidden='abc' is not a number",
        "row 6 skipped: no throughput (tokens/s, step time, TFLOP/s or MFU)",
        "row 7 skipped: gpu_type='tpu-v5': unknown GPU",
        "row 8 skipped: num_gpus=15 is not a multiple of tp*pp*cp=2",
    ]
    one, two, moe, deepspeed, folded = read
    assert folded.fixed["etp"] == 1 and folded.model.n_dense_layers == 1 and "experts folded over tp" in folded.notes[0]
    assert predict(folded).layout.folded and folded.cluster.hardware.name == "h100"  # (fived runs folding)
    assert "tp" in one.open and "tp: planner" in one.notes
    assert two.fixed["dp"] == 8 and "dp 5 -> 8 (gpus/(tp*pp*cp))" in two.notes and two.global_batch == 256
    m = moe.model
    assert (m.n_experts, m.top_k, m.moe_ffn_dim, m.n_shared_experts, m.n_dense_layers) == (8, 2, 1024, 1, 2)
    assert moe.fixed["zero"] == 3 and moe.runtime.fp8 and moe.cluster.hardware.fp8_tflops > 0
    assert m.ffn_dim == 8192 and m.n_kv_heads == 4  # GQA: a gated MLP, ffn_hidden taken as it is
    assert one.model.ffn_dim == round(2 * 4 * 2048 / 3 / 64) * 64  # GPT's GeLU MLP as SwiGLU
    assert deepspeed.fixed["zero"] == 2 and deepspeed.cluster.hardware.memory_gib == 40
    lines = []
    result = validate(path, printer=lines.append, out_of_sample=False)
    assert lines[-1] == f"median absolute error: {result['median']:.1f}%"
    assert lines[-2] == "predicted 5 of 9 rows" and (result["predicted"], result["rows"]) == (5, 9)
    folded_line = next(line for line in lines if line.startswith("   9 "))  # (fived runs folding: no refusal)
    assert "ep16 etp1" in folded_line and "not runnable" not in folded_line and "outside" not in folded_line
    assert sum(line.startswith("row ") and "skipped:" in line for line in lines) == 4
    assert all(predict(r).time.tokens_per_s_per_gpu > 0 for r in read)


def test_every_run_that_happened_is_read_and_costed(tmp_path):
    """A local batch per replica split into pipeline micro-batches; a vocabulary unstated (the
    family's, or the head ignored); more virtual stages than layers; a tp unstated (derived from dp,
    else the planner's); an interleaved pipeline fived's torch schedules refuse: every row is read,
    predicted, and says what the reading assumed."""
    llama = dict(
        BASE,
        model="Llama-3.1-8B",
        num_layers="32",
        hidden="4096",
        heads="32",
        kv_heads="8",
        ffn_hidden="14336",
        vocab="128256",
        seq_len="8192",
        num_gpus="64",
        tp="1",
        dp="8",
    )
    rows = [
        dict(
            llama,
            row_id="local",
            pp="8",
            micro_batch="16",
            global_batch_seqs="",
            precision="FP8",
            framework="torchtitan (FSDP2, torch.compile)",
            zero_or_fsdp="FSDP",
        ),
        dict(llama, row_id="local-column", pp="8", micro_batch="", local_batch="32", global_batch_seqs=""),
        dict(
            BASE,
            row_id="moe-no-vocab",
            model="Qwen1.5-MoE-A2.7B",
            vocab="",
            kv_heads="16",
            moe_experts="60",
            moe_top_k="4",
            moe_ffn_hidden="1408",
            ep="4",
            tp="1",
        ),
        dict(BASE, row_id="no-family", model="house-model", vocab=""),
        dict(
            BASE,
            row_id="more-stages",
            num_layers="94",
            hidden="4096",
            heads="64",
            kv_heads="4",
            vocab="151936",
            moe_experts="128",
            moe_top_k="8",
            moe_ffn_hidden="1536",
            num_gpus="256",
            tp="2",
            pp="32",
            vpp="3",
            ep="8",
            dp="4",
            micro_batch="1",
            global_batch_seqs="2048",
            framework="Megatron-Core",
        ),
        dict(BASE, row_id="tp-from-dp", tp="", pp="2", dp="4"),
        dict(BASE, row_id="tp-open", tp="", dp=""),
        dict(
            BASE,
            row_id="rounds",
            num_gpus="32",
            tp="2",
            pp="4",
            vpp="2",
            dp="4",
            micro_batch="1",
            global_batch_seqs="100",
        ),  # 25 micro-batches: torch's interleaved schedule wants whole rounds
    ]
    read, skipped = read_runs(_write(tmp_path / "runs.csv", rows))
    assert not skipped
    got = {r.row_id: r for r in read}
    local = got["local"]
    assert local.global_batch == 16 * 8 and "micro_batch" in local.open and 16 in local.open["micro_batch"]
    assert "local batch 16 per replica (the row's micro_batch)" in local.notes
    assert got["local-column"].global_batch == 32 * 8 and "local batch 32 per replica" in got["local-column"].notes
    assert (
        got["moe-no-vocab"].model.vocab_size == 151936 and "vocab: unstated, qwen's 151936" in got["moe-no-vocab"].notes
    )
    assert (
        got["no-family"].model.vocab_size == 1 and "vocab: unstated, the head's share ignored" in got["no-family"].notes
    )
    assert (
        got["more-stages"].fixed["pp_virtual"] == 2 and "vpp 3 -> 2: 96 stages, 94 layers" in got["more-stages"].notes
    )
    assert got["tp-from-dp"].fixed["tp"] == 2 and "tp 2 = gpus/(dp*pp*cp) (unstated)" in got["tp-from-dp"].notes
    assert "tp" in got["tp-open"].open and "tp: planner" in got["tp-open"].notes
    plans = {r.row_id: predict(r) for r in read}
    assert all(p is not None and p.time.tokens_per_s_per_gpu > 0 for p in plans.values())
    assert plans["local"].layout.micro_batch < 16 and plans["rounds"].layout.pp_virtual == 2
    lines = []
    validate(tmp_path / "runs.csv", printer=lines.append, out_of_sample=False)
    assert lines[-2] == f"predicted {len(rows)} of {len(rows)} rows"
    assert any(line.split()[0] == "rounds" and "priced at a global batch of 96" in line for line in lines)


def test_calibration_file_coverage():
    """The shipped calibration was fitted on the calibration file as it is (same bytes, every row);
    what `fived plan` quotes of its coverage is what the file holds; every row has a source."""
    rows, skipped = read_runs(CALIBRATION_FILE)
    assert not skipped
    assert CALIBRATION.sha256 == file_sha256(CALIBRATION_FILE), (
        "refit: python -m fived.planner.fitting tests/data/published_runs.csv"
    )
    fitting = [r for r in rows if not r.held_out]  # (tests/test_held_out.py: the test split's rows)
    assert CALIBRATION.rows == tuple(r.row_id for r in fitting) and set(CALIBRATION.row_errors) == set(CALIBRATION.rows)
    assert dict(CALIBRATION.coverage) == json.loads(json.dumps(coverage(fitting)))
    with CALIBRATION_FILE.open() as f:
        assert all(r["source_short"] and r["source_ref"] and r["source_locator"] for r in csv.DictReader(f))
    assert len({r.source for r in rows}) >= 6


def test_basis_says_what_is_calibrated_and_what_is_extrapolated():
    h100 = Cluster(hardware("h100"), 16, 8)
    search = plan(model_preset("mixtral-8x7b"), h100, 4096, 128)
    lines = basis(model_preset("mixtral-8x7b"), h100, FIVED, search.plans[0].layout, 4096)
    assert lines[0].startswith("calibrated:") and f"{CALIBRATION.out_of_sample:.0f}%" in lines[0]
    assert any("fived's own runtime was measured on one GPU only" in line for line in lines)
    assert any("mixture of experts" in line and f"error {CALIBRATION.by_kind['moe']:.0f}%" in line for line in lines)
    b200 = basis(model_preset("llama3-8b"), Cluster(hardware("b200"), 8, 8), FIVED, search.plans[0].layout, 32768)
    assert b200[0].startswith("extrapolated: no published run on b200")
    assert any("sequence length 32768" in line for line in b200)


def test_a_refit_is_a_new_calibration_and_the_quoted_figures_follow_it(tmp_path):
    """Calibration is data: a fit on a subset of the rows (three sources) writes a file whose
    constants, rows, errors and coverage are that fit's; loaded and passed explicitly, the planner
    prices with it and quotes its figures; nothing the shipped planner uses changes meanwhile."""
    with CALIBRATION_FILE.open() as f:
        records = list(csv.DictReader(f))
    keep = ("Narayanan2021-SC21", "Korthikanti2022", "PyTorch-float8-FSDP2-2024")
    # (every row to fit: the calibration file holds the float8 blog's rows out)
    subset = _write(tmp_path / "subset.csv", [dict(r, split="fit") for r in records if r["source_short"] in keep])
    m, cluster = model_preset("llama3-8b"), Cluster(hardware("h100"), 64, 8)
    before = plan(m, cluster, 8192, 512).plans[0]
    fitted = calibrate(subset)
    save_calibration(fitted, tmp_path / "subset.json")
    loaded = load_calibration(tmp_path / "subset.json")
    assert loaded.rows == tuple(r["row_id"] for r in records if r["source_short"] in keep)
    assert loaded.coverage["rows"] == len(loaded.rows) and loaded.coverage["moe"] == 0
    assert loaded.constants == fitted.constants and loaded.constants != CALIBRATION.constants
    assert loaded.out_of_sample == pytest.approx(fitted.out_of_sample, abs=1e-4)
    assert loaded.out_of_sample != CALIBRATION.out_of_sample
    assert loaded.constants.expert_efficiency == Constants().expert_efficiency  # no MoE row: the prior
    lines = basis(m, cluster, FIVED, before.layout, 8192, calibration=loaded)
    assert f"fitted on {len(loaded.rows)} published runs" in lines[0]
    assert f"typical out-of-sample error {loaded.out_of_sample:.0f}%" in lines[0]
    printed = []
    result = validate(subset, printer=printed.append, calibration=loaded)
    assert result["loso"] == pytest.approx(loaded.out_of_sample, abs=1e-3)
    assert any(line.startswith("out of sample: as fitted on this file") for line in printed)
    after = plan(m, cluster, 8192, 512).plans[0]
    assert after.time.total == before.time.total and load_calibration() == CALIBRATION


def test_the_fits_memo_returns_what_the_step_time_model_prices():
    """The fit's memo (a figure kept by the constants it read) returns, for every constant moved to
    every other grid value, the step-time model's own figure (a read it missed would return a stale
    one), and does hit: an Ampere row never reads the Hopper efficiency, a dense one the experts'."""
    rows = {r.row_id: r for r in read_runs(CALIBRATION_FILE)[0]}
    ampere = next(r for r in rows.values() if r.cluster.hardware.calibration == "ampere" and not r.model.is_moe)
    chosen = [ampere, next(r for r in rows.values() if r.model.is_moe), next(r for r in rows.values() if r.runtime.fp8)]
    memo = ThroughputMemo()
    for row in chosen:
        layout = predict(row).layout
        for name, grid in GRIDS.items():
            for value in grid[:: max(1, len(grid) // 3)]:
                c = replace(Constants(), **{name: value})
                want = step_time(
                    row.model, layout, row.cluster, row.seq_len, batch(row, layout), runtime=row.runtime, constants=c
                )
                assert memo.tokens_per_s_per_gpu(row, layout, c) == want.tokens_per_s_per_gpu, (row.row_id, name, value)
    assert memo.size < sum(len(g[:: max(1, len(g) // 3)]) for g in GRIDS.values()) * len(chosen)
    layout = predict(ampere).layout
    memo.size = 0
    for value in GRIDS["efficiency_hopper"] + GRIDS["expert_efficiency"]:
        memo.tokens_per_s_per_gpu(
            ampere, layout, replace(Constants(), efficiency_hopper=value, expert_efficiency=value)
        )
    assert memo.size == 0


def test_a_bad_calibration_file_is_refused_in_one_line(tmp_path):
    good = json.loads(json.dumps(CALIBRATION.to_json()))
    for change, words in [
        ({"constants": {**good["constants"], "gemm": 1.0}}, "missing or unknown constant"),
        ({"extra": 1}, "unknown calibration field"),
        ({"format": 99}, "not calibration format"),
    ]:
        path = tmp_path / "bad.json"
        path.write_text(json.dumps({**good, **change}))
        with pytest.raises(ConfigError, match=words) as e:
            load_calibration(path)
        assert "\n" not in str(e.value)


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4], [10, 30, 20, 40]) == pytest.approx(0.8)
    assert spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(0.866, abs=1e-3)  # ties share their rank


def test_folded_experts_are_planned_for_every_runtime():
    """Megatron-Core's MoE parallel folding (experts over tp ranks, etp 1) is considered for every
    runtime, fived's included (it runs them: parallel.etp=1), and the fived command says so."""
    m = replace(model_preset("mixtral-8x7b"), n_layers=8)  # (a quarter of Mixtral: 8 GPUs hold it)
    cluster = Cluster(hardware("h100"), 8, 8)
    for runtime in (PLANNED_RUNTIMES["megatron-core"], PLANNED_RUNTIMES["fived"]):
        plans = plan(m, cluster, 4096, 32, runtime=runtime).plans
        assert any(p.layout.folded and p.layout.ep > p.layout.dp * p.layout.cp for p in plans)
        assert all(p.layout.runnable and (p.layout.sp or not p.layout.folded) for p in plans)
    folded = next(p.layout for p in plans if p.layout.folded)
    assert "--parallel.etp 1" in folded.flags(32) and " etp1 " in folded.describe()


def test_memory_headroom_is_left_free():
    m, cluster = model_preset("llama3-8b"), Cluster(hardware("h100"), 8, 8)
    tight, roomy = plan(m, cluster, 8192, 64), plan(m, cluster, 8192, 64, headroom_gib=10)
    assert max(p.memory.total for p in roomy.plans) <= 70 * 2**30 < max(p.memory.total for p in tight.plans)


def _fived(capsys, *args) -> tuple[int, str, str]:
    """`fived ...` in this process (the command line's own entry point; no interpreter start-up)."""
    from fived.cli.main import main

    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_plan_runtime_headroom_and_json(capsys):
    code, out, err = _fived(
        capsys,
        "plan",
        "--model",
        "llama3-8b",
        "--gpus",
        "16",
        "--gpu",
        "h100",
        "--seq",
        "8192",
        "--global-batch-tokens",
        "1048576",
        "--json",
        "--top",
        "2",
        "--memory-headroom",
        "5",
    )
    assert code == 0, err
    data = json.loads(out)
    assert data["runtime"] == "fived" and data["memory_headroom_gib"] == 5 and data["basis"]
    assert all(p["runnable"] and p["memory_gib"]["total"] <= 75 for p in data["plans"])
    code, _, err = _fived(
        capsys,
        "plan",
        "--model",
        "llama3-8b",
        "--gpus",
        "16",
        "--seq",
        "8192",
        "--global-batch-tokens",
        "8192",
        "--memory-headroom",
        "-1",
    )
    assert code == 2 and "--memory-headroom=-1.0: must be >= 0" in err


def test_validate_a_file_with_bad_rows_from_the_cli(tmp_path, capsys):
    path = _write(tmp_path / "runs.csv", [dict(BASE, row_id="1"), dict(BASE, row_id="2", num_layers="n/a")])
    code, out, err = _fived(capsys, "plan", "--validate", str(path))
    assert code == 0, err
    lines = out.strip().splitlines()
    assert "row 2 skipped: no num_layers" in lines and lines[-2] == "predicted 1 of 2 rows"
    assert lines[-1].startswith("median absolute error: ")


@pytest.mark.parametrize("name", ["h100", "H100-SXM5-80GB", "H100 96GB HBM2e", "A100-SXM4-40GB", "a800", "H800-80GB"])
def test_gpu_variants(name):
    hw = hardware(name)
    assert hw.memory_gib == {"H100 96GB HBM2e": 96, "A100-SXM4-40GB": 40}.get(name, 80)


def test_validate_names_rows_twice_off_and_refuses_a_file_it_cannot_read(tmp_path, capsys):
    """`fived plan --validate` lists the rows predicted 2x (or half) the reported throughput, and a file
    that is not a runs CSV is one line and exit 2, never `nan%` and exit 0."""
    from fived.cli.main import main

    with CALIBRATION_FILE.open() as f:
        first = next(r for r in csv.DictReader(f) if r["tokens_per_s_per_gpu"])
    tripled = {**first, "tokens_per_s_per_gpu": str(3 * float(first["tokens_per_s_per_gpu"]))}
    printed: list[str] = []
    validate(_write(tmp_path / "one.csv", [tripled]), printer=printed.append)
    line = next(x for x in printed if x.startswith("2x off or more in sample"))
    assert line.startswith("2x off or more in sample: 1 of 1 rows (" + first["row_id"] + " -"), line
    validate(_write(tmp_path / "same.csv", [first]), printer=printed.append)
    assert "2x off or more in sample: 0 of 1 rows" in printed
    (tmp_path / "bin.csv").write_bytes(b"\xff\xfe\x00garbage")
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    (tmp_path / "header.csv").write_text(CALIBRATION_FILE.read_text().splitlines()[0] + "\n")
    capsys.readouterr()
    for name, words in (("bin", "not UTF-8 text"), ("other", "has no column model"), ("header", "holds no rows")):
        assert main(["plan", "--validate", str(tmp_path / f"{name}.csv")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err
