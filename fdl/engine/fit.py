"""What ``fdl.Trainer.fit()`` does on every rank, in order: join the group, build the replica
(rank 0's initial weights on every rank, then per-rank random streams), start fresh or from a
checkpoint, run the round loop (fdl.engine.rounds), then gather the run's figures into
``summary.json`` and save the consensus model.

The public API is :mod:`fdl.engine.trainer`; this module is its body.
"""

from __future__ import annotations

import inspect
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from fdl.engine.averaging import Averager, checksum
from fdl.engine.collectives import (
    Group,
    Membership,
    broadcast_from_rank0,
    device_label,
    exchange_rows,
    gather_labels,
    join_group,
    leave_group,
    pick_device,
)
from fdl.engine.config import EngineConfig
from fdl.engine.ddp_comm import DdpCommMeter
from fdl.engine.epochs import EpochLog
from fdl.engine.plan import PlanConfig, PlanState, initial_state
from fdl.engine.recovery import Checkpointer, find_resume_checkpoint, restart_attempt, resume
from fdl.engine.rounds import NUM_STATS, Replica, train
from fdl.engine.state import RankFigures
from fdl.errors import UsageError
from fdl.rundir import config as run_config
from fdl.rundir import metrics
from fdl.rundir.checkpoints import CheckpointEvery
from fdl.rundir.model import save_model
from fdl.rundir.progress import ProgressFile
from fdl.rundir.summary import build_summary, write_summary
from fdl.rundir.timeline import Timeline


class Script(Protocol):
    """What the fit needs of ``fdl.Trainer`` (a protocol: the trainer imports this module)."""

    model: Any
    optimizer: Any
    train_step: Any
    train_data: Any
    eval_data: Any
    evaluate: Any
    schedule: Any
    history: list[dict[str, Any]]


@dataclass
class Fitted:
    """What a finished fit hands back to the trainer."""

    model: nn.Module  # the consensus model, on the CPU
    metrics: dict[str, float]
    summary: dict[str, Any]
    run_dir: Path | None


