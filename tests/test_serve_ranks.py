"""Multi-rank generation (`fived.tools.generate_ranks`) on real gloo ranks: the greedy ids equal the one-process
generation of each prompt, and each rank's KV-cache bytes equal what `fived plan --serve` predicts for
the same layout and workload, exactly."""

import json

import pytest
import torch

from fived.cli.main import main
from fived.config import model_preset
from fived.model.init import init_weights
from fived.model.transformer import build_model
from fived.tools.generate import Sampling, generate
from fived.tools.generate_ranks import generate_on_ranks, generated_ids, generation_config

# Four prompts of different lengths; each half's longest is 7 tokens, so every data-parallel rank's
# cache holds 7 + OUTPUT positions per sequence (what --prompt-len 7 predicts).
PROMPTS = [[5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7], [10, 11, 12, 13, 14, 15, 16], [200, 100, 50, 25]]
OUTPUT = 6


def one_process(model_name: str, dtype: torch.dtype) -> list[list[int]]:
    """Each prompt alone through `fived.tools.generate.generate` (the one-process path, tested against
    transformers), with the initial weights of seed 0."""
    out = []
    for prompt in PROMPTS:
        model = build_model(model_preset(model_name), "cpu", dtype)
        init_weights(model, seed=0)
        out.append(generate(model, prompt, Sampling(max_new_tokens=OUTPUT)))
    return out


def planned_kv_bytes(capsys, model: str, world: int, tp: int, pp: int, ep: int, kv_dtype: str) -> int:
    """The KV-cache bytes per GPU `fived plan --serve --layout ... --json` predicts for these ranks
    serving the four prompts at once."""
    capsys.readouterr()
    assert (
        main(
            [
                "plan",
                "--serve",
                "--model",
                model,
                "--gpus",
                str(world),
                "--gpu",
                "h100",
                "--prompt-len",
                "7",
                "--output-len",
                str(OUTPUT),
                "--concurrency",
                str(len(PROMPTS)),
                "--kv-dtype",
                kv_dtype,
                "--layout",
                f"--tp {tp} --pp {pp} --ep {ep}",
                "--json",
            ]
        )
        == 0
    )
    return json.loads(capsys.readouterr().out)["plans"][0]["memory_bytes"]["kv_cache"]


@pytest.fixture(scope="module")
def references():
    return {name: one_process(name, torch.float64) for name in ("tiny", "tiny-moe", "tiny-deepseek-v3", "tiny-gpt-oss")}


