"""The round loop: every rank runs its share of each round, then the policy's average.

::

    state = train(worker, state)   # every round of the plan, until the last epoch ends

One round, on every rank alike:

1. ``plan = next_round(state)`` — the same plan everywhere (fdl.engine.plan).
2. :func:`run_slice` runs this rank's steps on its slice of the epoch's stream, timing each
   *whole* step (fetching and collating the batch, the host-to-device copy, the LR call,
   forward, backward, optimizer step): what the planner must balance is all of it.
3. :func:`average` — the boundary. The rank's :class:`~fdl.engine.state.RoundReport` rides in
   the same collective as the weighted parameters (``w_r`` = samples in the round). ``cadence``
   waits for the average and loads it; ``async`` first collects the average it launched at the
   previous boundary (``theta += avg - snapshot``), then launches this one in the background
   and goes on; it blocks where one model is needed (policy objects, fdl.engine.policies).
   ``sync`` trains through DDP and averages only its buffers, at epoch ends.
4. ``state = advance(state, plan, round_stats(reports))`` with the reports that arrived (under
   async: the previous round's), then the divergence guard (fdl.engine.guard), the epoch's end
   (loss, evaluation, metrics) and the checkpoints. A time-based checkpoint is decided from the
   ranks' clocks in the reports, so every rank decides alike without a message, and under async
   it makes the boundary blocking first (one model on every rank).

The last round of the last epoch ends with a blocking average under every policy:
:func:`final_consensus` checks that nothing is in flight and that is the model ``fit()``
returns.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from fdl.engine import guard
from fdl.engine.averaging import Averager, checksum
from fdl.engine.config import EngineConfig
from fdl.engine.data import collate, epoch_permutation, slice_batches, to_device
from fdl.engine.plan import PlanState, RoundPlan, RoundStats, advance, next_round
from fdl.engine.policies import Policy, policy_named
from fdl.engine.progress import ProgressFile
from fdl.engine.round_messages import CalibrationPool, ElasticSignal
from fdl.engine.speed import RunningMean, StepTimer
from fdl.engine.state import (
    NO_DISTANCE,
    REPORT_FIELDS,
    RankState,
    RoundReport,
    largest_distance,
    round_stats,
)
from fdl.engine.timeline import Timeline
from fdl.errors import UsageError

NUM_STATS = len(REPORT_FIELDS)


@dataclass
class Totals:
    samples: int = 0
    steps: int = 0
    busy_s: float = 0.0
    sleep_s: float = 0.0
    wait_s: float = 0.0
    syncs: int = 0
    comm_ms: list[float] = field(default_factory=list)  # min-over-ranks wait per averaging


class CheckpointHook(Protocol):
    """Where the round loop offers a checkpoint (fdl.engine.recovery.Checkpointer)."""

    def since_last_s(self) -> float: ...

    def due_within_epoch(self, reports: list[RoundReport]) -> bool: ...

    def at_round(self, state: PlanState, worker: Worker) -> None: ...

    def at_epoch_end(self, state: PlanState, worker: Worker) -> None: ...


@dataclass
class Worker:
    """One rank: what it trains and with what. Its round-to-round bookkeeping is ``rank_state``
    (what recovery saves); nothing outside this module writes the other fields mid-run."""

    rank: int
    world_size: int
    device: torch.device
    model: nn.Module
    step_model: nn.Module  # DDP wrapper under sync, else the model
    optimizer: torch.optim.Optimizer
    train_step: Callable[[nn.Module, Any], torch.Tensor]
    dataset: Any
    config: EngineConfig
    schedule: Callable[[float], float] | None
    timeline: Timeline
    averager: Averager | None
    on_epoch_end: Callable[[int, Worker, PlanState], None]
    checkpointer: CheckpointHook | None = None
    progress: ProgressFile | None = None  # rank 0's live progress, when fdl run shows it
    slowdown: float = 1.0
    verify: bool = False
    rank_state: RankState = field(default_factory=RankState)
    totals: Totals = field(default_factory=Totals)
    base_lrs: list[float] = field(default_factory=list)
    lr_scale: float = 1.0
    _orders: dict[int, torch.Tensor] = field(default_factory=dict)
    _checked: bool = False

    @property
    def policy(self) -> Policy:
        return policy_named(self.config.policy)

    def order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            self._orders = {epoch: epoch_permutation(seed=self.config.seed, epoch=epoch,
                                                     size=len(self.dataset))}
        return self._orders[epoch]


def train(worker: Worker, state: PlanState) -> PlanState:
    """Run every round of the plan; returns the finished state."""
    worker.base_lrs = [group["lr"] for group in worker.optimizer.param_groups]
    policy, pending, last_reports = worker.policy, None, []
    while not state.finished:
        plan = next_round(state)
        report, elastic_used, pool_used = run_slice(worker, plan, state)
        reports: list[RoundReport] | None = None
        consensus = worker.averager is None
        if worker.averager is not None and policy.averages_at(plan):
            due = worker.checkpointer is not None and \
                worker.checkpointer.due_within_epoch(last_reports)
            consensus = policy.blocking(plan, checkpoint_due=due)
            reports, pending = average(worker, plan, report, pending, blocking=consensus)
        elif worker.averager is None:
            reports = [report]
        stats = round_stats(reports) if reports else RoundStats.unknown(worker.world_size)
        advanced = advance(state, plan, stats, elastic_used=elastic_used, pool_used=pool_used)
        if advanced.anchor != state.anchor:
            worker.timeline.event("anchor", round=plan.round_index, anchor=advanced.anchor,
                                  previous=state.anchor, reason=advanced.anchor_history[-1][2])
        state = _guarded(worker, advanced, plan, reports or [])
        last_reports = reports or last_reports
        if plan.last_in_epoch:
            worker.on_epoch_end(plan.epoch, worker, state)
            if worker.checkpointer is not None and not state.finished:
                worker.checkpointer.at_epoch_end(state, worker)
        elif consensus and worker.checkpointer is not None and \
                worker.checkpointer.due_within_epoch(last_reports):
            worker.checkpointer.at_round(state, worker)
            last_reports = []
    final_consensus(worker, pending)
    return state


def run_slice(worker: Worker, plan: RoundPlan,
              state: PlanState) -> tuple[RoundReport, int | None, int | None]:
    """This rank's steps of the round; returns its report. In the calibration round the run's
    very first step (allocations, lazy initialisation) is timed apart and left out of the
    report, so it does not pass for the rank's speed. Also returns, in an elastic round, the
    samples the elastic rank used, and in a round with a pool the batches the ranks took from
    it (the same on every rank)."""
    mine = plan.slices[worker.rank]
    rank_state, batch_size = worker.rank_state, worker.config.batch_size
    mean = RunningMean(rank_state.step_count, rank_state.step_total_s)  # slowdown emulation
    timer = StepTimer(slowdown=worker.slowdown, mean=mean, device=worker.device)
    # The warm-up step stays out of the emulation's mean too: its sleep follows its own time.
    warmup = StepTimer(slowdown=worker.slowdown, device=worker.device)
    total = worker.config.epochs * len(worker.dataset)
    order = worker.order(plan.epoch)
    batches = slice_batches(worker.dataset, order, start=mine.start, stop=mine.stop,
                            batch_size=batch_size)
    # DDP needs every rank in every gradient all-reduce: a rank left without samples in an
    # epoch's cut last round joins (shadows the collectives) instead of hanging the others; the
    # gradient is divided by the ranks that have data, as a plain DDP step on them would be.
    uneven = worker.policy.wraps_ddp and worker.world_size > 1 and \
        any(s.steps == 0 for s in plan.slices)
    join = worker.step_model.join(divide_by_initial_world_size=False) if uneven \
        else contextlib.nullcontext()
    skip_first = plan.calibration and state.samples_seen == 0
    started, timed_samples, data_s = time.perf_counter(), 0, 0.0
    # The round's loss is summed on the device and read once, after the round: reading it each
    # step would make the host wait for the GPU every step and stop it queueing work ahead.
    round_loss = torch.zeros((), dtype=torch.float64, device=worker.device)

    def step(fetch: Callable[[], Any], samples: int, progress: float, *, warm: bool) -> None:
        nonlocal timed_samples, data_s, round_loss
        clock = warmup if warm else timer
        clock.start()
        fetched = time.perf_counter()
        batch = to_device(fetch(), worker.device)
        data_s += time.perf_counter() - fetched
        if worker.schedule is not None:
            _set_lr(worker, worker.schedule(min(1.0, progress / total)))
        loss = _step(worker, batch)
        clock.stop()
        if not warm:
            timed_samples += samples
        round_loss += loss
        rank_state.epoch_loss[1] += 1
        if worker.progress is not None and worker.progress.due():
            _show_progress(worker, plan, samples=min(
                progress + plan.num_samples / max(1, mine.steps),
                state.samples_seen + plan.num_samples))

    signal = ElasticSignal.open(plan, rank=worker.rank)
    with join:
        for index in range(mine.steps):
            if index and signal.arrived(plan):
                break
            step(lambda: next(batches), min(batch_size, mine.num_samples - index * batch_size),
                 state.samples_seen + plan.num_samples * index / max(1, mine.steps),
                 warm=skip_first and index == 0)
    elastic_used = signal.close(plan, rank=worker.rank, used=timed_samples)
    pool = CalibrationPool.open(plan, world_size=worker.world_size)
    taken = 0
    while (j := pool.take()) is not None:  # whole batches, after this rank's own (warm) steps
        low = plan.pool_start + j * batch_size
        step(lambda low=low: collate(worker.dataset, order[low:low + batch_size]), batch_size,
             state.samples_seen + low - state.position, warm=False)
        taken += 1
    pool_used = pool.close()
    round_sum = float(round_loss)  # the one read of the device per round
    rank_state.epoch_loss[0] += round_sum
    if worker.progress is not None and timer.steps + warmup.steps:
        worker.progress.loss = round_sum / (timer.steps + warmup.steps)
    timer.finish()
    warmup.finish()
    rank_state.step_count, rank_state.step_total_s = mean.count, mean.total
    used = mine.num_samples if plan.elastic != worker.rank else timed_samples
    _book_round(worker, plan, used + taken * batch_size, timer, warmup,
                compute_s=time.perf_counter() - started, data_s=data_s)
    since = worker.checkpointer.since_last_s() if worker.checkpointer is not None else 0.0
    report = rank_state.report(busy_ms=timer.busy_s * 1000 if timer.steps else math.nan,
                               samples=timed_samples if timer.steps else 0,
                               since_checkpoint_s=since)
    return report, elastic_used, pool_used


def _show_progress(worker: Worker, plan: RoundPlan, *, samples: float) -> None:
    assert worker.progress is not None
    totals, total = worker.totals, max(1, plan.num_samples)
    worker.progress.write(samples=samples, epoch=plan.epoch,
                          shares=[s.num_samples / total for s in plan.slices],
                          anchor=plan.anchor, sync_s=totals.wait_s, busy_s=totals.busy_s)


def _book_round(worker: Worker, plan: RoundPlan, used: int, timer: StepTimer,
                warmup: StepTimer, *, compute_s: float, data_s: float) -> None:
    totals = worker.totals
    steps = timer.steps + warmup.steps
    totals.samples += used
    totals.steps += steps
    totals.busy_s += timer.busy_s + warmup.busy_s
    totals.sleep_s += timer.sleep_s + warmup.sleep_s
    worker.timeline.event("round", round=plan.round_index, epoch=plan.epoch, steps=steps,
                          samples=used, compute_s=compute_s, data_s=data_s,
                          busy_s=timer.busy_s + warmup.busy_s, step_ms=timer.step_ms,
                          sleep_s=timer.sleep_s + warmup.sleep_s, anchor=plan.anchor,
                          lr_scale=worker.lr_scale)


def _step(worker: Worker, batch: Any) -> torch.Tensor:
    worker.optimizer.zero_grad(set_to_none=True)
    loss = worker.train_step(worker.step_model, batch)
    if not worker._checked:
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise UsageError(
                "train_step must return a scalar loss tensor that requires grad, got "
                + (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
                   else type(loss).__name__),
                hint="return e.g. torch.nn.functional.cross_entropy(model(x), y)")
        worker._checked = True
    loss.backward()
    if worker.config.max_grad_norm is not None:
        nn.utils.clip_grad_norm_(worker.model.parameters(), worker.config.max_grad_norm)
    worker.optimizer.step()
    return loss.detach()


def _set_lr(worker: Worker, multiplier: float) -> None:
    worker.lr_scale = multiplier
    for group, base in zip(worker.optimizer.param_groups, worker.base_lrs, strict=True):
        group["lr"] = base * multiplier


def average(worker: Worker, plan: RoundPlan, report: RoundReport, pending: Any, *,
            blocking: bool) -> tuple[list[RoundReport] | None, Any]:
    """One averaging event; returns the reports that arrived (None: the first background
    average, nothing has arrived yet) and the average still in flight (None when blocking).
    The time from the first copy to the last (pack, reduce or wait, load or apply) is what the
    average cost this rank (RankState.after_sync books it)."""
    averager, rank_state = worker.averager, worker.rank_state
    assert averager is not None
    start = time.perf_counter()
    rows = None
    if pending is not None:  # async: the average launched at the last boundary
        pending.wait()
        rank_state.last_distance = averager.distance_from_average()
        averager.apply_delta()
        rows = averager.stats()
    averager.pack(weight=plan.weights()[worker.rank], stats=report.to_row(), keep_snapshot=True)
    if blocking:
        averager.all_reduce(async_op=False)
        rank_state.last_distance = averager.distance_from_average()
        averager.load_average()
        rows, pending = averager.stats(), None
    else:
        pending = averager.all_reduce(async_op=True)
    end = time.perf_counter()
    rank_state.after_sync((end - start) * 1000, blocking=blocking)
    reports = None if rows is None else [RoundReport.from_row(row) for row in rows]
    _record_sync(worker, plan, start, end, reports, blocking=blocking)
    return reports, pending


def _record_sync(worker: Worker, plan: RoundPlan, start: float, end: float,
                 reports: list[RoundReport] | None, *, blocking: bool) -> None:
    totals = worker.totals
    totals.wait_s += end - start
    totals.syncs += 1
    if reports is not None:
        sync_ms = round_stats(reports).sync_ms
        if math.isfinite(sync_ms):
            totals.comm_ms.append(sync_ms)
    event: dict[str, Any] = {"round": plan.round_index, "start": start, "end": end,
                             "wait_s": end - start, "blocking": blocking,
                             "bytes": worker.averager.bytes if worker.averager else 0}
    if worker.verify and blocking:
        event["checksum"] = checksum(worker.model)
    worker.timeline.event("sync", **event)


def _guarded(worker: Worker, state: PlanState, plan: RoundPlan,
             reports: list[RoundReport]) -> PlanState:
    """Let the divergence guard (fdl.engine.guard) judge the largest replica distance the ranks
    reported — the same on every rank, so every rank acts alike — and log what it saw."""
    distance = largest_distance(reports) if reports else NO_DISTANCE
    if distance == NO_DISTANCE or not worker.policy.local_steps or worker.world_size == 1:
        return state
    before = state.anchor
    state, verdict = guard.observe(worker.rank_state.guard, state, distance=distance,
                                   lr_scale=worker.lr_scale, steps=plan.anchor,
                                   threshold=worker.config.divergence_threshold)
    worker.timeline.event("guard", round=plan.round_index, distance=distance,
                          level=verdict.level, streak=verdict.streak, halve=verdict.halved,
                          released=verdict.released)
    if verdict.halved and state.anchor != before:  # at anchor 1 it can only hold the ceiling
        worker.timeline.event("anchor", round=plan.round_index, anchor=state.anchor,
                              previous=before, reason="divergence guard")
    return state


def final_consensus(worker: Worker, pending: Any) -> None:
    """The run's final average is the last epoch's blocking one (every policy blocks at an
    epoch's end): nothing may still be in flight, and every rank now holds the same model."""
    if pending is not None:
        raise AssertionError("an average was still in flight after the last round")
