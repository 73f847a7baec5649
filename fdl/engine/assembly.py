"""Where one rank's parts are built: :func:`assemble` makes every part of the run from explicit
values (the settings, the group, the device, the script's model, optimizer and data) and
returns them (fdl.engine.parts.Parts); :func:`start` gives the state training starts from,
fresh or a checkpoint's. ``run.batches`` (fdl.engine.loop) calls both, then the round loop.

The order is the collectives' order, the same on every rank: the ranks agree on the data and
the model and take rank 0's weights (the replica), learn each other's precision, then rank 0
picks the checkpoint to resume from and tells the others.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fdl.engine.collectives import Group, Membership, gather_labels
from fdl.engine.config import EngineConfig
from fdl.engine.data import TrainData
from fdl.engine.evaluation import Evaluator
from fdl.engine.feed import Feed
from fdl.engine.parts import Parts, ScriptHooks
from fdl.engine.plan import PlanConfig, PlanState, initial_state
from fdl.engine.recorder import Recorder
from fdl.engine.recovery import Checkpointer, find_resume_checkpoint, restart_attempt, resume
from fdl.engine.replica import Replica
from fdl.engine.steps import DrivenScheduler
from fdl.engine.tallies import Tallies
from fdl.errors import UsageError
from fdl.rundir import config as run_config
from fdl.rundir import metrics
from fdl.rundir.checkpoints import CheckpointEvery
from fdl.rundir.progress import ProgressFile
from fdl.rundir.timeline import Timeline

VERIFY_ENV = "FDL_VERIFY_REPLICAS"  # "1": every blocking average logs the model's checksum


@dataclass(frozen=True)
class Inputs:
    """What the script gave ``run.batches``, checked: the data (a map-style dataset's, or a
    stream's), the model and optimizer, and how a step is made."""

    data: TrainData | None
    stream: Any
    model: nn.Module
    optimizer: torch.optim.Optimizer
    accumulate: int
    ddp: bool  # fdl.Trainer's: sync through DDP's wrapper
    scheduler: DrivenScheduler | None
    plan_config: PlanConfig


def assemble(inputs: Inputs, *, config: EngineConfig, membership: Membership, group: Group,
             device: torch.device, precision: str, evaluator: Evaluator,
             script: ScriptHooks, seed_after: int) -> Parts:
    """Every part of this rank's run (the module docstring); ``seed_after`` is this rank's
    seed once it holds rank 0's weights."""
    rank, world_size, run_dir = membership.rank, membership.world_size, config.run_dir
    if run_dir is not None and rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        run_config.merge_engine(run_dir, {**config.to_dict(), "resolved_backend": group.backend})
    timeline = Timeline(run_dir, rank=rank)
    recorder = Recorder(config, run_dir if rank == 0 else None, rank, world_size, evaluator,
                        timeline, verify=_verify(),
                        epochs_total=inputs.plan_config.num_epochs)
    feed = Feed.of(inputs.data, inputs.stream, device=device, batch_size=config.batch_size,
                   accumulate=inputs.accumulate, seed=config.seed)
    replica = Replica.build(inputs.model, inputs.optimizer, config=config, group=group,
                            rank=rank, world_size=world_size, device=device, ddp=inputs.ddp,
                            data=inputs.data, seed_after=seed_after)
    replica.scheduler = inputs.scheduler
    plan_config = inputs.plan_config
    precisions = gather_labels(precision, world_size=world_size) if world_size > 1 \
        else [precision]
    progress = ProgressFile.from_env(run_dir, rank=rank, epochs=config.epochs,
                                     epoch_size=feed.epoch_length(), world_size=world_size)
    if progress is not None:
        progress.precisions = precisions
        progress.epochs = plan_config.num_epochs
        progress.total = plan_config.num_samples
    slowdown = config.simulate_slowdown[rank] if config.simulate_slowdown else 1.0
    return Parts(config=config, plan_config=plan_config, replica=replica, feed=feed,
                 tallies=Tallies(slowdown=slowdown), evaluator=evaluator, recorder=recorder,
                 checkpointer=None, timeline=timeline, progress=progress, script=script,
                 precisions=precisions, evaluate_every=plan_config.round_cap,
                 verify=_verify(),  # last: a part that fails to build leaves no thread behind
                 utilisation=_utilisation(run_dir, membership, device=device))


@dataclass(frozen=True)
class Start:
    """Where training starts: the plan's state, the checkpoint resumed from (None: fresh) and
    its ``run.state`` objects' states, by name."""

    state: PlanState
    resumed_from: str | None
    user_state: dict[str, Any]


def start(parts: Parts) -> Start:
    """The state training starts from: fresh, or a checkpoint's after a crash or with ``fdl
    run --resume`` (fdl.engine.recovery), loaded into the parts; then the checkpointer, when
    the run takes checkpoints. Logs a ``start`` event either way."""
    replica, run_dir, plan_config = parts.replica, parts.config.run_dir, parts.plan_config
    attempt = restart_attempt()
    checkpoint, skipped = find_resume_checkpoint(run_dir, rank=replica.rank,
                                                 world_size=replica.world_size)
    state, resumed_from, user_state = initial_state(plan_config), None, {}
    if checkpoint is not None:
        resumed = resume(checkpoint, replica, parts.tallies, plan_config)
        if resumed.state.finished:
            raise UsageError(f"{checkpoint.path} is at epoch {resumed.state.epoch} "
                             f"({resumed.state.samples_seen} samples) and this run has "
                             f"{plan_config.epochs} epochs"
                             + (f" and a budget of {plan_config.max_samples} samples"
                                if plan_config.max_samples else "")
                             + ": nothing left to train",
                             hint=f"pass --epochs N with N > {resumed.state.epoch}, or a "
                                  "larger --max-steps/--max-samples")
        state, resumed_from, user_state = resumed.state, checkpoint.name, resumed.user_state
        parts.recorder.restore(resumed.history, start_samples=state.samples_seen)
    if replica.rank == 0 and (attempt > 0 or checkpoint is not None) and run_dir is not None:
        metrics.rewrite_epochs(run_dir, parts.recorder.history)
        from fdl import console

        for line in skipped:
            console.warn(f"checkpoint skipped: {line}")
        if checkpoint is not None:
            console.info(f"resuming from {checkpoint.path} (epoch {state.epoch}, round "
                         f"{state.round_index})")
    parts.timeline.event("start", attempt=attempt, world_size=replica.world_size,
                         resumed_from=resumed_from, epoch=state.epoch,
                         round=state.round_index, skipped=skipped)
    every = CheckpointEvery.parse(parts.config.checkpoint_every)
    if every is not None and run_dir is not None:
        parts.checkpointer = Checkpointer(run_dir, every)
    return Start(state, resumed_from, user_state)


def _verify() -> bool:
    return os.environ.get(VERIFY_ENV) == "1"


def _utilisation(run_dir: Any, membership: Membership, *, device: torch.device) -> Any:
    """Local rank 0's utilisation sampler (fdl.engine.utilisation). It must never stop
    training: a run directory it cannot write to only costs the utilisation curves."""
    from fdl.engine.utilisation import start_utilisation_sampler

    try:
        return start_utilisation_sampler(run_dir, local_rank=membership.local_rank,
                                         node=membership.node, device=device,
                                         local_world_size=membership.local_world_size)
    except OSError as exc:
        from fdl import console

        console.warn(f"utilisation sampler not started: {exc}")
        return None
