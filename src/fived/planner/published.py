"""Published training runs as planner inputs: reading a CSV in the columns of
tests/data/published_runs.csv into (model, cluster, layout, runtime, reported throughput).

A row that cannot be read is skipped with one reason, never a traceback: `read_runs` returns the
rows it read and "row N skipped: <reason>" lines. Reading rules (each documented, none tuned):
- Values: empty, "n/a", "-", "?", "unknown", "not stated" are missing; a number may carry units or
  thousands separators ("1,024", "48 GPUs"). A missing required value skips the row.
- Model: GPT-style rows (GeLU MLP of width F, two matrices) become our SwiGLU block with the same
  matmul parameters: ffn = 2F/3 rounded to a multiple of 8*tp. A row is gated (SwiGLU, GeGLU) when
  its architecture notes say so, or, unsaid, when it has grouped-query attention or a Llama-family
  name. Missing kv_heads: multi-head attention; missing ffn_hidden: 4 x hidden (GeLU); missing
  vocab: the model family's (`FAMILY_VOCAB`), else the head ignored, noted. MoE columns:
  moe_experts, moe_top_k (default 2), moe_shared_experts, moe_ffn_hidden (default ffn_hidden), the
  first dense layers (a column naming dense layers, or "first N ... dense" in the notes). Expert
  parallelism wider than dp*cp spans the tp ranks: Megatron-Core's folding, etp 1 unless stated.
- GPU: `fived.planner.hardware.hardware(gpu_type, gpu_mem_GB)`: variants by their stated memory.
  The inter-node link, when the row states it as "N x M Gb/s" per node, replaces the catalogue's.
- Layout: tp, pp, cp, ep, etp, vpp/pp_schedule, sp, micro_batch, recomputation, the ZeRO/FSDP wording
  (`fived.planner.runtimes.zero_stage`); an unsaid schedule in Megatron is its default, 1F1B.
  A missing tp is what the GPUs leave with a stated dp (gpus/(dp*pp*cp)); more virtual stages than
  layers, the most that hold a layer each (Megatron's stages of only the embedding or the loss).
  What else the row leaves out is the planner's choice — the
  fastest option that fits the GPU's memory (or the fastest, when none fits) — and shown as such.
  dp inconsistent with gpus/(tp*pp*cp) is derived from the GPU count, and noted. --tp-comm-overlap
  implies sequence parallelism, --overlap-param-gather the distributed optimizer (Megatron requires it).
- Global batch: global_batch_seqs, or global_batch_tokens / seq_len, or micro_batch x grad_accum x
  dp, or a local batch per data-parallel replica x dp (a `local_batch` column, or under a pipeline
  a micro_batch the notes call the local batch or torchtitan's: split into pipeline micro-batches of
  the planner's size); unstated, the global batch per data-parallel rank of a row of the same source
  and model that states one; else, without a pipeline, one micro-batch per rank of the planner's
  size; with one, 4*pp micro-batches per rank.
- Split: a `split` column says which rows the fit may read: "fit" (or empty) or "test", a row held
  out of every fit (`fived.planner.fitting`) and only reported (`fived plan --validate`); any other
  value skips the row (a typo must not put a held-out row into the fit).
- Throughput, tokens/s per GPU: tokens_per_s_per_gpu, derived_tokens_per_s_per_gpu, or converted
  from step_time_s, tflops_per_gpu or mfu_pct with the papers' model-FLOP count (6 x matmul
  parameters + attention, no recomputation: `metrics.flops_per_token`).
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, overload

from fived.config import ConfigError, ModelConfig
from fived.layout.flops import flops_per_token
from fived.planner.hardware import hardware
from fived.planner.runtimes import Runtime, framework_runtime, zero_stage
from fived.planner.timing import Cluster

MISSING = ("", "n/a", "na", "-", "?", "unknown", "not stated", "none stated", "nan", "null")
GATED_NAMES = ("llama", "mistral", "mixtral", "qwen", "internlm", "olmo", "deepseek", "aquila", "baichuan", "yi-")
# A row without a vocabulary takes its family's (the tokenizers' published sizes; first match wins),
# noted; a family not here: the head's share ignored (a vocabulary of 1 token), noted.
FAMILY_VOCAB = (
    ("llama-3", 128256),
    ("llama3", 128256),
    ("llama", 32000),
    ("mixtral", 32000),
    ("mistral", 32000),
    ("qwen", 151936),
    ("deepseek-v2", 102400),
    ("deepseek-v3", 129280),
    ("deepseek", 102400),
    ("internlm", 103168),
    ("gpt", 50257),
    ("olmo", 50304),
)


class Skip(Exception):
    """A row that cannot be predicted; the message is the reason."""


@dataclass
class Row:
    row_id: str
    source: str
    model: ModelConfig
    cluster: Cluster
    runtime: Runtime
    seq_len: int
    global_batch: int | None  # sequences; None: one micro-batch per data-parallel rank (size: planner's)
    fixed: dict  # layout fields the row states
    open: dict  # layout fields it leaves to the planner: name -> candidate values
    reported: float  # tokens/s per GPU
    notes: list = field(default_factory=list)  # what the reading derived or assumed, shown per row
    held_out: bool = False  # split "test": never read by a fit, only reported


def row_kinds(row: Row) -> tuple[str, ...]:
    """What validation reports errors by: "moe" and/or "fp8", else "dense"."""
    kinds = (("moe",) if row.model.is_moe else ()) + (("fp8",) if row.runtime.fp8 else ())
    return kinds or ("dense",)


def number(r: dict, column: str, required: bool = False) -> float | None:
    """The row's value in `column` as a number, None when missing (Skip when required)."""
    raw = str(r.get(column) or "").strip()
    if raw.lower() in MISSING:
        if required:
            raise Skip(f"no {column}")
        return None
    m = re.match(r"^[~≈]?\s*([-+]?\d[\d,]*\.?\d*(?:e[-+]?\d+)?)", raw.lower())
    if not m:
        raise Skip(f"{column}={raw!r} is not a number")
    return float(m.group(1).replace(",", ""))


