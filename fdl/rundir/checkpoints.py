"""Checkpoints: what a crashed or stopped run needs to go on, written so a crash at any moment
leaves the previous checkpoint usable.

``<run_dir>/checkpoints/ckpt-r<round>/`` holds:

* ``model.pt``   — the consensus ``state_dict`` (taken right after an averaging, so every rank
  holds the same one; rank 0 writes it);
* ``rank<r>.pt`` — rank r's optimizer state, RNG states, slowdown-emulation mean and the
  epoch's loss sums so far (each rank writes its own);
* ``engine.json`` — the plan state (round, epoch, stream position, anchor and its history,
  per-rank speed estimates), the epoch history and the world size;
* ``manifest.json`` — written last: size and SHA-256 of every file above.

Every rank writes into ``checkpoints/.tmp-ckpt-r<round>/``; after a barrier rank 0 writes the
manifest and renames the directory into place, then removes all but the newest
:data:`KEEP` checkpoints. A directory without a manifest, with a manifest that does not list
exactly what a checkpoint holds, or whose files do not match it, is not a checkpoint:
:func:`latest_checkpoint` skips it (saying why) and takes the one before. The directory is
assumed visible to every rank (one node, or a shared filesystem).

Nothing read back can run code: every ``.pt`` file is loaded with ``torch.load(...,
weights_only=True)`` (tensors and plain containers only; optimizer state dicts, torch's RNG
state and ``random.getstate()`` are such data). Matching the manifest proves a file is the one
written, not that it is safe: the workers also try-load every file of a candidate before using
it (:func:`load_file`, fdl.engine.recovery) and skip one that does not load.

When (``checkpoint_every``): ``"N"`` = at the end of every N-th epoch; ``"<seconds>s"`` = at the
first point at least that long after the previous checkpoint (or the start) where every rank
holds the same model: an epoch end, or within an epoch a round that ended with a blocking
average (cadence: every round; async makes the round blocking when a checkpoint is due; sync
averages its buffers only at epoch ends) — decided on the ranks' mean clock, carried in the
round reports, so every rank agrees (see fdl.engine.recovery). A crash loses at most the work
since the last checkpoint.

torch is imported inside the functions that save and load: the launcher uses
:func:`latest_checkpoint` (JSON and hashes only) to check ``fdl run --resume`` before it starts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zipfile
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fdl import readback
from fdl.files import atomic_replace, sha256_file, write_atomic

DIRNAME = "checkpoints"
KEEP = 2
MANIFEST = "manifest.json"
ENGINE_FILE = "engine.json"  # the plan state (fdl.engine.plan.PlanState.to_dict) and history
MODEL_FILE = "model.pt"
_FILE_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # a file in the checkpoint's own directory


class UnloadableFile(Exception):
    """A checkpoint file that does not load as data (:func:`load_file`); the message says why."""


@dataclass(frozen=True)
class CheckpointEvery:
    """Parsed ``checkpoint_every``: exactly one of ``epochs`` and ``seconds`` is set."""

    epochs: int | None = None
    seconds: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> CheckpointEvery | None:
        if not text:
            return None
        if text.endswith("s"):
            return cls(seconds=float(text[:-1]))
        return cls(epochs=int(text))

    def due(self, *, epochs_done: int, elapsed_s: float) -> bool:
        """Whether the epoch end after ``epochs_done`` epochs takes a checkpoint."""
        if self.epochs is not None:
            return epochs_done % self.epochs == 0
        assert self.seconds is not None
        return elapsed_s >= self.seconds


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    manifest: dict[str, Any]

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def world_size(self) -> int:
        return int(self.manifest["world_size"])

    def engine_state(self) -> dict[str, Any]:
        return readback.read_json(self.path / ENGINE_FILE, limit=readback.DOCUMENT_BYTES)


def checkpoint_name(round_index: int) -> str:
    return f"ckpt-r{round_index:08d}"


def file_digest(path: Path) -> dict[str, Any]:
    """A file's entry in the manifest: its size and SHA-256."""
    return {"size": path.stat().st_size, "sha256": sha256_file(path)}


