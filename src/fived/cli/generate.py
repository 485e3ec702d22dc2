"""`fived generate`: continue prompts with a run's or a Hugging Face model, in one process (one prompt)
or on ranks with training's parallel modules (`--nproc`, `--tp`, `--pp`, `--ep`: `fived.tools.generate_ranks`).
Bad values are refused in one line before any model is read or rank started."""

from __future__ import annotations

import argparse
import json
import sys

from fived.config import ConfigError


def add_generate_command(sub) -> None:
    gen = sub.add_parser(
        "generate", allow_abbrev=False, help="continue a prompt with a run's model or a Hugging Face model"
    )
    gen.add_argument("source", help="a run directory, a checkpoint, or a Hugging Face model directory")
    gen.add_argument("--prompt", required=True, action="append", help="the text to continue (repeat for a batch)")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sample")
    gen.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="sample from the smallest set of tokens whose probability reaches this (default 1: all)",
    )
    gen.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")
    gen.add_argument("--dtype", default="float32", help="float32 (default), float64 or bfloat16")
    gen.add_argument("--device", default="auto", help="auto (one GPU if there is one, else CPU), cpu or cuda")
    gen.add_argument(
        "--json",
        action="store_true",
        help="print the prompt's token ids and the generated ids as JSON (a line per prompt)",
    )
    gen.add_argument("--nproc", type=int, help="ranks to generate on (default tp*pp*ep); dp is what tp*pp leaves")
    for dim, what in (("tp", "tensor-parallel"), ("pp", "pipeline"), ("ep", "expert-parallel (over dp)")):
        gen.add_argument(f"--{dim}", type=int, default=1, help=f"{what} size, as training splits the model (default 1)")
    gen.add_argument(
        "--report",
        action="store_true",
        help="print each rank's KV-cache bytes (measured and the "
        "serving planner's formula), prefill time and time per output token",
    )
    gen.set_defaults(func=cmd_generate)


def cmd_generate(ns: argparse.Namespace) -> int:
    import torch

    from fived.parallel.process_group import device_type
    from fived.tools.generate import Sampling, describe_source, generate, load_model

    for flag, value, ok, rule, example in (
        # (a KV cache is allocated for every position at once: 10^9 of them was a MemoryError traceback)
        ("--max-new-tokens", ns.max_new_tokens, 1 <= ns.max_new_tokens <= 2**20, "must be in 1..1048576", "64"),
        ("--temperature", ns.temperature, ns.temperature >= 0, "must be >= 0 (0: greedy)", "0.8"),
        ("--top-p", ns.top_p, 0 < ns.top_p <= 1, "must be in (0, 1]", "0.9"),
        ("--nproc", ns.nproc, ns.nproc is None or ns.nproc >= 1, "must be >= 1", "2"),
        *((f"--{d}", getattr(ns, d), getattr(ns, d) >= 1, "must be >= 1", "2") for d in ("tp", "pp", "ep")),
    ):
        if not ok:
            raise ConfigError(flag, value, rule, f"e.g. {flag} {example}")
    if ns.dtype not in ("float32", "float64", "bfloat16"):
        raise ConfigError("--dtype", ns.dtype, "must be float32, float64 or bfloat16", "e.g. float32")
    if ns.device not in ("auto", "cpu", "cuda") or (ns.device == "cuda" and not torch.cuda.is_available()):
        raise ConfigError("--device", ns.device, "must be auto, cpu or cuda (with a visible GPU)", "e.g. --device cpu")
    device = device_type(ns.device)
    sampling = Sampling(ns.max_new_tokens, ns.temperature, ns.top_p, ns.seed)
    ranks = ns.nproc or ns.tp * ns.pp * ns.ep
    if ranks > 1 or len(ns.prompt) > 1 or ns.report:
        cfg, tokenizer_name, stop_ids = describe_source(ns.source)
        _check_weights(ns.source)
        tokenizer = _tokenizer(ns.source, tokenizer_name)
        _warn_past_context(ns, cfg, tokenizer)
        return _generate_on_ranks(ns, cfg, ranks, tokenizer, sampling, stop_ids, device)
    model, tokenizer_name, stop_ids = load_model(ns.source, getattr(torch, ns.dtype), device)
    tokenizer = _tokenizer(ns.source, tokenizer_name)
    _warn_past_context(ns, None, tokenizer)
    prompt = _encoded(tokenizer, ns.prompt)[0]
    ids = generate(model, prompt, sampling, stop_ids)
    if ns.json:
        print(json.dumps({"prompt_ids": prompt, "generated_ids": ids, "text": tokenizer.decode(ids)}))
    else:
        print(ns.prompt[0] + tokenizer.decode(ids))
    return 0


def _check_weights(source: str) -> None:
    """A Hugging Face directory's weights readable, in one line before any rank starts (a rank
    would fail on them in its own traceback)."""
    from fived.hf.init import is_hf_directory
    from fived.hf.reader import HfCheckpoint

    if is_hf_directory(source):
        HfCheckpoint(source, field="source").check_readable()


def _tokenizer(source: str, name: str):
    """The source's tokenizer, or one line: a run records the path it was given, which may be
    relative to the directory it was started from."""
    from pathlib import Path

    from fived.data.loader import load_tokenizer

    if name != "byte" and not Path(name).is_file():
        where = "relative to the directory the run was started from" if not Path(name).is_absolute() else "moved"
        raise ConfigError(
            "source",
            source,
            f"was trained with the tokenizer {name!r}, not found from here ({where})",
            "run fived generate from that directory, or put the tokenizer back at that path",
        )
    return load_tokenizer(name)


def _warn_past_context(ns, model_cfg, tokenizer) -> None:
    """One line when a prompt and its new tokens run past the positions the model was trained on."""
    from fived.tools.generate import trained_context

    context = trained_context(ns.source)
    longest = max(len(tokenizer.encode(p)) for p in ns.prompt) + ns.max_new_tokens
    if context and longest > context:
        print(
            f"fived generate: warning: the prompt and --max-new-tokens reach {longest} tokens, past the "
            f"{context} the model was trained on; positions beyond it were never trained",
            file=sys.stderr,
        )


def _encoded(tokenizer, prompts: list[str]) -> list[list[int]]:
    out = [tokenizer.encode(p) for p in prompts]
    for text, ids in zip(prompts, out):
        if not ids:
            raise ConfigError("--prompt", repr(text), "encodes to no tokens", "give some text")
    return out


def _generate_on_ranks(ns, model, ranks: int, tokenizer, sampling, stop_ids, device: str) -> int:
    """`fived generate --nproc N --tp T --pp P --ep E`: the prompts as one batch on ranks."""
    from fived.tools.generate_ranks import format_report, generate_on_ranks, generated_ids, generation_config

    cfg = generation_config(model, ranks, tp=ns.tp, pp=ns.pp, ep=ns.ep, dtype=ns.dtype)
    cfg.train.device = device  # type: ignore[assignment]  # (checked: auto, cpu or cuda)
    prompts = _encoded(tokenizer, ns.prompt)
    reports = generate_on_ranks(cfg, ranks, prompts, sampling, source=ns.source, stop_ids=stop_ids, device=device)
    for text, prompt, ids in zip(ns.prompt, prompts, generated_ids(reports)):
        print(
            json.dumps({"prompt_ids": prompt, "generated_ids": ids, "text": tokenizer.decode(ids)})
            if ns.json
            else text + tokenizer.decode(ids)
        )
    if ns.report:
        print(format_report(reports, cfg))
    return 0
