"""`fived plan --serve`: the serving memory and time model, the queueing model, the published serving
benchmarks it predicts, and the command line (the multi-rank measurements are tests/test_serve_ranks.py)."""

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from docs_pages import docs_text

from fived.cli.main import main
from fived.config import model_preset
from fived.planner.hardware import hardware
from fived.planner.serve import Replica, Workload, evaluate, plan_serving, poisson_quantile
from fived.planner.serve_explain import TrainingView, vllm_command, vllm_mismatch, why_they_differ
from fived.planner.serve_model import (
    DENSE_LAYER_OPS,
    END_OPS,
    MOE_LAYER_OPS,
    ServeLayout,
    forward_time,
    gpu_memory,
    kv_cache_bytes,
    sequences_that_fit,
    stage_weights,
)
from fived.planner.serve_validation import median_error, read_rows, validation
from fived.planner.timing import Cluster

PUBLISHED = Path(__file__).parent / "data" / "published_serving.csv"
H100x8 = Cluster(hardware("h100"), 8, 8)
SERVE_70B = [
    "plan",
    "--serve",
    "--model",
    "llama3-70b",
    "--gpus",
    "8",
    "--gpu",
    "h100",
    "--prompt-len",
    "2048",
    "--output-len",
    "256",
]


def test_published_serving_benchmarks_are_predicted_with_the_readmes_error():
    """Every row is predicted, and the docs' `--validate` block states what a fresh run computes."""
    results, skipped = validation(str(PUBLISHED))
    text = docs_text()  # (docs/serving.md states it)
    block = text[text.index("$ fived plan --serve --validate tests/data/published_serving.csv") :]
    rows = int(re.search(r"predicted (\d+) of (\d+) rows", block).group(1))
    stated = float(re.search(r"median absolute error: ([\d.]+)%", block).group(1))
    assert skipped == [] and len(results) == rows == len(read_rows(str(PUBLISHED)))
    assert round(median_error(results), 1) == stated
    rows = [r.values for r, _, _ in results]
    assert {r["model"] for r in rows} == {"llama3-8b", "llama3-70b", "mixtral-8x7b"}
    assert {hardware(r["gpu"]).name.split("-")[0] for r in rows} >= {"a100", "h100"}
    assert len({r["engine"] for r in rows}) >= 3 and all(r["locator"] and r["source"] for r in rows)


def test_kv_cache_per_token_follows_the_attention_shape():
    m = model_preset("llama3-70b")  # 8 kv heads of 128
    per_token = [kv_cache_bytes(m, tp=tp, layers=[0], sequences=1, positions=1, element_bytes=2) for tp in (1, 8, 16)]
    assert per_token == [2 * 8 * 128 * 2, 2 * 128 * 2, 2 * 128 * 2]  # tp16: each rank still holds one whole kv head
    assert kv_cache_bytes(m, tp=8, layers=range(80), sequences=3, positions=100, element_bytes=1) == 80 * 3 * 100 * 256
    mla = model_preset("deepseek-v3")  # the kv latent (512) and the rope key (64), whole on every tp rank
    per_token = [kv_cache_bytes(mla, tp=tp, layers=[0], sequences=1, positions=1, element_bytes=2) for tp in (1, 8)]
    assert per_token == [(512 + 64) * 2] * 2


def test_fp8_weights_take_one_byte_for_the_linear_layers_only():
    m = model_preset("llama3-8b")
    w = stage_weights(m, ServeLayout(tp=2), 0)
    bf16, fp8 = w.bytes("bf16"), w.bytes("fp8")
    assert bf16 - fp8 == w.linear and w.embedding == m.vocab_size * m.dim // 2
    assert abs(bf16 / 2 - 8.03e9 / 2) / 8.03e9 < 0.01  # Llama 3 8B's 8.03B parameters, half per GPU


def test_the_element_size_follows_the_weights_dtype():
    """float32 (what fived generate's CPU ranks run): every weight, activation and tp payload in 4 bytes."""
    from fived.layout.spec import local_vocab
    from fived.planner.links import collective_seconds, group_link

    m = model_preset("llama3-8b")
    hw = replace(hardware("h100"), link_latency_s=0.0, peer_latency_s=0.0)
    cluster = Cluster(hw, 2, 2)
    tp = {
        w: forward_time(m, ServeLayout(tp=2, weights=w), cluster, sequences=4, new_tokens=64, context=64, kv_bytes=2).tp
        for w in ("bf16", "float32")
    }
    from fived.planner.constants import CALIBRATION

    c = CALIBRATION.constants
    logits = collective_seconds("all_gather_single", 4 * local_vocab(m, 2) * 2 * 4, group_link(cluster, 1, 2, c), hw, c)
    assert math.isclose(tp["float32"] - logits, 2 * (tp["bf16"] - logits))  # (the logits are float32 in both)
    w = stage_weights(m, ServeLayout(tp=2), 0)
    assert w.bytes("float32") == 2 * w.bytes("bf16") and ServeLayout(weights="float32").element_bytes == 4