def write_checkpoint(run_dir: Path, *, round_index: int, rank: int, world_size: int,
                     model_state: dict[str, Any] | None, rank_state: dict[str, Any],
                     engine_state: dict[str, Any],
                     gather: Callable[[Any], list[Any]],
                     away: Collection[int] = (),
                     to_rank0: Callable[[Any], list[Any] | None] | None = None) -> Path:
    """Write one checkpoint; every rank calls it at the same point.

    ``gather(obj)`` returns every rank's ``obj`` in rank order (an all-gather; it doubles as
    the barrier). ``model_state`` and ``engine_state`` are used on rank 0 only. ``away``: the
    ranks on another node than rank 0's, which cannot write to its disk: they hand their state
    to rank 0 through ``to_rank0(obj)`` (a gather to rank 0: its list, None elsewhere), which
    writes their files, so the checkpoint on rank 0's node is complete; they write nothing.
    """
    import torch

    root = run_dir / DIRNAME
    name = checkpoint_name(round_index)
    staging = root / f".tmp-{name}"
    files = {}
    if rank not in away:
        staging.mkdir(parents=True, exist_ok=True)
        files[f"rank{rank}.pt"] = _save(torch, rank_state, staging / f"rank{rank}.pt")
    if away:
        assert to_rank0 is not None, "ranks away from rank 0 need to_rank0"
        carried = to_rank0(rank_state if rank in away else None)
        if rank == 0:
            assert carried is not None
            for other in sorted(away):
                files[f"rank{other}.pt"] = _save(torch, carried[other],
                                                 staging / f"rank{other}.pt")
    if rank == 0:
        assert model_state is not None
        files[MODEL_FILE] = _save(torch, model_state, staging / MODEL_FILE)
        write_atomic(staging / ENGINE_FILE, json.dumps(engine_state, indent=1), durable=True)
        files[ENGINE_FILE] = file_digest(staging / ENGINE_FILE)
    every = gather(files)
    final = root / name
    if rank == 0:
        manifest = {"schema": 1, "name": name, "round": round_index, "world_size": world_size,
                    "epoch": engine_state.get("epoch"),
                    "files": {k: v for part in every for k, v in part.items()}}
        write_atomic(staging / MANIFEST, json.dumps(manifest, indent=1), durable=True)
        if final.is_symlink():  # planted: fdl makes no link; remove it, never its target
            final.unlink()
        elif final.exists():  # a crashed attempt got this far before: replace it
            shutil.rmtree(final)
        os.replace(staging, final)
        _prune(root, keep=KEEP)
    gather(None)  # nobody goes on (or reports the checkpoint) before it is in place
    return final


def _save(torch: Any, obj: Any, path: Path) -> dict[str, Any]:
    with atomic_replace(path) as tmp:
        torch.save(obj, tmp)
    return file_digest(path)


def _prune(root: Path, *, keep: int) -> None:
    complete = sorted(p for p in root.glob("ckpt-r*") if (p / MANIFEST).is_file())
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-ckpt-r*"):
        shutil.rmtree(stale, ignore_errors=True)


def latest_checkpoint(run_dir: Path, *, check: Callable[[Checkpoint], str | None] | None = None
                      ) -> tuple[Checkpoint | None, list[str]]:
    """The newest checkpoint whose files all match its manifest (and in which ``check``, when
    given, finds no problem), and why newer ones were skipped (one line each)."""
    skipped: list[str] = []
    root = run_dir / DIRNAME
    for path in sorted(root.glob("ckpt-r*"), reverse=True):
        manifest, problem = _verify(path)
        if problem is None and check is not None:
            problem = check(Checkpoint(path, manifest))
        if problem is None:
            return Checkpoint(path, manifest), skipped
        skipped.append(f"{path.name}: {problem}")
    return None, skipped


def newest_written(run_dir: Path) -> str | None:
    """The name of the newest checkpoint whose manifest is in place and well formed, None when
    there is none; its files are not read (what ``fdl run`` tells a user after Ctrl-C; resuming
    checks them, :func:`latest_checkpoint`)."""
    for path in sorted((run_dir / DIRNAME).glob("ckpt-r*"), reverse=True):
        try:
            manifest = readback.read_json(path / MANIFEST)
        except (OSError, ValueError):
            continue
        if _manifest_problem(manifest) is None:
            return path.name
    return None


