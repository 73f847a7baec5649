"""Taking checkpoints during ``fit()`` and resuming from one.

A replica resumes when ``fdl run --resume RUN_DIR`` asked for it (``FDL_RESUME=1``) or when
torch.distributed.elastic restarted the group after a crash (``TORCHELASTIC_RESTART_COUNT`` >
0), and the run directory holds a valid checkpoint (see :mod:`fdl.rundir.checkpoints`). It loads
the consensus model, its optimizer state and RNG states, and continues the plan where the
checkpoint left it: same epoch, stream position, anchor and anchor history. If the world size
changed, the speed estimates are dropped (re-measured in the first round) and rank r takes the
optimizer state of rank ``r % old_world_size``: the plan adapts to the workers there are.

Rank 0 chooses the checkpoint for everyone (:func:`find_resume_checkpoint`): the newest whose
files match its manifest *and* load — every ``.pt`` file with ``weights_only=True`` (so a
planted pickle payload never runs), ``engine.json`` and the rank states with the fields this
module writes. One that does not is skipped with a warning (the ``start`` event's ``skipped``)
and the one before is used. An explicit ``fdl run --resume`` with nothing usable is an error
rather than a silent fresh start.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fdl.engine.collectives import all_reduce_sum
from fdl.engine.peers import PEERS, away_from_rank0, group_attempt, own_attempt
from fdl.engine.plan import PlanConfig, PlanState, saved_state_problem
from fdl.engine.replica import Replica
from fdl.engine.state import RankState, RoundReport
from fdl.engine.tallies import Tallies
from fdl.errors import UsageError
from fdl.rundir.checkpoints import (
    DIRNAME,
    ENGINE_FILE,
    MODEL_FILE,
    Checkpoint,
    CheckpointEvery,
    UnloadableFile,
    latest_checkpoint,
    load_file,
    load_rank_file,
    write_checkpoint,
)
from fdl.rundir.timeline import Timeline
from fdl.settings import RESUME_ENV


def restart_attempt(env: Mapping[str, str] | None = None) -> int:
    """The group's restart attempt (fdl.engine.peers.group_attempt), or ``env``'s count."""
    return group_attempt() if env is None else own_attempt(env)


def find_resume_checkpoint(run_dir: Path | None, *, rank: int, world_size: int,
                           env: Mapping[str, str] | None = None
                           ) -> tuple[Checkpoint | None, list[str]]:
    """The checkpoint the workers start from (None: start fresh), and the skipped ones. Rank 0
    verifies the candidates (hashing and try-loading every file, :func:`checkpoint_problem`)
    and tells the others its choice: one read of a large model instead of one per rank, and
    every rank resumes from the same checkpoint. With ``FDL_RESUME=1`` (``fdl run --resume``)
    and none usable, every rank raises the same UsageError."""
    attempt = restart_attempt(env)  # the group's (env None): the same on every node
    env = os.environ if env is None else env
    explicit = env.get(RESUME_ENV) == "1"
    if run_dir is None or not (explicit or attempt > 0):
        return None, []
    found: list[Any] = [latest_checkpoint(run_dir, check=checkpoint_problem)
                        if rank == 0 else None]
    if world_size > 1:
        dist.broadcast_object_list(found, src=0)
    checkpoint, skipped = found[0]
    if checkpoint is None and explicit:
        why = "; ".join(skipped) or "none was written"
        raise UsageError(f"no usable checkpoint in {run_dir / DIRNAME} ({why})",
                         hint="start a new run, or resume a run directory with a valid "
                              "checkpoint")
    return checkpoint, skipped


def checkpoint_problem(checkpoint: Checkpoint) -> str | None:
    """Why the workers cannot resume from ``checkpoint`` although its files match the manifest
    (None: they can). Loads ``engine.json`` and every ``.pt`` file (tensor data memory-mapped,
    not read) and checks they hold what :class:`Checkpointer` writes."""
    try:
        engine = checkpoint.engine_state()
    except (OSError, ValueError) as exc:
        return f"{ENGINE_FILE} does not load ({exc})"
    problem = _engine_problem(engine, world_size=checkpoint.world_size)
    for name in sorted(checkpoint.manifest["files"]):
        if problem is None and name.endswith(".pt"):
            problem = _torch_file_problem(checkpoint.path / name)
    return problem


# What a rank file of a checkpoint must hold: field -> allowed types (_rank_state writes them).
_RANK_FIELDS: dict[str, tuple[type, ...]] = {
    "optimizer": (dict,), "rng": (dict,), "rank_state": (dict,)}


def _engine_problem(engine: Any, *, world_size: int) -> str | None:
    """Why ``engine.json`` (the plan state and the epoch history) cannot be resumed from."""
    problem = saved_state_problem(engine)
    if problem is not None:
        return f"{ENGINE_FILE}: {problem}"
    if not isinstance(engine.get("history"), list):
        return f"{ENGINE_FILE} has no epoch 'history' list"
    if engine["world_size"] != world_size:
        return (f"{ENGINE_FILE} describes {engine['world_size']} ranks, the manifest "
                f"{world_size}")
    return None


def _torch_file_problem(path: Path) -> str | None:
    try:
        loaded = load_file(path, mmap=True)
    except UnloadableFile as exc:
        return str(exc)
    if path.name == MODEL_FILE:
        return _shape_problem(loaded, {}, path.name)
    problem = _shape_problem(loaded, _RANK_FIELDS, path.name)
    if problem is not None:
        return problem
    try:
        RankState.from_dict(loaded["rank_state"])
    except (TypeError, ValueError) as exc:
        return f"{path.name}: rank_state does not load ({str(exc)[:200]})"
    rng = loaded["rng"]
    torch_state = rng.get("torch")
    if not isinstance(torch_state, torch.Tensor) or torch_state.dtype != torch.uint8:
        return f"{path.name}: rng['torch'] is not torch's RNG state (a uint8 tensor)"
    try:
        random.Random().setstate(rng.get("python"))
    except (TypeError, ValueError, IndexError) as exc:
        return f"{path.name}: rng['python'] is not a random.getstate() ({exc})"
    return None


def _shape_problem(value: Any, fields: dict[str, tuple[type, ...]], name: str) -> str | None:
    if not isinstance(value, dict):
        return f"{name} holds a {type(value).__name__}, not a dict"
    for key, types in fields.items():
        if key not in value:
            return f"{name} has no {key!r}"
        if not isinstance(value[key], types) or isinstance(value[key], bool):
            allowed = " or ".join(t.__name__ for t in types)
            return f"{name}: {key!r} is {value[key]!r:.40}, expected {allowed}"
    return None


@dataclass
class Resumed:
    checkpoint: Checkpoint
    state: PlanState
    history: list[dict[str, Any]]
    user_state: dict[str, Any]  # run.state's objects' state_dicts, by name


def _said(exc: Exception, limit: int = 300) -> str:
    """What torch said, on one line: its lines joined (its first line alone, "Error(s) in
    loading state_dict for Linear:", ended at a colon), cut to ``limit`` characters."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def resume(checkpoint: Checkpoint, replica: Replica, tallies: Tallies,
           plan_config: PlanConfig) -> Resumed:
    """Load ``checkpoint`` into ``replica`` (model, optimizer, RNG) and ``tallies`` (the rank's
    state) and rebuild the plan state (a rank on another node than rank 0's receives its part
    from rank 0)."""
    engine, model_state, rank_state = _checkpoint_parts(checkpoint, replica.rank)
    if engine["dataset_size"] != plan_config.dataset_size:
        raise UsageError(f"cannot resume from {checkpoint.path}: it was trained on "
                         f"{engine['dataset_size']} samples, this run has "
                         f"{plan_config.dataset_size}",
                         hint="resume with the same training data, or start a new run")
    try:
        replica.model.load_state_dict(model_state)
        replica.optimizer.load_state_dict(rank_state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:
        raise UsageError(f"cannot resume from {checkpoint.path}: its model or optimizer does "
                         f"not fit this run's ({_said(exc)})",
                         hint="resume with the same model and optimizer, or start a new "
                              "run") from exc
    averager = replica.averager
    if averager is not None:  # the loaded model is the last average (a wire encoding, outer)
        averager.rebase()
        if averager.outer is not None and "outer" in rank_state:
            averager.outer.load_state_dict(rank_state["outer"], origin=str(checkpoint.path))
    _restore_rng(rank_state["rng"], replica.device)
    restored = RankState.from_dict(rank_state["rank_state"])
    # A mid-epoch checkpoint carries the epoch's loss so far; with another world size the
    # ranks' partial sums no longer add up, and the epoch's loss counts from the resume.
    if checkpoint.world_size != replica.world_size:
        restored.epoch_loss = [0.0, 0]
    tallies.rank_state = restored
    user = rank_state.get("user")
    return Resumed(checkpoint, PlanState.from_dict(engine, plan_config), list(engine["history"]),
                   user if isinstance(user, dict) else {})


@dataclass(frozen=True)
class Saving:
    """What a checkpoint is taken of: the replica, this rank's tallies, the epoch history and
    ``run.state``'s objects (by name); the timeline logs it."""

    replica: Replica
    tallies: Tallies
    timeline: Timeline
    history: list[dict[str, Any]]
    user_state: dict[str, Any]


@dataclass
class Checkpointer:
    """Takes checkpoints where the round loop offers them (``CheckpointHook``): at epoch ends
    (but the last) for ``N`` epochs or a time; with a time, also within an epoch, so a long
    epoch does not lose more than the interval. Within an epoch the decision is made from the
    ranks' clocks in the round reports (their mean, identical on every rank): no extra
    collective, and under async the round loop first makes that boundary blocking. Each
    checkpoint is logged to the timeline."""

    run_dir: Path
    every: CheckpointEvery
    last: float = field(default_factory=time.perf_counter)

    def since_last_s(self) -> float:
        return time.perf_counter() - self.last

    def due_within_epoch(self, reports: list[RoundReport]) -> bool:
        if self.every.seconds is None or not reports:
            return False
        mean = sum(r.since_checkpoint_s for r in reports) / len(reports)
        return mean >= self.every.seconds

    def due_at_epoch_end(self, epochs_done: int, reports: list[RoundReport]) -> bool:
        """Whether the epoch end after ``epochs_done`` epochs may take a checkpoint, known
        before its average (async blocks there then): every N epochs, or by time as the
        ranks' reports say (:meth:`at_epoch_end` decides by time with the ranks' clocks)."""
        if self.every.epochs is not None:
            return self.every.due(epochs_done=epochs_done, elapsed_s=0.0)
        return self.due_within_epoch(reports)

    def at_epoch_end(self, state: PlanState, saving: Saving) -> None:
        if self.every.due(epochs_done=state.epoch, elapsed_s=self._elapsed(saving.replica)):
            self._write(state, saving)

    def at_round(self, state: PlanState, saving: Saving) -> None:
        self._write(state, saving)

    def _elapsed(self, replica: Replica) -> float:
        elapsed = self.since_last_s()
        if self.every.seconds is not None and replica.world_size > 1:
            # Every rank must decide alike: the mean of the ranks' clocks.
            elapsed = all_reduce_sum([elapsed], device=replica.device)[0] / replica.world_size
        return elapsed

    def _write(self, state: PlanState, saving: Saving) -> None:
        begin, replica = time.perf_counter(), saving.replica
        path = write_checkpoint(
            self.run_dir, round_index=state.round_index, rank=replica.rank,
            world_size=replica.world_size,
            model_state=replica.model.state_dict() if replica.rank == 0 else None,
            rank_state=_rank_state(saving),
            engine_state={**state.to_dict(), "history": saving.history},
            gather=_gatherer(replica.world_size), away=away_from_rank0(),
            to_rank0=_to_rank0(replica.rank, replica.world_size))
        saving.timeline.event("checkpoint", round=state.round_index, epoch=state.epoch,
                              position=state.position, name=path.name,
                              bytes=_size(path) if path.is_dir() else None,  # on rank 0's node
                              write_s=time.perf_counter() - begin)
        self.last = time.perf_counter()


def _gatherer(world_size: int) -> Any:
    def gather(obj: Any) -> list[Any]:
        if world_size == 1:
            return [obj]
        out: list[Any] = [None] * world_size
        dist.all_gather_object(out, obj)
        return out

    return gather


def _to_rank0(rank: int, world_size: int) -> Any:
    def to_rank0(obj: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * world_size if rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out

    return to_rank0


def _checkpoint_parts(checkpoint: Checkpoint, rank: int
                      ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The checkpoint's engine state, model state and this rank's state. The ranks on rank 0's
    node read them from its disk; rank 0 hands the ranks on other nodes, which cannot, their
    parts (a scatter: every rank takes part, or none when all are on rank 0's node), reading
    ``engine.json`` and the model once."""
    away = away_from_rank0()
    parts: list[Any] = [None]
    if rank in away:
        dist.scatter_object_list(parts, None, src=0)
        return parts[0]
    engine, model_state = checkpoint.engine_state(), load_file(checkpoint.path / MODEL_FILE)
    if away:
        given = [(engine, model_state, load_rank_file(checkpoint, rank=other))
                 if other in away else None for other in range(len(PEERS))] \
            if rank == 0 else None
        dist.scatter_object_list(parts, given, src=0)
    return engine, model_state, load_rank_file(checkpoint, rank=rank)


def _rank_state(saving: Saving) -> dict[str, Any]:
    """A rank file's contents: the optimizer's state (and the outer optimizer's momentum), the
    RNG states, the rank's round-to-round state and ``run.state``'s objects."""
    device = saving.replica.device
    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    replica = saving.replica.state_dict()
    state = {"optimizer": replica.pop("optimizer"), "rng": rng,
             "rank_state": saving.tallies.rank_state.to_dict(),
             "user": {name: obj.state_dict() for name, obj in saving.user_state.items()}}
    return {**state, **replica}


def _restore_rng(rng: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if device.type == "cuda" and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"], device)


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())