@overload
def integer(r: dict, column: str, required: Literal[True]) -> int: ...
@overload
def integer(r: dict, column: str, required: bool = False) -> int | None: ...
def integer(r: dict, column: str, required: bool = False) -> int | None:
    value = number(r, column, required)
    if value is None:
        return None
    if value != int(value) or value < 0:
        raise Skip(f"{column}={r.get(column)!r} is not a whole number")
    return int(value)


def text(r: dict, column: str) -> str:
    raw = str(r.get(column) or "").strip()
    return "" if raw.lower() in MISSING else raw


def read_runs(path: str | Path) -> tuple[list[Row], list[str]]:
    """(rows read, "row N skipped: <reason>" for the others)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            "--validate", str(path), "file not found", "give a CSV in the columns of tests/data/published_runs.csv"
        )
    records = _records(path)
    rows, skipped = [], []
    for i, r in enumerate(records, 1):
        label = text(r, "row_id") or str(i)
        try:
            rows.append(_row(r, label, records))
        except Skip as e:
            skipped.append(f"row {label} skipped: {e}")
        except (ConfigError, ValueError, ZeroDivisionError) as e:
            skipped.append(f"row {label} skipped: {e}")
    return rows, skipped


# The columns no row can be priced without (the others are optional or have a stated fallback).
REQUIRED_COLUMNS = ("model", "num_layers", "hidden", "heads", "seq_len", "gpu_type", "num_gpus")


def _records(path: Path) -> list[dict]:
    """The CSV's records, or one line: not text, no header with the required columns, or no rows."""
    way_out = "give a CSV in the columns of tests/data/published_runs.csv"
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            records = list(reader)
            columns = set(reader.fieldnames or ())
    except UnicodeDecodeError as e:
        raise ConfigError(
            "--validate", str(path), f"not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})", way_out
        ) from None
    except (OSError, csv.Error) as e:
        raise ConfigError("--validate", str(path), f"cannot be read as CSV ({e})", way_out) from None
    missing = [c for c in REQUIRED_COLUMNS if c not in columns]
    if missing:
        raise ConfigError("--validate", str(path), f"has no column {', '.join(missing)}", way_out)
    if not records:
        raise ConfigError("--validate", str(path), "holds no rows", way_out)
    return records


def _vocab(r: dict, notes: list) -> int:
    """The row's vocabulary; unstated, its family's (noted), else 1 token: the head's share ignored."""
    vocab = integer(r, "vocab")
    if vocab:
        return vocab
    name = text(r, "model").lower()
    family = next(((f, v) for f, v in FAMILY_VOCAB if f in name), None)
    if family:
        notes.append(f"vocab: unstated, {family[0]}'s {family[1]}")
        return family[1]
    notes.append("vocab: unstated, the head's share ignored")
    return 1