def fit(script: Script, config: EngineConfig, membership: Membership) -> Fitted:
    """Train ``script`` with ``config`` as rank ``membership.rank`` (solo: rank 0 of 1)."""
    device = pick_device(membership.local_rank, config.backend)
    group = join_group(config.backend, device, membership.world_size)
    sampler = _node_sampler(config.run_dir, membership, device=device)
    try:
        return _fit_in_group(script, config, membership, device=device, group=group)
    finally:
        if sampler is not None:
            sampler.stop()
        leave_group(group)


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s random streams after initialisation (rank 0 keeps ``seed``,
    so a solo run draws what it always drew)."""
    return seed + 1_000_003 * rank


def _fit_in_group(script: Script, config: EngineConfig, membership: Membership, *,
                  device: torch.device, group: Group) -> Fitted:
    rank, world_size = membership.rank, membership.world_size
    run_dir = config.run_dir
    if run_dir is not None and rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        run_config.merge_engine(run_dir, {**config.to_dict(), "resolved_backend": group.backend})
    epochs_log = EpochLog(script, config, run_dir if rank == 0 else None, rank, world_size)
    replica = _replica(script, config, membership, device=device, group=group,
                       epochs_log=epochs_log)
    plan_config = PlanConfig(world_size=world_size, batch_size=config.batch_size,
                             dataset_size=len(script.train_data), epochs=config.epochs,
                             policy=config.policy, overhead_target=config.overhead_target)
    state, resumed_from = _start(script, replica, plan_config, config, epochs_log)
    started = time.perf_counter()
    epochs_log.begin(replica)
    try:
        state = train(replica, state)
    finally:
        epochs_log.close()
    wall_s = time.perf_counter() - started - epochs_log.eval_s
    replica.step_model = replica.model  # drop DDP before the process group goes
    final_checksum = checksum(replica.model)
    replica.timeline.event("final", checksum=final_checksum, anchor=state.anchor)
    replica.timeline.close()
    summary = _summary(replica, replace(config, backend=group.backend), wall_s=wall_s,
                       state=state, final_checksum=final_checksum, epochs_log=epochs_log,
                       resumed_from=resumed_from)
    if run_dir is not None and rank == 0:
        write_summary(run_dir, summary)
        save_model(run_dir, replica.model)
    replica.model.cpu()
    return Fitted(replica.model, epochs_log.last_eval, summary, run_dir)


def _replica(script: Script, config: EngineConfig, membership: Membership, *,
             device: torch.device, group: Group, epochs_log: EpochLog) -> Replica:
    """This rank's replica: the model with rank 0's initial weights, its optimizer, DDP under
    sync, the averaging buffers under every policy with more than one rank."""
    rank, world_size = membership.rank, membership.world_size
    torch.manual_seed(config.seed)  # the same initialisation on every rank
    model = script.model().to(device)
    distributed = membership.distributed
    if distributed:
        broadcast_from_rank0([t.data for t in (*model.parameters(), *model.buffers())],
                             via_host=group.backend != "nccl", group=group.process_group)
    # From here on each rank draws its own random streams (dropout, augmentation): the same
    # masks on every rank would waste the extra replicas.
    torch.manual_seed(rank_seed(config.seed, rank))
    optimizer = build_optimizer(script.optimizer, model)
    policy = config.policy
    if distributed and policy.local_steps:
        refuse_collectives_in_steps(model, optimizer, policy=policy.name)
    step_model: nn.Module = model
    comm_meter = None
    if distributed and policy.wraps_ddp:
        from torch.nn.parallel import DistributedDataParallel

        step_model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            process_group=group.process_group)
        # DDP's all-reduce is timed apart: sync, not compute (fdl.engine.ddp_comm)
        comm_meter = DdpCommMeter.attach(step_model, process_group=group.process_group,
                                         device=device)
    averager = Averager(model, rank=rank, world_size=world_size, backend=group.backend,
                        device=device, num_stats=NUM_STATS, group=group.process_group,
                        params=policy.averages_params) if distributed else None
    run_dir = config.run_dir
    return Replica(
        rank=rank, world_size=world_size, device=device, model=model, step_model=step_model,
        optimizer=optimizer, base_lrs=[group["lr"] for group in optimizer.param_groups],
        train_step=script.train_step, dataset=script.train_data,
        config=config, schedule=script.schedule, timeline=Timeline(run_dir, rank=rank),
        averager=averager, on_epoch_end=epochs_log.epoch_end,
        slowdown=config.simulate_slowdown[rank] if config.simulate_slowdown else 1.0,
        comm_meter=comm_meter,
        verify=os.environ.get("FDL_VERIFY_REPLICAS") == "1",
        progress=ProgressFile.from_env(run_dir, rank=rank, epochs=config.epochs,
                                       epoch_size=len(script.train_data),
                                       world_size=world_size),
    )


def build_optimizer(factory: Any, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer ``factory`` makes for ``model``. A factory whose one parameter is named
    ``model`` gets the model itself (recipes that group parameters by module type:
    ``optimizer=lambda model: ...``); any other gets the model's parameters as a list, which it
    may walk more than once (nanoGPT's ``configure_optimizers`` walks them twice, decay for
    matrices and none for the rest: given a one-shot generator, its second group came out
    empty and those parameters never trained, silently)."""
    try:
        names = list(inspect.signature(factory).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: parameters, as before
        names = []
    return factory(model if names[:1] == ["model"] else list(model.parameters()))


def refuse_collectives_in_steps(model: nn.Module, optimizer: torch.optim.Optimizer, *,
                                policy: str) -> None:
    """Under cadence and async ranks run different numbers of steps between averages, so a
    collective inside a step (SyncBatchNorm's statistics, a sharded optimizer's broadcasts)
    waits for a peer that is not there and hangs the run. Refuse what fdl can see, before any
    step: every rank runs this on the same model and stops alike."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    sync_bn = next((name for name, module in model.named_modules()
                    if isinstance(module, nn.SyncBatchNorm)), None)
    if sync_bn is not None:
        raise UsageError(f"the model's {sync_bn or 'top module'} is a SyncBatchNorm, whose "
                         f"collective in every step hangs under --policy {policy} (ranks run "
                         "different numbers of steps)",
                         hint="use nn.BatchNorm (fdl averages its statistics with the model) "
                              "or --policy sync")
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        raise UsageError(f"ZeroRedundancyOptimizer's collectives in every step hang under "
                         f"--policy {policy} (ranks run different numbers of steps)",
                         hint="use a plain optimizer (fdl averages the replicas) or "
                              "--policy sync")


def _start(script: Script, replica: Replica, plan_config: PlanConfig, config: EngineConfig,
           epochs_log: EpochLog) -> tuple[PlanState, str | None]:
    """The state training starts from — fresh, or a checkpoint's after a crash or with
    ``fdl run --resume`` (see fdl.engine.recovery) — and the checkpoint's name when resumed.
    Logs a ``start`` event either way."""
    run_dir, attempt = config.run_dir, restart_attempt()
    checkpoint, skipped = find_resume_checkpoint(run_dir, rank=replica.rank,
                                                 world_size=replica.world_size)
    state, resumed_from = initial_state(plan_config), None
    if checkpoint is not None:
        resumed = resume(checkpoint, replica, plan_config)
        if resumed.state.epoch >= plan_config.epochs:
            raise UsageError(f"{checkpoint.path} is at epoch {resumed.state.epoch} and this "
                             f"run has {plan_config.epochs} epochs: nothing left to train",
                             hint=f"pass --epochs N with N > {resumed.state.epoch}")
        state, resumed_from = resumed.state, checkpoint.name
        script.history[:] = resumed.history
        epochs_log.restore(resumed.history, start_samples=state.samples_seen)
    if replica.rank == 0 and (attempt > 0 or checkpoint is not None) and run_dir is not None:
        metrics.rewrite_epochs(run_dir, script.history)
        for line in skipped:
            _console().warn(f"checkpoint skipped: {line}")
        if checkpoint is not None:
            _console().info(f"resuming from {checkpoint.path} (epoch {state.epoch}, round "
                            f"{state.round_index})")
    replica.timeline.event("start", attempt=attempt, world_size=replica.world_size,
                           resumed_from=resumed_from, epoch=state.epoch,
                           round=state.round_index, skipped=skipped)
    every = CheckpointEvery.parse(config.checkpoint_every)
    if every is not None and run_dir is not None:
        replica.checkpointer = Checkpointer(run_dir, every, script.history)
    return state, resumed_from


def _summary(replica: Replica, config: EngineConfig, *, wall_s: float, state: PlanState,
             final_checksum: str, epochs_log: EpochLog,
             resumed_from: str | None) -> dict[str, Any]:
    """summary.json's document, with every rank's figures for the run (one collective)."""
    world = replica.world_size
    rows = exchange_rows(replica.totals.figures().to_row(), rank=replica.rank,
                         world_size=world, device=replica.device)
    per_rank = [RankFigures.from_row(row) for row in rows]
    devices = gather_labels(device_label(replica.device), world_size=world) if world > 1 \
        else [str(replica.device)]
    totals = replica.totals
    return build_summary(
        config=config, world_size=world, devices=devices, wall_s=wall_s,
        samples=[int(r.samples) for r in per_rank], busy_s=[r.busy_s for r in per_rank],
        comm_ms=totals.comm_ms, step_comm_s=[r.comm_s for r in per_rank], syncs=totals.syncs,
        eval_metrics=epochs_log.last_eval, final_loss=epochs_log.last_loss,
        extra={"eval_s": epochs_log.eval_s, "seed": config.seed,
               "anchor_history": [list(item) for item in state.anchor_history],
               "final_anchor": state.anchor, "checksum": final_checksum,
               "emulated_sleep_s": [r.sleep_s for r in per_rank],
               "ddp_comm_s": [r.comm_s for r in per_rank],
               "attempt": restart_attempt(), "resumed_from": resumed_from},
    )


def _node_sampler(run_dir: Path | None, membership: Membership, *,
                  device: torch.device) -> Any:
    """Local rank 0's utilisation sampler (fdl.engine.sampler). It must never stop
    training: a run directory it cannot write to only costs the utilisation curves."""
    from fdl.engine.sampler import start_node_sampler

    try:
        return start_node_sampler(run_dir, local_rank=membership.local_rank,
                                  node=membership.node, device=device,
                                  local_world_size=membership.local_world_size)
    except OSError as exc:
        _console().warn(f"utilisation sampler not started: {exc}")
        return None


def _console() -> Any:
    from fdl import console

    return console