@pytest.mark.parametrize(
    "model,world,tp,pp,ep",
    [
        ("tiny", 1, 1, 1, 1),
        ("tiny", 2, 2, 1, 1),
        ("tiny", 4, 4, 1, 1),  # tp4 > 2 kv heads: each rank holds one
        ("tiny", 2, 1, 2, 1),
        ("tiny-moe", 2, 1, 1, 2),
        ("tiny-moe", 4, 2, 1, 2),
        ("tiny-deepseek-v3", 2, 2, 1, 1),  # the latent cache: whole on each tp rank, as the plan prices it
        ("tiny-gpt-oss", 2, 1, 1, 2),  # windows of 8 on half the layers: rolling caches, wrapped by 13 positions
    ],
)
def test_generation_on_ranks_equals_one_process_and_the_planned_kv_cache(model, world, tp, pp, ep, references, capsys):
    cfg = generation_config(model_preset(model), world, tp=tp, pp=pp, ep=ep, dtype="float64")
    reports = generate_on_ranks(cfg, world, PROMPTS, Sampling(max_new_tokens=OUTPUT))
    assert generated_ids(reports) == references[model]
    assert len({tuple(ids) for ids in references[model]}) == len(PROMPTS)  # (the prompts do not all give the same)
    planned = planned_kv_bytes(capsys, model, world, tp, pp, ep, "float64")
    for r in reports:
        assert r.positions == 7 + OUTPUT and r.kv_bytes == r.kv_formula, r
        assert r.windowed == (r.layers // 2 if model_preset(model).sliding_window else 0)
    # the planner prices the busiest GPU: every rank here (one pipeline rank holds as many layers as the other)
    assert [r.kv_bytes for r in reports] == [planned] * world


def test_the_kv_cache_holds_each_tp_ranks_share_of_the_kv_heads(capsys):
    """tp2 holds half of tiny's two kv heads per rank; tp4 a whole one (shared by two ranks): the same
    bytes as tp2, half of tp1's."""
    one, two, four = (planned_kv_bytes(capsys, "tiny", w, w, 1, 1, "float32") for w in (1, 2, 4))
    assert two * 2 == one and four == two


def test_a_batch_that_does_not_divide_among_the_data_parallel_ranks_is_refused():
    from fived.config import ConfigError

    cfg = generation_config(model_preset("tiny-moe"), 2, ep=2)
    with pytest.raises(ConfigError, match=r"3 prompts: must divide among dp=2"):
        generate_on_ranks(cfg, 2, PROMPTS[:3], Sampling(max_new_tokens=2))


def _generate_lines(capsys, source, prompts: list[str], *flags) -> list[dict]:
    """`fived generate SOURCE --prompt ... --json` in float64: one JSON line per prompt."""
    capsys.readouterr()
    args = [
        "generate",
        str(source),
        *(a for p in prompts for a in ("--prompt", p)),
        "--dtype",
        "float64",
        "--max-new-tokens",
        str(HF_OUTPUT),
        "--json",
        *flags,
    ]
    assert main(args) == 0
    return [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]


HF_PROMPTS = ["Hello, world", "The model is", "a", "Tensor parallel ranks "]
HF_OUTPUT = 12


@pytest.mark.parametrize(
    "kind,flags", [("llama", ["--nproc", "4", "--tp", "2", "--pp", "2"]), ("mixtral", ["--nproc", "2", "--ep", "2"])]
)
def test_generation_on_ranks_from_a_transformers_directory_equals_one_process(kind, flags, tmp_path, capsys):
    """A random Hugging Face model read by placement on the ranks (`fived generate --nproc`, the CLI's
    path): each prompt's greedy ids equal the one-process generation of that prompt alone (float64),
    and both stop at the model's eos_token_id, set here to a token one prompt generates midway."""
    pytest.importorskip("transformers")
    from hf_models import save_hf_model

    save_hf_model(kind, tmp_path)
    free = [_generate_lines(capsys, tmp_path, [p])[0]["generated_ids"] for p in HF_PROMPTS]
    assert all(len(ids) == HF_OUTPUT for ids in free) and len({tuple(ids) for ids in free}) == len(HF_PROMPTS)
    eos = next(ids[5] for ids in free if ids[5] not in ids[:5])  # a token first generated at step 6
    for name in ("config.json", "generation_config.json"):  # (the second, when saved, names the first's eos)
        if (tmp_path / name).is_file():
            config = json.loads((tmp_path / name).read_text())
            (tmp_path / name).write_text(json.dumps({**config, "eos_token_id": eos}))
    alone = [_generate_lines(capsys, tmp_path, [p])[0]["generated_ids"] for p in HF_PROMPTS]
    assert [ids[: ids.index(eos) + 1] if eos in ids else ids for ids in free] == alone
    assert any(len(ids) < HF_OUTPUT for ids in alone) and any(len(ids) == HF_OUTPUT for ids in alone)
    on_ranks = _generate_lines(capsys, tmp_path, HF_PROMPTS, *flags)
    assert [line["generated_ids"] for line in on_ranks] == alone
    assert [line["prompt_ids"] for line in on_ranks] == [list(p.encode()) for p in HF_PROMPTS]


@pytest.mark.parametrize(
    "flags,line",
    [
        (["--nproc", "3", "--tp", "2"], "--nproc=3: must be a multiple of --tp x --pp = 2; e.g. --nproc 2"),
        (
            ["--nproc", "4", "--pp", "4"],
            "--pp=4: 4 pipeline stages need at least as many layers (model.n_layers=2); e.g. --pp 2",
        ),
        (
            ["--nproc", "2", "--ep", "2"],
            "--ep=2: needs a mixture-of-experts model (model.name=hf-llama is dense); use "
            "--ep 1, or a MoE model such as --model tiny-moe",
        ),
    ],
)
def test_a_generation_layout_is_refused_in_one_line_naming_generates_flag(flags, line, tmp_path, capsys):
    pytest.importorskip("transformers")
    from hf_models import save_hf_model

    save_hf_model("llama", tmp_path)
    capsys.readouterr()
    assert main(["generate", str(tmp_path), "--prompt", "a", "--prompt", "b", *flags]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"fived: error: {line}"]


def test_moe_with_expert_capacity_is_refused_on_ranks():
    """Capacity-limited routing would count a batch's left padding against the experts' capacity."""
    from dataclasses import replace

    from fived.config import ConfigError

    with pytest.raises(
        ConfigError,
        match=r"^model.capacity_factor=1.25: generation on ranks batches left-padded "
        r"prompts.*; generate each prompt alone in one process",
    ):
        generation_config(replace(model_preset("tiny-moe"), capacity_factor=1.25), 2, ep=2)