@pytest.mark.parametrize("layout", [ServeLayout(tp=4, dp=2), ServeLayout(tp=2, pp=3, dp=1)])
def test_the_kv_cache_fills_what_the_weights_leave(layout):
    m, hw = model_preset("llama3-70b"), hardware("h100")
    capacity = 77 * 2**30
    fit = sequences_that_fit(m, layout, hw, capacity, positions=4096, forward_tokens=2048, kv_bytes=2)
    fits = [
        gpu_memory(m, layout, hw, sequences=n, positions=4096, forward_tokens=2048, kv_bytes=2).total <= capacity
        for n in (fit, fit + 1)
    ]
    assert fit > 10 and fits == [True, False]


def test_queueing_model():
    assert [poisson_quantile(mean, 0.99) for mean in (0, 1, 10)] == [0, 4, 18]
    m = model_preset("llama3-8b")
    w = Workload(1024, 128)
    replica = Replica(m, ServeLayout(), Cluster(hardware("h100"), 1, 8), w, fit=200)
    alone = replica.closed_loop(1)
    assert (
        alone.ttft_s == replica.prefill.total and alone.tpot_s == replica.step(1) == replica.decode(1).total
    )  # nobody queues
    saturated = replica.open_loop(1.01 / replica.prefill.total)
    assert not saturated.stable
    light, heavy = replica.open_loop(0.5), replica.open_loop(5.0)
    assert light.batch < heavy.batch and light.p99_ttft_s < heavy.p99_ttft_s and light.p99_tpot_s < heavy.p99_tpot_s
    # Little's law: the decode batch is the rate times the time a request spends decoding
    assert math.isclose(heavy.batch, 5.0 * w.output_len * heavy.tpot_s, rel_tol=1e-4)
    loose = replica.goodput_rate()
    tight = Replica(m, ServeLayout(), Cluster(hardware("h100"), 1, 8), replace(w, tpot_s=heavy.p99_tpot_s), 200)
    assert 0 < tight.goodput_rate() <= 5.0 * 1.001 < loose


def test_pipeline_replicas_keep_pp_batches_in_flight():
    """With pp, a forward's latency is its stages one after another but the replica starts one every
    busiest-stage interval (vLLM's --pipeline-parallel-size batches in flight): a lone request still
    pays the whole latency, while at load tp4 pp2 delivers about what tp4 x 2 replicas do."""
    m, w = model_preset("llama3-70b"), Workload(2048, 256, concurrency=256)
    pp = Replica(m, ServeLayout(tp=4, pp=2, weights="fp8"), H100x8, w, fit=600)
    forward = pp.decode(64)
    assert len(forward.stages) == 2 and math.isclose(sum(forward.stages), forward.total)
    assert forward.interval == max(forward.stages) < 0.6 * forward.total
    assert pp.step(64) == max(forward.total, 2 * forward.interval)  # two micro-batches of 32
    assert pp.closed_loop(1).tpot_s == pp.decode(1).total  # one sequence: no pipelining
    assert pp.prefill_s == pp.prefill.interval < pp.prefill.total
    pipelined = evaluate(m, ServeLayout(tp=4, pp=2, weights="fp8"), H100x8, w).throughput
    replicated = evaluate(m, ServeLayout(tp=4, dp=2, weights="fp8"), H100x8, w).throughput
    assert 0.9 < pipelined / replicated < 1.1