def _verify(path: Path) -> tuple[dict[str, Any], str | None]:
    try:
        manifest = readback.read_json(path / MANIFEST)
    except FileNotFoundError:
        return {}, "no manifest (the write did not finish)"
    except (OSError, ValueError) as exc:
        return {}, f"unreadable manifest ({exc})"
    problem = _manifest_problem(manifest)
    if problem is not None:
        return {}, problem
    for name, expected in manifest["files"].items():
        try:
            problem = _file_problem(path / name, expected)
        except ValueError as exc:  # a FIFO or device swapped in after the check above
            problem = f"{name} cannot be read ({exc})"
        except OSError as exc:
            problem = f"{name} cannot be read ({exc.strerror or exc})"
        if problem is not None:
            return manifest, problem
    return manifest, None


def _file_problem(file: Path, expected: dict[str, Any]) -> str | None:
    if file.is_symlink():
        return f"{file.name} is a symbolic link (fdl writes none)"
    if not file.exists():
        return f"{file.name} is missing"
    if not file.is_file():
        return f"{file.name} is not a regular file"
    if file.stat().st_size != expected["size"]:
        return f"{file.name} has {file.stat().st_size} bytes, the manifest says {expected['size']}"
    if file_digest(file)["sha256"] != expected["sha256"]:
        return f"{file.name} does not match its SHA-256 in the manifest"
    return None


def _manifest_problem(manifest: Any) -> str | None:
    """What makes ``manifest`` unusable: the wrong shape, a file outside the checkpoint, or a
    file a checkpoint of its world size holds that it does not list."""
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(
            isinstance(v, dict) and _is_int(v.get("size")) and isinstance(v.get("sha256"), str)
            for v in files.values()):
        return "unreadable manifest (files must map names to {size, sha256})"
    world_size = manifest.get("world_size")
    if not _is_int(world_size) or world_size < 1:
        return f"unreadable manifest (world_size is {world_size!r}, not a positive integer)"
    for name in files:
        if not _FILE_NAME.fullmatch(name) or name in (".", ".."):
            return f"the manifest names {name!r}, a file outside the checkpoint"
    needed = [MODEL_FILE, ENGINE_FILE, *(f"rank{r}.pt" for r in range(world_size))]
    missing = [name for name in needed if name not in files]
    if missing:
        return f"the manifest does not list {', '.join(missing[:3])}"
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def load_file(path: Path, *, mmap: bool = False) -> Any:
    """The object saved in ``path``, loaded with ``weights_only=True``: tensors and plain
    containers, never code. ``mmap`` maps tensor data instead of reading it (to check a file
    cheaply). Raises :class:`UnloadableFile` naming the file and why."""
    import torch

    if not zipfile.is_zipfile(path):
        raise UnloadableFile(f"{path.name} is not a file torch.save wrote (not a zip archive)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # whatever a damaged or hostile file raises: it is not usable
        raise UnloadableFile(f"{path.name} does not load as tensors and plain data "
                             f"({_load_error(exc)})") from exc


def _load_error(exc: BaseException) -> str:
    """The informative line of a torch.load error (its weights_only errors wrap it in advice)."""
    advice = ("Weights only load failed", "Please file an issue", "Check the documentation")
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    useful = [line for line in lines if not line.startswith(advice)]
    text = (useful or lines or [type(exc).__name__])[0]
    return text.removeprefix("WeightsUnpickler error:").strip()[:200] or type(exc).__name__


def load_rank_state(checkpoint: Checkpoint, *, rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model state and rank ``rank``'s own state (:func:`load_rank_file`), both loaded
    with ``weights_only=True`` (:func:`load_file`)."""
    return load_file(checkpoint.path / MODEL_FILE), load_rank_file(checkpoint, rank=rank)


def load_rank_file(checkpoint: Checkpoint, *, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s own state. With a different world size than the checkpoint's, rank r
    takes rank ``r % old_world_size``'s optimizer state (momentum of a replica that started
    from the same consensus model)."""
    return load_file(checkpoint.path / f"rank{rank % checkpoint.world_size}.pt")
