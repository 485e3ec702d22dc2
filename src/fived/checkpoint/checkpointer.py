"""Checkpoints: save any layout, resume exactly, reshard to any other layout.

A checkpoint is a directory `<output_dir>/checkpoints/step-<N>/` (N = steps completed):
  *.distcp, .metadata   every component's tensors, written by DCP in layout-independent form
                        (canonical names, whole shapes; see fived.layout.placement and fived.checkpoint.dcp_io)
  fived.json            the manifest: format, step, the resolved config, the layout and world size
                        that wrote it, fived and torch versions, each component's JSON state
  COMPLETE              written last, before the directory gets its name

Atomic: DCP writes into `.tmp-step-<N>`; when every rank's data and DCP's metadata are written,
each rank digests its own files and sends the digests to rank 0 (fived.checkpoint.verify), which
writes the manifest and the marker (each fsynced) and renames the directory to `step-<N>`.
A crash or SIGKILL at any point leaves the previous checkpoints as they were; only directories with
the marker are ever loaded. `keep` deletes older complete checkpoints only after a newer one is
complete (renamed away first, then removed), so the newest complete one is never deleted.

Asynchronous saves (`checkpoint.async`): training waits while each rank copies the boxes it writes;
DCP writes the copies from a background thread over a process group of its own (gloo), and rank 0
finalises when they are all written. A new save first waits for the previous one.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fived.checkpoint import dcp_io
from fived.checkpoint.verify import FORMAT, MANIFEST, MARKER, cached_damage, file_digests
from fived.config import CheckpointConfig, Config, ConfigError
from fived.files import claim_run_dir
from fived.version import __version__
from fived.write_errors import WriteFailed, os_error_in


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def complete_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, directory) of every complete checkpoint of a run, oldest first."""
    found = []
    root = checkpoints_dir(run_dir)
    for path in root.glob("step-*") if root.is_dir() else []:
        step = path.name[len("step-") :]
        if step.isdigit() and (path / MARKER).is_file() and (path / MANIFEST).is_file():
            found.append((int(step), path))
    return sorted(found)


_WARNED: set = set()  # (checkpoint, problem) already reported by this process


def newest_intact(run_dir: Path) -> Path | None:
    """The newest intact checkpoint of a run, silently."""
    return next((c for _, c in reversed(complete_checkpoints(run_dir)) if cached_damage(c) is None), None)


def find_checkpoint(path: str | Path, flag: str = "checkpoint", crc: bool = True) -> Path | None:
    """A checkpoint directory as given, or the newest intact checkpoint of a run directory (each
    damaged newer one skipped with one line on stderr; see fived.checkpoint.verify). A damaged
    checkpoint named explicitly is refused in one line naming the damaged file and the intact
    alternative: falling back is not what was asked for. `crc=False`: no file is read whole (a
    provisional choice that another process's full check replaces; see fived.launch.training_run)."""
    path = Path(path)
    if (path / MARKER).is_file():
        problem = cached_damage(path, crc)
        if problem is None:
            return path
        intact = newest_intact(path.parent.parent) if path.parent.name == "checkpoints" else None
        raise ConfigError(
            flag,
            str(path),
            f"damaged: {problem}",
            f"use the intact {intact}" if intact else "no intact checkpoint of this run is left",
        )
    found = complete_checkpoints(path)
    for i, (step, checkpoint) in reversed(list(enumerate(found))):
        problem = cached_damage(checkpoint, crc)
        if problem is None:
            return checkpoint
        if os.environ.get("RANK", "0") == "0" and (checkpoint, problem) not in _WARNED:  # (once; one rank)
            _WARNED.add((checkpoint, problem))
            print(
                f"fived: warning: checkpoint step-{step} is damaged ({problem}); "
                f"{'using an older one' if i else 'no older checkpoint is left'}",
                file=sys.stderr,
                flush=True,
            )
    return None


def no_intact_checkpoint(run_dir: str | Path, flag: str, value: str, crc: bool = True) -> ConfigError | None:
    """When a run directory holds complete checkpoints but none intact (find_checkpoint gave None):
    the one-line refusal naming the newest's damage (None if it holds no complete checkpoint at all).
    Starting over beside them, or saying there is none, would hide the damage."""
    found = complete_checkpoints(run_dir)
    if not found:
        return None
    step, newest = found[-1]
    return ConfigError(
        flag,
        value,
        f"{run_dir} holds {len(found)} checkpoint(s) but no intact one: the newest, "
        f"step-{step}, is damaged ({cached_damage(newest, crc)})",
        f"move or remove {Path(run_dir) / 'checkpoints'}, or use another --train.output_dir",
    )


