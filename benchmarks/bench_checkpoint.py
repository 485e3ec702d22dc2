"""Time fived's checkpoints against torch.save / torch.load of the same state in one process.

A model of >= 300M parameters (default: dim 1024, 20 layers, vocab 32000: 322M) on 4 CPU ranks, in two
sharded layouts: ZeRO-3 over dp=4, and tp=2 x pp=2. Each rank builds its shards (initialised as in
training) and AdamW's two moments, then, per layout:

  save (sync)    `Checkpointer.save`: every rank writes its shards with DCP, fsynced, then rank 0
                 finalises (manifest, marker, rename)
  save (async)   `Checkpointer.save(background=True)`: the time training is stalled (each rank copies
                 the boxes it writes into staging memory, allocated once beforehand as the trainer
                 does after its first step; that allocation's time is shown too), and the time
                 until the checkpoint is complete
  load           `Checkpointer.load` of that checkpoint into the same layout

Times are the slowest rank's (after a barrier). The peer writes the same bytes (the whole model and
both moments, float32) with torch.save to one file (flushed and fsynced, as DCP does) and reads them
back with torch.load(weights_only=True), in this process. The last lines are the ratios.

    python benchmarks/bench_checkpoint.py                  # 322M parameters, ~20 GB written in all
    python benchmarks/bench_checkpoint.py --layers 4       # quicker, 100M parameters
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist

from fived.config import build_config
from fived.launch.ranks import run_ranks
from fived.model.transformer import build_model

LAYOUTS = {
    "ZeRO-3 dp4": {"parallel.dp": 4, "parallel.zero": 3},
    "tp2 x pp2": {"parallel.tp": 2, "parallel.pp": 2, "train.microbatches": 2},
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary directory)")
    return p.parse_args()


def config(args, layout: dict, run_dir: str):
    over = {
        "model.name": "tiny",
        "model.dim": args.dim,
        "model.n_layers": args.layers,
        "model.n_heads": 16,
        "model.n_kv_heads": 16,
        "model.ffn_dim": args.dim * 11 // 4,
        "model.vocab_size": args.vocab,
        "train.seq_len": 16,
        "train.global_batch": 4,
        "train.output_dir": run_dir,
        "train.device": "cpu",
        "checkpoint.keep": 0,
        **layout,
    }
    return build_config(overrides=over)


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def measure_rank(cfg) -> dict:
    """On each rank: build the trainer's shards and Adam state, then save / async save / load."""
    from fived.checkpoint.checkpointer import find_checkpoint
    from fived.training.trainer import Trainer

    trainer = Trainer(cfg)
    trainer.checkpointer.components["optimizer"].tensors(for_load=True)  # AdamW's moments, allocated
    trainer.sampler.step = 1
    ckpt = trainer.checkpointer
    out = {"sync_save": _timed(lambda: ckpt.save(1))}
    # as the trainer does after its first step: the staging copies allocated once, before any save
    out["prepare"] = _timed(ckpt.prepare_background)
    for step, key in ((2, "async_first"), (3, "async")):
        dist.barrier()
        start = time.perf_counter()
        ckpt.save(step, background=True)
        out[f"{key}_stall"] = time.perf_counter() - start
        ckpt.wait()
        dist.barrier()
        out[f"{key}_total"] = time.perf_counter() - start
    out["load"] = _timed(lambda: ckpt.load(find_checkpoint(cfg.train.output_dir)))
    return out


def checkpoint_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def torch_peer(cfg, root: str) -> dict:
    """The same bytes through torch.save / torch.load in one process."""
    state = {}
    for name, p in build_model(cfg.model).named_parameters():
        for key in ("", ".exp_avg", ".exp_avg_sq"):
            state[name + key] = torch.full(p.shape, 0.5)
    path = os.path.join(root, "torch_state.pt")
    start = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    saved = time.perf_counter() - start
    del state
    start = time.perf_counter()
    loaded = torch.load(path, weights_only=True)
    load = time.perf_counter() - start
    size = os.path.getsize(path)
    del loaded
    os.remove(path)
    return {"save": saved, "load": load, "bytes": size}


def main() -> None:
    args = parse_args()
    root = tempfile.mkdtemp(prefix="fived-bench-ckpt-", dir=args.dir)
    try:
        cfg = config(args, {}, root)
        n = sum(p.numel() for p in build_model(cfg.model).parameters())
        print(
            f"model: {n / 1e6:.0f}M parameters; state saved = parameters + 2 AdamW moments, float32 "
            f"({3 * n * 4 / 1e9:.2f} GB); 4 CPU ranks (gloo), one thread each"
        )
        peer = torch_peer(cfg, root)
        gb = peer["bytes"] / 1e9
        print(f"torch.save (1 process, fsynced):   {peer['save']:7.2f} s  {gb / peer['save']:6.2f} GB/s")
        print(f"torch.load (weights_only):         {peer['load']:7.2f} s  {gb / peer['load']:6.2f} GB/s")
        rows = {}
        for name, layout in LAYOUTS.items():
            run_dir = os.path.join(root, name.replace(" ", ""))
            times = run_ranks(4, measure_rank, config(args, layout, run_dir), device="cpu")
            worst = {k: max(t[k] for t in times) for k in times[0]}
            size = checkpoint_bytes(os.path.join(run_dir, "checkpoints", "step-1")) / 1e9
            rows[name] = worst
            print(f"{name}: checkpoint {size:.2f} GB")
            print(f"  save (sync)          {worst['sync_save']:7.2f} s  {size / worst['sync_save']:6.2f} GB/s")
            print(
                f"  save (async): stall  {worst['async_stall']:7.2f} s   complete after {worst['async_total']:.2f} s "
                f"(first background save: stall {worst['async_first_stall']:.2f} s; its copies allocated after the "
                f"first training step: {worst['prepare']:.2f} s)"
            )
            print(f"  load                 {worst['load']:7.2f} s  {size / worst['load']:6.2f} GB/s")
            shutil.rmtree(run_dir, ignore_errors=True)
        for name, w in rows.items():
            print(
                f"{name}: save fived/torch.save {w['sync_save'] / peer['save']:.2f}x, "
                f"load fived/torch.load {w['load'] / peer['load']:.2f}x, "
                f"async stall / sync save {w['async_stall'] / w['sync_save']:.2f} "
                f"(first background save {w['async_first_stall'] / w['sync_save']:.2f})"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