def _model(r: dict, notes: list) -> ModelConfig:
    hidden, heads = integer(r, "hidden", True), integer(r, "heads", True)
    layers, vocab = integer(r, "num_layers", True), _vocab(r, notes)
    if not hidden or not heads or not layers or hidden % heads:
        raise Skip(f"hidden={hidden}, heads={heads}, num_layers={layers}: not a transformer shape")
    kv = integer(r, "kv_heads") or heads
    described = f"{text(r, 'model')} {text(r, 'arch_notes')}".lower()
    gated = any(w in described for w in ("swiglu", "geglu", "gated", "silu")) or (
        "gelu" not in described and (kv < heads or any(n in described for n in GATED_NAMES))
    )
    ffn = integer(r, "ffn_hidden") or 4 * hidden
    if not gated:  # two GeLU matrices of width F = three SwiGLU matrices of width 2F/3
        ffn = max(64, round(2 * ffn / 3 / 64) * 64)
    experts = integer(r, "moe_experts") or 0
    moe: dict[str, Any] = {}
    if experts > 1:
        columns = [c for c in r if c and "dense" in c.lower() and ("layer" in c.lower() or "first" in c.lower())]
        dense = next((integer(r, c) for c in columns if integer(r, c) is not None), None)
        said = re.search(r"first (\d+) (?:layers? )?(?:are )?dense", described)
        moe = dict(
            n_experts=experts,
            top_k=integer(r, "moe_top_k") or 2,
            n_shared_experts=integer(r, "moe_shared_experts") or 0,
            moe_ffn_dim=integer(r, "moe_ffn_hidden") or ffn,
            n_dense_layers=dense if dense is not None else int(said.group(1)) if said else 0,
        )
    if kv > heads or heads % kv:
        raise Skip(f"kv_heads={kv} does not divide heads={heads}")
    if moe and moe["n_dense_layers"] >= layers:
        raise Skip(f"{moe['n_dense_layers']} first dense layers of {layers}: no MoE layer left")
    return ModelConfig(
        name=text(r, "model"),
        vocab_size=vocab,
        dim=hidden,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=kv,
        ffn_dim=ffn,
        **moe,
    )


def _cluster(r: dict) -> Cluster:
    gpus = integer(r, "num_gpus", True)
    per_node = integer(r, "gpus_per_node") or 8
    gpu = text(r, "gpu_type")
    if not gpu:
        raise Skip("no gpu_type")
    try:
        hw = hardware(gpu, number(r, "gpu_mem_GB"))
    except ConfigError as e:
        raise Skip(f"gpu_type={gpu!r}: {e.rule}") from None
    link = re.search(r"(\d+)\s*[x*×]\s*(\d+)\s*gb", text(r, "inter_node_link").lower().replace("gbps", "gb"))
    if link:  # N NICs of M Gb/s per node, shared by the node's GPUs
        from dataclasses import replace

        hw = replace(hw, network_gbps=int(link.group(1)) * int(link.group(2)) / 8 / per_node)
    return Cluster(hw, gpus, min(per_node, gpus))


SPLITS = {"": False, "fit": False, "test": True}  # the `split` column's values: held out?


def _row(r: dict, label: str, records: list[dict]) -> Row:
    notes: list[str] = []
    split = text(r, "split").lower()
    if split not in SPLITS:
        raise Skip(f"split={text(r, 'split')!r}: fit or test")
    model, cluster = _model(r, notes), _cluster(r)
    seq = integer(r, "seq_len", True)
    framework, remarks = text(r, "framework"), text(r, "notes")
    runtime = framework_runtime(framework, remarks, text(r, "precision"))
    fixed, open_ = _layout(r, model, cluster, runtime, notes)
    local = _local_batch(r, fixed)
    if local:  # sequences per data-parallel replica, split into pipeline micro-batches of the planner's size
        notes.append(f"local batch {local} per replica" + (" (the row's micro_batch)" if fixed["micro_batch"] else ""))
        fixed["micro_batch"] = None
    global_batch = _global_batch(r, records, fixed, notes) if not local or _stated_batch(r) else local * fixed["dp"]
    if local:
        open_["micro_batch"] = [b for b in (1, 2, 4, 8, 16) if local % b == 0]
    elif fixed.get("micro_batch") is None:
        fixed.pop("micro_batch", None)
        local = global_batch // max(1, fixed["dp"]) if global_batch else 8
        open_["micro_batch"] = [b for b in (1, 2, 4, 8) if local % b == 0] or [1]
    for name in [k for k in open_ if k in ("tp", "pp", "micro_batch", "checkpointing", "sp", "dp_replicate")]:
        notes.append(f"{name}: planner")
    return Row(
        label,
        text(r, "source_short"),
        model,
        cluster,
        runtime,
        seq,
        global_batch,
        fixed,
        open_,
        _reported(r, model, seq, global_batch, cluster),
        notes,
        SPLITS[split],
    )