def read_manifest(checkpoint: str | Path) -> dict:
    with open(Path(checkpoint) / MANIFEST) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{checkpoint}: not a {FORMAT} checkpoint")
    return manifest


def saved_config(checkpoint: str | Path, flag: str) -> tuple[dict, Config]:
    """(manifest, the resolved config it records) of a complete checkpoint, or a one-line refusal
    naming the flag that pointed at it."""
    from fived.config import config_from_dict

    try:
        manifest = read_manifest(checkpoint)
        return manifest, config_from_dict(manifest["config"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            flag, str(checkpoint), f"unreadable manifest ({e})", "use another checkpoint of the run"
        ) from None


def check_model_shapes(cfg: Config, checkpoint: str | Path) -> None:
    """Refuse, in one line, a checkpoint whose model does not have the config's shapes."""
    from fived.model.transformer import build_model, canonical_name

    try:
        saved = dcp_io.tensor_shapes(checkpoint)
    except dcp_io.CheckpointError as e:
        raise ConfigError("checkpoint", str(checkpoint), str(e), "resume from another checkpoint") from None
    model = build_model(cfg.model)
    tensors = [*model.named_parameters(), *model.named_buffers()]
    for name, tensor in ((canonical_name(n), t) for n, t in tensors):
        have = saved.get(f"model.{name}")
        if have != tuple(tensor.shape):
            found = "is missing" if have is None else f"has shape {list(have)}"
            raise ConfigError(
                "checkpoint",
                str(checkpoint),
                f"parameter {name} {found} in the checkpoint, the config's model needs {list(tensor.shape)}",
                "use the model config it was saved with",
            )
    extra = sorted(k for k in saved if k.startswith("model.") and k[len("model.") :] not in dict(tensors))
    if extra:
        raise ConfigError(
            "checkpoint",
            str(checkpoint),
            f"parameter {extra[0][len('model.') :]} is in the checkpoint but not in the config's model",
            "use the model config it was saved with",
        )


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _discard(path: Path) -> None:
    """Make a directory disappear at once (rename), then delete it."""
    trash = path.with_name(f".trash-{path.name}-{os.getpid()}-{time.monotonic_ns()}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


class FinalSaveSkipped(RuntimeError):
    """A run ended without its final checkpoint (no room): the run must not end as a success."""

    def summary(self) -> dict:
        return {"kind": "write_failed", "line": str(self)}


class Checkpointer:
    """Saves and loads the named components of a run (see fived.training.state) on every rank."""

    # The checkpoint group's collectives wait for the slowest rank's writes: at least this long.
    MIN_TIMEOUT_S = 1800.0

    def __init__(
        self,
        run_dir: str | Path,
        settings: CheckpointConfig,
        components: dict,
        manifest: dict,
        timeout_s: float = 600.0,
    ):
        self.root, self.settings, self.components = checkpoints_dir(run_dir), settings, components
        self.manifest = {"format": FORMAT, "fived_version": __version__, "torch_version": torch.__version__, **manifest}
        self.rank = dist.get_rank()
        # Its own gloo group: a background save's collectives must not interleave with training's,
        # and DCP coordinates over CPU tensors whatever the training backend.
        self.timeout_s = max(timeout_s, self.MIN_TIMEOUT_S)
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
        self.pending: Any = None  # the Future of a background save
        self.stager = dcp_io.Stager()  # (keeps its copies between background saves)
        self.finalized = threading.Event()  # a background save's digests are sent (rank 0: it is in place)
        self.failure: BaseException | None = None
        self.last_step: int | None = None
        self.origin: Path | None = None  # the checkpoint this launch resumed from (never pruned by it)
        if self.rank == 0:
            claim_run_dir(run_dir)  # (fived's run directory before anything is made in it)
            self.root.mkdir(exist_ok=True)
            for stale in [*self.root.glob(".tmp-step-*"), *self.root.glob(".trash-*")]:  # crashed saves
                shutil.rmtree(stale, ignore_errors=True)
        dist.barrier(group=self.group)

    def due(self, step: int) -> bool:
        return self.settings.every > 0 and step % self.settings.every == 0

    def tensors(self) -> dict:
        return {
            f"{name}.{key}": value
            for name, comp in self.components.items()
            for key, value in comp.tensors(for_load=False).items()
        }

    def prepare_background(self) -> None:
        """Allocate (and touch) the background saves' staging copies now, once, instead of during the
        first background save: then every background save stalls training for one memory copy."""
        self.wait()
        self.stager.stage(self.tensors())

    def save(self, step: int, background: bool = False, replace: bool = False) -> bool:
        """Save the state after `step` completed steps (every rank calls this); skipped (False), with
        one warning line, when the filesystem lacks room for it. An existing checkpoint of the same
        step is set aside (kept), or with `replace` deleted once the new one is in place."""
        self.wait()
        tensors = self.tensors()
        if not self._room_for(tensors, step):
            return False
        manifest = {
            **self.manifest,
            "step": step,
            "saved_at": time.time(),
            "components": {name: comp.state() for name, comp in self.components.items()},
        }
        tmp = self.root / f".tmp-step-{step}"
        self.last_step = step
        if not background:
            try:
                dcp_io.save(tensors, tmp, self.group)
                files = self._gathered_digests(tmp, True)
                if self.rank == 0:
                    assert files is not None  # (rank 0 gathers every rank's digests of a written save)
                    self._finalize(tmp, step, manifest, files, replace)
            except Exception as e:
                self._refused_write(e, tmp, step)
                raise
            return True
        self.finalized.clear()
        self.pending = pending = dcp_io.save(tensors, tmp, self.group, stager=self.stager)
        # (on rank 0, DCP's coordinator, the future completes after every rank's data is written)
        pending.add_done_callback(lambda fut: self._finalize_after(fut, tmp, step, manifest))
        return True

    def final_save_skipped(self, step: int) -> FinalSaveSkipped:
        """The error of a run whose final save found no room: the newest safe checkpoint, and how on."""
        newest = newest_intact(self.root.parent)
        return FinalSaveSkipped(
            f"the final checkpoint (step {step}) could not be written (no room: the warning above); "
            + (f"the newest safe checkpoint is {newest}" if newest else "no checkpoint of this run is saved")
            + f"; free some space, then continue with: fived train --resume {self.root.parent}"
        )

    def _room_for(self, tensors: dict, step: int) -> bool:
        """Whether every rank sees room for the whole save (all ranks' bytes, with 5% to spare) on
        the checkpoint filesystem. Every rank asks, so all save or none."""
        mine = sum(view.numel() * view.element_size() for v in tensors.values() if v.write for _, view in v.boxes)
        total = torch.tensor([float(mine)], dtype=torch.float64)
        dist.all_reduce(total, group=self.group)
        need = int(total.item() * 1.05) + 2**20
        free = shutil.disk_usage(self.root).free
        short = torch.tensor([1.0 if free < need else 0.0])
        dist.all_reduce(short, op=dist.ReduceOp.MAX, group=self.group)
        if short.item() and self.rank == 0:
            print(
                f"\nfived train: warning: checkpoint of step {step} skipped: {self.root} has {free / 2**20:.1f} "
                f"MiB free, the save needs {need / 2**20:.1f} MiB; training goes on and the next save tries "
                "again",
                file=sys.stderr,
                flush=True,
            )
        return not short.item()

    def _refused_write(self, error: BaseException, tmp: Path, step: int) -> None:
        """A save the filesystem refused: its partial directory goes (rank 0) and the error becomes
        one line naming the path and the cause."""
        refused = os_error_in(error)
        if refused is None:
            return
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise WriteFailed(f"checkpoint save of step {step}", refused, tmp) from error

    def _gathered_digests(self, tmp: Path, written: bool) -> dict | None:
        """Every rank: digest the files this rank wrote (not every rank's on rank 0, which would hold
        the others waiting in their next collectives for as long as it reads a whole checkpoint);
        rank 0 gets them all, or raises the first rank's read error. None elsewhere, and on rank 0
        when a rank's write failed (`written` False there)."""
        mine: dict | OSError | None
        try:
            mine = file_digests(tmp, dist.get_rank(self.group)) if written else None
        except OSError as e:
            mine = e
        found: list = [None] * dist.get_world_size(self.group) if self.rank == 0 else []
        dist.gather_object(mine, found, dst=0, group=self.group)
        if self.rank != 0:
            return None
        errors = [d for d in found if isinstance(d, BaseException)]
        if errors:
            raise errors[0]
        if any(d is None for d in found):
            return None
        return {name: digest for d in found for name, digest in d.items()}

    def _finalize_after(self, future, tmp: Path, step: int, manifest: dict) -> None:
        """Every rank, when its background save's future completes (on DCP's thread, or at once if it
        already has): digests gathered, and rank 0 finalises. The next wait() reports a failure."""
        try:
            written = True
            try:
                future.result()
            except BaseException as e:
                self.failure, written = e, False
            files = self._gathered_digests(tmp, written)  # (every rank, so the collective is matched)
            if self.rank == 0 and written:
                if files is None:
                    raise RuntimeError(f"checkpoint save of step {step} failed on another rank")
                self._finalize(tmp, step, manifest, files)
        except BaseException as e:  # reported by the next wait(), on the training thread
            self.failure = self.failure or e
        finally:
            self.finalized.set()

    def _finalize(self, tmp: Path, step: int, manifest: dict, files: dict, replace: bool = False) -> None:
        manifest = {**manifest, "files": files}  # (what a load verifies first)
        _fsync_write(tmp / MANIFEST, json.dumps(manifest, indent=1) + "\n")
        _fsync_write(tmp / MARKER, f"step {step}\n")
        _fsync_dir(tmp)
        final = self.root / f"step-{step}"
        aside = None
        if final.exists():  # the same step saved again: the older copy is kept aside, not lost
            aside = self._set_aside(final)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        if replace and aside is not None:  # (only now: a crash before this leaves it aside, kept)
            _discard(aside)
            if not any(aside.parent.iterdir()):
                aside.parent.rmdir()
        self._prune(newest=step)

    def _set_aside(self, path: Path, why: str = "superseded") -> Path:
        stamp, n = f"{why}-{time.strftime('%Y%m%d-%H%M%S')}", 0
        aside = self.root / stamp
        while (aside / path.name).exists():  # (the same step set aside twice within a second)
            n += 1
            aside = self.root / f"{stamp}-{n}"
        aside.mkdir(exist_ok=True)
        os.rename(path, aside / path.name)
        return aside / path.name

    def supersede_after(self, step: int, why: str = "superseded") -> None:
        """Rank 0, when a run continues from the checkpoint of `step`: complete checkpoints of later
        steps belong to the history being replaced (or diverged: `why`); they are set aside in
        `<why>-<time>/` (kept, never loaded or pruned)."""
        for later, path in complete_checkpoints(self.root.parent):
            if later > step:
                self._set_aside(path, why)

    def _prune(self, newest: int) -> None:
        """Keep the newest `keep` checkpoints known healthy, and the one of step `newest`: a
        checkpoint is known healthy once the step after it passed the divergence guard (see
        fived.training.divergence), so the one just written is not yet and counts as one more. The
        checkpoint this launch resumed from is kept too: a loss-based guard
        passes weights a bad setting broke into a uniform guess (docs/robustness.md, case 55), and the
        launch's starting point is then the newest checkpoint known to hold weights of a healthy run."""
        if self.settings.keep <= 0:
            return
        confirmed = [path for step, path in complete_checkpoints(self.root.parent) if step < newest]
        for path in confirmed[: -self.settings.keep]:
            if path.resolve() != self.origin:
                _discard(path)

    def wait(self) -> None:
        """Block until a background save is written (and, on rank 0, finalised)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self.finalized.wait()  # (a done-callback may still run after result() returns)
            try:
                pending.result()
            except BaseException as e:
                self.failure = self.failure or e
        if self.failure is not None:
            failure, self.failure = self.failure, None
            self._refused_write(failure, self.root / f".tmp-step-{self.last_step}", self.last_step or 0)
            raise RuntimeError(f"checkpoint save failed: {failure}") from failure

    def close(self) -> None:
        """Destroy the checkpoint group (the run is over). A background save still writing keeps it
        (its thread uses it; a run that failed mid-save must not wait out the group's timeout)."""
        if self.group is not None and (self.pending is None or self.pending.done()):
            group, self.group = self.group, None
            dist.destroy_process_group(group)

    def load(self, checkpoint: str | Path) -> dict:
        """Fill every component from `checkpoint` (written by any layout); returns its manifest."""
        manifest = read_manifest(checkpoint)
        tensors = {
            f"{name}.{key}": value
            for name, comp in self.components.items()
            for key, value in comp.tensors(for_load=True).items()
        }
        dcp_io.load(tensors, checkpoint, self.group)
        for name, comp in self.components.items():
            comp.load_state(manifest["components"].get(name, {}))
        return manifest
