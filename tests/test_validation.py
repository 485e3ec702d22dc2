"""Invalid configurations are refused with one line naming the field, before any rank starts."""

import pytest

import fived.launch.ranks
import fived.tools.verification
from fived.cli.main import main


@pytest.fixture
def no_ranks(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a rank was started for an invalid configuration")

    monkeypatch.setattr(fived.launch.ranks, "run_ranks", refuse)
    monkeypatch.setattr(fived.tools.verification, "run_ranks", refuse)


CASES = [
    # (command line, field named in the error, words of the rule)
    (["train", "--nproc", "3", "--dp", "2"], "parallel", "must equal the number of ranks (3)"),
    (["train", "--nproc", "2", "--tp", "3"], "parallel", "tp*pp*cp=3 must divide the number of ranks (2)"),
    (["train", "--nproc", "4", "--tp", "3"], "parallel", "tp*pp*cp=3 must divide the number of ranks (4)"),
    (["train", "--nproc", "0"], "--nproc", "must be >= 1"),
    (["train", "--nproc", "-2"], "--nproc", "must be >= 1"),
    (["train", "--train.output_dir", "/etc/hostname/run"], "train.output_dir", "cannot be written"),
    (["train", "--data.tokenizer", "/nonexistent/tokenizer.json"], "data.tokenizer", "file not found"),
    (
        ["prepare-data", "/etc/hostname", "--output", "/tmp/x", "--tokenizer", "/nonexistent/tok.json"],
        "--tokenizer",
        "file not found",
    ),
    (["train", "--stpes", "10"], "--stpes", "unknown flag; did you mean --steps?"),
    (["verify", "--microbatchs", "2"], "--microbatchs", "unknown flag; did you mean --microbatches?"),
    (["verify", "--tp", "3"], "parallel.tp", "must divide model.n_heads=4"),
    (
        ["verify", "--tp", "4", "--model.n_heads", "8", "--model.n_kv_heads", "3", "--model.dim", "96"],
        "model.n_kv_heads",
        "divide model.n_heads=8",
    ),
    (["verify", "--pp", "8"], "parallel.pp", "at least as many layers"),
    (
        ["verify", "--pp", "2", "--pp-schedule", "zbv", "--train.activation_checkpointing", "selective"],
        "train.activation_checkpointing",
        "selective checkpointing cannot run under zbv",
    ),
    (["verify", "--ep", "2"], "parallel.ep", "needs a mixture-of-experts model"),
    (["verify", "--dp", "3", "--ep", "3", "--model", "tiny-moe"], "parallel.ep", "must divide model.n_experts=8"),
    (["verify", "--dp", "2", "--ep", "4", "--model", "tiny-moe"], "parallel.ep", "must divide dp*cp=2"),
    (["verify", "--cp", "2", "--seq-len", "30"], "train.seq_len", "divisible by 2*cp=4"),
    (["verify", "--dp", "3"], "train.global_batch", "divisible by dp=3"),
    (["verify", "--dp", "2", "--microbatches", "3"], "train.microbatches", "must divide the per-rank batch"),
    (["verify", "--zero", "4"], "parallel.zero", "must be one of 0, 1, 2, 3"),
    (["verify", "--pp-schedule", "gpipe2"], "parallel.pp_schedule", "must be one of"),
    (["verify", "--dtype", "float16"], "train.dtype", "must be one of"),
    (["verify", "--model.dim", "66"], "model.dim", "divisible by model.n_heads=4"),
    (["verify", "--model", "tiny-moe", "--model.top_k", "9"], "model.top_k", "must be in 1..n_experts=8"),
    (["verify", "--tp", "0"], "parallel.tp", "must be >= 1"),
    (["train", "--train.activation_checkpointing", "some"], "train.activation_checkpointing", "must be one of"),
    (["verify", "--train.stepz", "3"], "train.stepz", "unknown field"),
    (["verify", "--model", "llama9"], "model.name", "unknown preset"),
    (
        ["verify", "--dp", "4", "--dp-replicate", "2", "--zero", "3", "--ep", "2", "--model", "tiny-moe"],
        "parallel.ep",
        "with HSDP replicas is not supported yet",
    ),
    (["verify", "--tp", "4", "--model.ffn_dim", "130"], "model.ffn_dim", "divisible by tp=4"),
    (
        ["verify", "--pp", "2", "--microbatches", "2", "--model.tie_embeddings", "true"],
        "model.tie_embeddings",
        "across pipeline stages",
    ),
    (
        ["verify", "--pp", "2", "--dp", "2", "--zero", "3", "--microbatches", "2", "--model", "tiny-deepseek-v3"],
        "model.mtp_depth",
        "runs with ZeRO-0/1",
    ),
    (["verify", "--model", "tiny-deepseek-v3", "--model.mtp_depth", "-1"], "model.mtp_depth", "must be in 0.."),
    (["train", "--data.path", "/nonexistent/tokens.bin"], "data.path", "not found"),
    (["train", "--resume", "/nonexistent/run"], "--resume", "no such directory"),
    (["train", "--resume", "/etc/hostname"], "--resume", "not a directory"),
    (["verify", "--dp", "2", "--nproc", "2", "--reshard-from", ""], "--reshard-from", "no layout flags"),
    (
        ["verify", "--pp", "2", "--pp-virtual", "2", "--microbatches", "2"],
        "parallel.pp_virtual",
        "only interleaved-1f1b and zero-bubble take virtual stages",
    ),
    (
        ["verify", "--pp", "2", "--pp-layers", "3,2", "--microbatches", "2"],
        "parallel.pp_layers",
        "summing to model.n_layers=4",
    ),
    (
        ["verify", "--pp", "2", "--pp-schedule", "dualpipev", "--microbatches", "2"],
        "train.microbatches",
        "dualpipev needs at least as many micro-batches as stages",
    ),
    (["verify", "--sp"], "parallel.sp", "needs tp > 1"),
    (["train", "--train.eval_every", "5"], "train.eval_every", "needs validation data"),
    (["train", "--train.eval_every", "-1"], "train.eval_every", "must be >= 0"),
    (["train", "--train.eval_every", "5", "--data.val_path", "/nonexistent/val.bin"], "data.val_path", "not found"),
    (
        ["prepare-data", "/etc/hostname", "--output", "/tmp/x", "--val-fraction", "1.5"],
        "--val-fraction",
        "must be in [0, 1)",
    ),
    (["prepare-data", "/nonexistent/docs.jsonl", "--output", "/tmp/x"], "inputs", "file not found"),
    (["verify", "--tp", "2", "--sp", "--seq-len", "31"], "train.seq_len", "divisible by tp*cp=2 with --sp"),
    (
        ["verify", "--dp", "4", "--dp-replicate", "3", "--zero", "3", "--global-batch", "12"],
        "parallel.dp_replicate",
        "divide dp=4",
    ),
    (["verify", "--dp", "4", "--dp-replicate", "2"], "parallel.dp_replicate", "need a sharded stage"),
    (
        ["verify", "--dtype", "bfloat16", "--parallel.reduce_dtype", "float16"],
        "parallel.reduce_dtype",
        "must be one of float32, bfloat16",
    ),
    (["train", "--train.optimizer", "sgd"], "train.optimizer", "must be one of adamw, muon"),
    (["train", "--train.optimizer", "muon", "--train.muon_scale", "unit"], "train.muon_scale", "must be one of"),
    (
        ["train", "--train.optimizer", "muon", "--train.muon_ns_coefficients", "3.4,-4.7"],
        "train.muon_ns_coefficients",
        "must be one finite 'a,b,c'",
    ),
    (
        [
            "train",
            "--train.optimizer",
            "muon",
            "--train.muon_ns_steps",
            "3",
            "--train.muon_ns_coefficients",
            "3,-4,2;3,-4,2",
        ],
        "train.muon_ns_coefficients",
        "train.muon_ns_steps=3 of them",
    ),
    (["train", "--train.optimizer", "muon", "--train.muon_momentum", "1"], "train.muon_momentum", "must be in [0, 1)"),
    (["train", "--train.optimizer", "muon", "--train.muon_ns_steps", "0"], "train.muon_ns_steps", "must be >= 1"),
    (["train", "--train.optimizer", "muon", "--train.muon_bucket_mb", "0"], "train.muon_bucket_mb", "must be > 0"),
    # MoE parallel folding: routes each tp rank's sequence shard, ep over dp*cp*tp
    (
        ["verify", "--model", "tiny-moe", "--nproc", "4", "--tp", "2", "--ep", "2", "--parallel.etp", "1"],
        "parallel.etp",
        "needs sequence parallelism",
    ),
    (["verify", "--model", "tiny-moe", "--parallel.etp", "2"], "parallel.etp", "must be 0"),
    # Muon's options under AdamW would be ignored: refused
    (["train", "--train.muon_scale", "spectral"], "train.muon_scale", "only acts with train.optimizer=muon"),
    (["verify", "--train.muon_nesterov", "false"], "train.muon_nesterov", "only acts with train.optimizer=muon"),
    (
        ["verify", "--parallel.zero", "1", "--parallel.overlap_grad_reduce", "true"]
        + ["--parallel.zero2_reduce_every_microbatch", "true"],
        "parallel.zero2_reduce_every_microbatch",
        "needs zero=2 with overlap_grad_reduce",
    ),
]


@pytest.mark.parametrize("argv, field, rule", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_refused_before_any_rank(argv, field, rule, no_ranks, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert err.startswith(f"fived: error: {field}="), err
    assert rule in err, err
    # the rule broken and a way out: a concrete valid value, never a generic "meet the rule"
    assert ";" in err and "use a value that meets the rule" not in err, err


@pytest.mark.parametrize("argv", [["train", "--steps"], ["plan", "--gpus", "eight"], ["trian"], ["plan", "-zzzzzzzz"]])
def test_argparses_refusals_are_one_line_too(argv, no_ranks, capsys):
    """A flag without its value, a value of the wrong type, an unknown command: one line, exit 2."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exited.value.code == 2 and "\n" not in err, err
    assert err.startswith("fived") and ": error: " in err and err.endswith(" --help"), err
    assert argv[0] == "trian" or err.endswith(f"see fived {argv[0]} --help"), err  # (its command's help)


def test_a_jsonl_without_the_text_field_names_the_fields_it_has(tmp_path, no_ranks, capsys):
    (tmp_path / "docs.jsonl").write_text('{"text": "hello", "id": 1}\n')
    assert (
        main(["prepare-data", str(tmp_path / "docs.jsonl"), "--output", str(tmp_path / "x"), "--text-field", "body"])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no field 'body' (its fields: 'text', 'id'); give the text's field" in err, err


def test_world_size_errors_suggest_valid_layouts(no_ranks, capsys):
    main(["train", "--nproc", "4", "--dp", "3"])
    err = capsys.readouterr().err
    assert "nearest valid layouts: --dp 4 --tp 1 --pp 1 --cp 1 --ep 1" in err


def test_distinct_rules_covered():
    assert len({(c[1], c[2]) for c in CASES}) >= 10


def test_cuda_without_a_gpu_is_refused(no_ranks, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["train", "--train.device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fived: error: train.device=cuda: no CUDA device") and err.count("\n") == 0, err


def test_the_way_out_is_the_nearest_valid_value():
    from fived.config import ConfigError, build_config
    from fived.layout.rules import check_config

    cfg = build_config(overrides={"parallel.dp": 3, "train.global_batch": 16})
    with pytest.raises(ConfigError, match=r"divisible by dp=3; e\.g\. --global-batch 15$"):
        check_config(cfg, 3)


def test_warmup_longer_than_the_run_is_warned(tmp_path, capsys):
    from fived.config import build_config
    from fived.launch.run_setup import check_environment

    cfg = build_config(overrides={"train.warmup_steps": 300, "train.steps": 200, "train.output_dir": str(tmp_path)})
    check_environment(cfg)
    err = capsys.readouterr().err.strip()
    assert err == (
        "fived: warning: train.warmup_steps=300 > train.steps=200: the learning rate never reaches "
        "train.lr=0.003; e.g. --train.warmup_steps 20"
    ), err


def test_version(capsys):
    import torch

    from fived import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"fived {__version__} (torch {torch.__version__})"