def test_decode_is_bound_by_reading_the_weights():
    """A decode step of one sequence reads every weight of the GPU: tp halves it, fp8 halves it again."""
    m, w = model_preset("llama3-70b"), Workload(128, 128, concurrency=1)
    steps = {
        (tp, dt): evaluate(m, ServeLayout(tp=tp, dp=8 // tp, weights=dt), H100x8, w).decode.compute
        for tp in (2, 4)
        for dt in ("bf16", "fp8")
    }
    assert 0.45 < steps[(4, "bf16")] / steps[(2, "bf16")] < 0.55
    assert 0.45 < steps[(4, "fp8")] / steps[(4, "bf16")] < 0.6


@pytest.mark.parametrize(
    "model,gpus,layout,workload,bound,spread",
    [
        (
            "llama3-70b",
            1,
            ServeLayout(weights="fp8"),
            Workload(2048, 256, concurrency=2),
            "bound by HBM bandwidth",
            "serving runs the whole model on each GPU",
        ),  # two sequences: the weights' reads dominate
        (
            "llama3-8b",
            8,
            ServeLayout(dp=8, weights="fp8"),
            Workload(32, 32, concurrency=16384),
            "compute-bound",
            "serving replicates (dp8) for throughput",
        ),  # 2048 short sequences per GPU: the GEMMs dominate
    ],
)
def test_why_serving_differs_from_training_is_computed(model, gpus, layout, workload, bound, spread):
    m = model_preset(model)
    plan = evaluate(m, layout, Cluster(hardware("h100"), gpus, min(gpus, 8)), workload)
    no_training = TrainingView(4096, 1024, None, 200.0, 0, None)
    lines = why_they_differ(plan, no_training, m, workload)
    decode = next(line for line in lines if line.startswith("a decode forward"))
    assert bound in decode.split("; a prefill")[0]
    assert (plan.decode.read > plan.decode.gemm) == (bound == "bound by HBM bandwidth")
    assert lines[-1] == spread and "tp1" not in " ".join(lines) and "dp1" not in " ".join(lines)


def test_the_forward_dispatch_counts_are_the_models():
    """The operators fived's model dispatches per layer in a decode step (what CPU ranks pay per op)."""
    from torch.profiler import ProfilerActivity, profile

    from fived.model.init import init_weights
    from fived.model.transformer import build_model
    from fived.tools.generate import KVCachedAttentionCore

    def ops(name: str, layers: int) -> int:
        model = build_model(replace(model_preset(name), n_layers=layers), "cpu", torch.float32)
        init_weights(model, 0)
        for block in model.layers.values():
            block.attention.core = KVCachedAttentionCore(8)
        with torch.no_grad():
            model(torch.zeros((2, 4), dtype=torch.long), positions=torch.arange(4))
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                model(torch.zeros((2, 1), dtype=torch.long), positions=torch.tensor([4]))
        return sum(1 for e in prof.events() if e.cpu_parent is None)

    for name, per_layer in (("tiny", DENSE_LAYER_OPS), ("tiny-moe", MOE_LAYER_OPS)):
        one, three = ops(name, 1), ops(name, 3)
        assert (three - one) // 2 == per_layer and abs(one - per_layer - 2 * END_OPS) <= 2, name


def test_plan_serve_for_llama3_70b_on_8_h100_prints_the_serving_and_training_plans(capsys):
    assert main(SERVE_70B + ["--rate", "2", "--ttft-ms", "2000", "--tpot-ms", "50"]) == 0
    out = capsys.readouterr().out
    assert "vllm serve path/to/llama3-70b-hf --tensor-parallel-size" in out and "--max-model-len 2304" in out
    assert "none fits: the least memory any training layout needs" in out and "why they differ:" in out
    assert main(SERVE_70B + ["--rate", "2", "--ttft-ms", "2000", "--tpot-ms", "50", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    best = data["plans"][0]
    assert best["meets_targets"] and best["p99_ttft_ms"] <= 2000 and best["p99_tpot_ms"] <= 50
    assert data["training"]["fits"] is False and data["training"]["fits_at_gpus"] > 8
    assert best["goodput_tokens_per_s"] == max(p["goodput_tokens_per_s"] for p in data["plans"])


def test_a_saturated_plan_without_targets_says_so(capsys):
    """More requests than 8 H100 sustain, no latency target: the decode step at the batch that fits, and
    the shortfall named as what it is (no target to miss)."""
    assert main(SERVE_70B + ["--rate", "100", "--top", "2"]) == 0  # (a plan, not a failure)
    chosen = capsys.readouterr().out.split("chosen: ")[1]
    assert "inf" not in chosen.split("serve it")[0] and "target" not in chosen.split("\n")[0]
    assert "saturated: 100 requests/s is more than" in chosen and "no layout serves it: the closest" in chosen
    assert "decode step at its full batch of" in chosen and "  the most it sustains: " in chosen


def test_a_model_no_layout_holds_gets_no_serve_command_and_exit_1(capsys):
    """llama3-405b on one H100: no layout holds one sequence. The closest is the one needing the least
    memory (fp8 weights), no vLLM command is printed for it (it printed one), the exit is 1; with
    --concurrency the queueing line is the closed loop's, not the Poisson arrivals'."""
    flags = ["plan", "--serve", "--model", "llama3-405b", "--gpus", "1", "--gpu", "h100"]
    flags += ["--prompt-len", "2048", "--output-len", "256"]
    assert main([*flags, "--rate", "2", "--ttft-ms", "100"]) == 1
    out = capsys.readouterr().out
    assert out.split("chosen: ")[1].startswith("tp1 fp8") and "vllm serve" not in out
    assert "serve it: not as priced: no layout priced holds one sequence; e.g. more GPUs" in out
    assert main([*flags, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["vllm"] == ""
    assert main([*flags, "--concurrency", "8"]) == 1
    queueing = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("queueing:"))
    assert "closed loop: 8 requests in flight" in queueing and "Poisson" not in queueing
    # where none meets the workload and all tie (saturated: no goodput, p99 TTFT inf), a layout holding
    # no sequence (its memory without a KV cache can be the least) never ranks before one holding some
    from types import SimpleNamespace

    from fived.planner.serve import rank_plans

    def tied(fit: int, gib: float):
        at = SimpleNamespace(p99_ttft_s=math.inf)
        return SimpleNamespace(meets=False, fit=fit, goodput=0.0, at=at, memory=SimpleNamespace(total=gib * 2**30))

    holds_none, holds_one, holds_two = tied(0, 79.5), tied(1, 79.9), tied(2, 79.8)
    workload = Workload(prompt_len=2048, output_len=256, rate=0.0)
    assert rank_plans([holds_none, holds_one, holds_two], workload) == [holds_two, holds_one, holds_none]


def test_the_vllm_command_runs_the_layout_as_priced():
    """vLLM's --enable-expert-parallel puts whole experts on tp x dp GPUs and its --data-parallel-size cuts
    an MoE model's experts over them: a command only for the layouts it runs as fived prices them."""
    m, w = model_preset("mixtral-8x7b"), Workload(1024, 256, concurrency=64)
    plans = {p.layout.describe(): p for p in plan_serving(m, H100x8, w, ("bf16",))}
    command = vllm_command(plans["tp1 dp8 ep4 bf16"], w, "mixtral-hf", m)
    assert "--tensor-parallel-size 1 --data-parallel-size 4 --enable-expert-parallel" in command
    assert command.endswith("# x 2 engines behind a load balancer")
    replicas = vllm_command(plans["tp2 dp4 bf16"], w, "mixtral-hf", m)  # ep1: four engines, experts cut over tp2
    assert "--data-parallel-size" not in replicas and replicas.endswith("# x 4 engines behind a load balancer")
    assert vllm_command(plans["tp2 dp4 ep2 bf16"], w, "mixtral-hf", m) == ""
    assert "whole experts on its tp x dp = 4 GPUs" in vllm_mismatch(m, plans["tp2 dp4 ep2 bf16"].layout)
    dense = model_preset("llama3-8b")
    assert "--tensor-parallel-size 2 --data-parallel-size 4" in vllm_command(
        evaluate(dense, ServeLayout(tp=2, dp=4), H100x8, w), w, "llama-hf", dense
    )


@pytest.mark.parametrize(
    "flags,line",
    [
        (["--rate", "2", "--concurrency", "8"], "--rate=2.0: give --rate or --concurrency, not both; drop one"),
        (["--rate", "-1"], "--rate=-1.0: must be > 0; e.g. --rate 2"),
        (["--layout", "--tp 3"], "parallel.tp=3: must divide model.n_heads=64; e.g. --tp 2"),
        (["--weights", "int4"], "--weights=int4: must list bf16 and/or fp8; e.g. --weights bf16,fp8"),
        (
            ["--machine", "m.json"],
            "--machine=m.json: not read by --serve: a serving plan prices the catalogue's GPU (--gpu); a machine "
            "profile prices training plans; drop --machine",
        ),
        (
            ["--model", "/"],
            "--model=/: is neither a Hugging Face model directory (config.json) nor a fived run or "
            "checkpoint (checkpoints/step-<N>/COMPLETE); give one of those",
        ),
    ],
)
def test_bad_serving_flags_are_refused_in_one_line(flags, line, capsys):
    if flags[0] == "--layout":  # (tp*pp must divide the GPUs first: 6 GPUs)
        args = [a if a != "8" else "6" for a in SERVE_70B] + flags
    else:
        args = SERVE_70B + flags
    assert main(args) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"fived: error: {line}"]