def _local_batch(r: dict, fixed: dict) -> int | None:
    """Sequences per data-parallel replica and step, where the row states its batch that way: a
    `local_batch` column, or under a pipeline a micro_batch its notes call the local batch, or
    torchtitan's (its local batch size is split into pipeline micro-batches)."""
    local = integer(r, "local_batch")
    said = "local batch" in text(r, "notes").lower() or "torchtitan" in text(r, "framework").lower()
    if not local and fixed["pp"] > 1 and said:
        local = fixed["micro_batch"]
    return local or None


def _stated_batch(r: dict) -> bool:
    return bool(integer(r, "global_batch_seqs") or integer(r, "global_batch_tokens"))


def _layout(r: dict, model: ModelConfig, cluster: Cluster, runtime: Runtime, notes: list) -> tuple[dict, dict]:
    gpus = cluster.gpus
    tp, pp, cp = integer(r, "tp"), integer(r, "pp"), integer(r, "cp") or 1
    ep, etp = integer(r, "ep") or 1, integer(r, "etp")
    open_: dict = {}
    dp = integer(r, "dp")
    if tp is None and dp and gpus % (dp * cp * (pp or 1)) == 0:  # what the GPUs leave for tp
        tp = gpus // (dp * cp * (pp or 1))
        notes.append(f"tp {tp} = gpus/(dp*pp*cp) (unstated)")
    if tp is None:
        open_["tp"] = [
            t
            for t in (1, 2, 4, 8)
            if t <= cluster.gpus_per_node and model.n_heads % t == 0 and gpus % (t * cp * (pp or 1)) == 0
        ] or [1]
    if pp is None:
        open_["pp"] = [1]
    fixed: dict[str, Any] = {"tp": tp or 1, "pp": pp or 1, "cp": cp, "ep": ep}
    model_parallel = fixed["tp"] * fixed["pp"] * cp
    if gpus % model_parallel:
        raise Skip(f"num_gpus={gpus} is not a multiple of tp*pp*cp={model_parallel}")
    fixed["dp"] = gpus // model_parallel
    if tp is not None and etp is not None and etp != tp:
        fixed["etp"] = etp
    elif ep > 1 and (fixed["dp"] * cp) % ep and fixed["tp"] > 1:  # wider than dp*cp: folded over tp
        fixed["etp"] = 1
        notes.append(f"ep{ep} > dp*cp: experts folded over tp (etp 1)")
    if dp is not None and dp != fixed["dp"] and "tp" not in open_:
        notes.append(f"dp {dp} -> {fixed['dp']} (gpus/(tp*pp*cp))")
    remarks = f"{text(r, 'framework')} {text(r, 'notes')}"
    sp = text(r, "sp").lower()
    if sp in ("yes", "no", "true", "false", "on", "off"):
        fixed["sp"] = sp in ("yes", "true", "on") and fixed["tp"] > 1
    elif "--tp-comm-overlap" in remarks or "--sequence-parallel" in remarks:
        fixed["sp"] = fixed["tp"] > 1
    elif fixed["tp"] > 1 or "tp" in open_:
        open_["sp"] = [False, True]
    _schedule(r, model, fixed, open_, runtime, notes)
    stated = zero_stage(text(r, "zero_or_fsdp"))
    zero = (
        stated
        if stated is not None
        else (
            1
            if "--overlap-param-gather" in remarks or "--use-distributed-optimizer" in remarks
            else 3
            if runtime.name == "fsdp"
            else 0
        )
    )
    fixed["zero"] = zero
    shard = integer(r, "dp_shard")
    if shard and zero and fixed["dp"] % shard == 0:
        fixed["dp_replicate"] = fixed["dp"] // shard
    elif zero and re.search(r"hybrid|hsdp", text(r, "zero_or_fsdp").lower()):
        node_shard = max(1, cluster.gpus_per_node // (fixed["tp"] * cp))
        open_["dp_replicate"] = sorted({1, max(1, fixed["dp"] // node_shard)})
    recompute = text(r, "act_recompute").lower()
    kind = next((c for c in ("full", "selective") if recompute.startswith(c)), None)
    if kind:
        fixed["checkpointing"] = kind
    elif recompute in ("no", "none", "false", "off", "disabled"):
        fixed["checkpointing"] = "none"
    else:  # unsaid, or partial ("every n-th block"): the planner's choice
        open_["checkpointing"] = ["none", "selective", "full"]
    fixed["micro_batch"] = integer(r, "micro_batch")
    return fixed, open_


def _schedule(r: dict, model: ModelConfig, fixed: dict, open_: dict, runtime: Runtime, notes: list) -> None:
    """The row's schedule; unsaid, Megatron's default (1F1B without virtual stages), else the planner's.
    More virtual stages than layers (Megatron's stages holding only the embedding or the loss): the
    most that hold a layer each, noted."""
    pp = fixed["pp"]
    if pp == 1 and "pp" not in open_:
        return
    schedule, vpp = text(r, "pp_schedule").lower(), integer(r, "vpp")
    if pp > model.n_layers:
        raise Skip(f"pp={pp} > num_layers={model.n_layers}")
    if pp > 1 and ("interleaved" in schedule or (vpp or 1) > 1):
        virtual = min(vpp or 2, model.n_layers // pp)
        if virtual != (vpp or 2):
            notes.append(f"vpp {vpp or 2} -> {virtual}: {pp * (vpp or 2)} stages, {model.n_layers} layers")
        fixed.update(pp_schedule="interleaved-1f1b" if virtual > 1 else "1f1b", pp_virtual=virtual)
    elif pp > 1 and ("1f1b" in schedule or runtime.name.startswith("megatron")):
        fixed.update(pp_schedule="1f1b", pp_virtual=1)
    elif pp > 1:
        open_["pp_schedule"] = [("1f1b", 1)] + [
            ("interleaved-1f1b", v) for v in (2, 3, 4) if model.n_layers % (pp * v) == 0
        ]


def _global_batch(r: dict, records: list[dict], fixed: dict, notes: list) -> int | None:
    seq = integer(r, "seq_len", True)
    stated = integer(r, "global_batch_seqs")
    tokens = integer(r, "global_batch_tokens")
    micro, accum = integer(r, "micro_batch"), integer(r, "grad_accum")
    if stated:
        return stated
    if tokens and tokens >= seq:
        return tokens // seq
    if micro and accum:
        return micro * accum * fixed["dp"]
    for other in records:  # a sibling row of the same source and model that states it
        if (
            other is not r
            and text(other, "source_short") == text(r, "source_short")
            and text(other, "model") == text(r, "model")
        ):
            try:
                theirs, their_dp = integer(other, "global_batch_seqs"), integer(other, "dp")
            except Skip:
                continue
            if theirs and their_dp:
                notes.append(f"global batch from row {text(other, 'row_id')}")
                return theirs // their_dp * fixed["dp"]
    if fixed["pp"] == 1 and not micro:
        notes.append("batch: one micro-batch per rank, its size the planner's")
        return None
    notes.append("global batch: 4 x pp micro-batches per rank (unstated)")
    return fixed["dp"] * (micro or 1) * (4 * fixed["pp"] if fixed["pp"] > 1 else 1)


def _reported(r: dict, model: ModelConfig, seq: int, global_batch: int | None, cluster: Cluster) -> float:
    for column in ("tokens_per_s_per_gpu", "derived_tokens_per_s_per_gpu"):
        value = number(r, column)
        if value:
            return value
    step = number(r, "step_time_s")
    if step and global_batch:
        return global_batch * seq / step / cluster.gpus
    per_token = flops_per_token(model, seq)
    tflops = number(r, "tflops_per_gpu")
    if tflops:
        return tflops * 1e12 / per_token
    mfu = number(r, "mfu_pct")
    if mfu:
        peak = number(r, "peak_dense_tflops_assumed") or cluster.hardware.peak_tflops
        return mfu / 100 * peak * 1e12 / per_token
    raise Skip("no throughput (tokens/s, step time, TFLOP/s or MFU)")
