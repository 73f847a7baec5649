"""The round loop of the three policies.

* ``cadence``: each rank runs its planned steps, then a blocking weighted average of parameters
  and buffers (weights = samples in the round); the same collective carries the round's stats.
* ``async``: the average of round k is launched non-blocking and the rank goes straight on with
  round k+1; at the next boundary it waits for it (usually done) and applies
  ``theta += avg_k - snapshot_k``, keeping its local progress. Staleness: one round. The plan
  uses the stats of the previous round (identical on every rank). Epoch ends average blocking.
* ``sync``: one DDP step per round (gradient all-reduce); buffers and stats are averaged at
  epoch ends. An uneven last round is handled by DDP's join.

Divergence guard (cadence, async): each rank reports ``||snapshot - average|| / ||average||``;
when the largest one is above the threshold three averaging rounds in a row the anchor is
halved (and the halving logged) — unlike flodl's guard, it acts.
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

from fdl.engine.averaging import Averager, checksum
from fdl.engine.config import EngineConfig
from fdl.engine.data import epoch_permutation, slice_batches, to_device
from fdl.engine.plan import PlanState, RoundPlan, RoundStats, advance, halve_anchor, next_round
from fdl.engine.speed import RunningMean, StepTimer
from fdl.engine.timeline import Timeline
from fdl.errors import UsageError

NUM_STATS = 5  # step_ms, compute_ms, previous wait_ms, previous distance, samples
NAN = float("nan")


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
    """Where the round loop offers a checkpoint (fdl.engine.recovery.Checkpointer): after a
    round whose average left every rank with the same model, and at epoch ends."""

    def at_round(self, state: PlanState, worker: Worker) -> None: ...

    def at_epoch_end(self, state: PlanState, worker: Worker) -> None: ...


@dataclass
class Worker:
    """One rank's training state: what the round loop reads and updates."""

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
    on_epoch_end: Callable[[int, Worker], None]
    checkpointer: CheckpointHook | None = None
    slowdown: float = 1.0
    verify: bool = False
    totals: Totals = field(default_factory=Totals)
    epoch_loss: list[float] = field(default_factory=lambda: [0.0, 0])
    base_lrs: list[float] = field(default_factory=list)
    _orders: dict[int, torch.Tensor] = field(default_factory=dict)
    _checked: bool = False
    _last_wait_ms: float = NAN
    _last_distance: float = NAN
    _guard_streak: int = 0
    _blocking_ms: float = 0.0  # what this rank's last blocking average took
    _step_mean: RunningMean = field(default_factory=RunningMean)  # for slowdown emulation
    _guard_distance: float = NAN  # the largest replica distance reported at the last average

    def order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            self._orders = {epoch: epoch_permutation(seed=self.config.seed, epoch=epoch,
                                                     size=len(self.dataset))}
        return self._orders[epoch]


def train(worker: Worker, state: PlanState) -> PlanState:
    """Run every round of the plan; returns the finished state."""
    worker.base_lrs = [group["lr"] for group in worker.optimizer.param_groups]
    pending: Any = None
    while not state.finished:
        plan = next_round(state)
        timer = run_slice(worker, plan, state)
        if worker.config.policy == "sync" or worker.averager is None:
            stats = RoundStats((NAN,) * worker.world_size, NAN, NAN)
            # Solo, every round ends with "the" model; under sync, buffers differ until the
            # epoch end's average.
            consensus = worker.averager is None
        else:
            # async averages in the background, except in round 0 (to measure what a whole
            # average costs) and at epoch ends (evaluation and the final model need the
            # consensus).
            blocking = worker.config.policy == "cadence" or plan.last_in_epoch or \
                plan.round_index == 0
            stats, pending = _boundary(worker, plan, timer, pending, blocking=blocking)
            consensus = blocking
        advanced = advance(state, plan, stats)
        if advanced.anchor != state.anchor:
            worker.timeline.event("anchor", round=plan.round_index, anchor=advanced.anchor,
                                  previous=state.anchor, reason=advanced.anchor_history[-1][2])
        state = _guarded(worker, advanced, plan)
        if plan.last_in_epoch:
            if worker.config.policy == "sync" and worker.averager is not None:
                _boundary(worker, plan, timer, None, blocking=True)
            worker.on_epoch_end(plan.epoch, worker)
            if worker.checkpointer is not None and not state.finished:
                worker.checkpointer.at_epoch_end(state, worker)
        elif consensus and worker.checkpointer is not None:
            worker.checkpointer.at_round(state, worker)
    return state


def run_slice(worker: Worker, plan: RoundPlan, state: PlanState) -> StepTimer:
    """This rank's steps of the round; returns their timing."""
    mine = plan.slices[worker.rank]
    timer = StepTimer(slowdown=worker.slowdown, mean=worker._step_mean)
    total = worker.config.epochs * len(worker.dataset)
    batches = slice_batches(worker.dataset, worker.order(plan.epoch), start=mine.start,
                            stop=mine.stop, batch_size=worker.config.batch_size)
    # DDP needs every rank in every gradient all-reduce: a rank left without samples in an
    # epoch's cut last round joins (shadows the collectives) instead of hanging the others.
    uneven = worker.config.policy == "sync" and worker.world_size > 1 and \
        any(s.steps == 0 for s in plan.slices)
    join = worker.step_model.join() if uneven else contextlib.nullcontext()
    started = time.perf_counter()
    data_s = 0.0  # fetching and collating batches, inside the round's compute time
    with join:
        for index in range(mine.steps):
            fetch = time.perf_counter()
            batch = to_device(next(batches), worker.device)
            data_s += time.perf_counter() - fetch
            if worker.schedule is not None:
                done = state.samples_seen + plan.num_samples * index / max(1, mine.steps)
                _set_lr(worker, worker.schedule(min(1.0, done / total)))
            timer.start()
            loss = _step(worker, batch)
            timer.stop(sync_device=worker.device)
            worker.epoch_loss[0] += loss
            worker.epoch_loss[1] += 1
    totals = worker.totals
    totals.samples += mine.num_samples
    totals.steps += timer.steps
    totals.busy_s += timer.busy_s
    totals.sleep_s += timer.sleep_s
    worker.timeline.event("round", round=plan.round_index, epoch=plan.epoch, steps=timer.steps,
                          samples=mine.num_samples, compute_s=time.perf_counter() - started,
                          data_s=data_s, step_ms=timer.step_ms, sleep_s=timer.sleep_s, anchor=plan.anchor)
    return timer


def _step(worker: Worker, batch: Any) -> float:
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
    return float(loss.detach())


def _set_lr(worker: Worker, multiplier: float) -> None:
    for group, base in zip(worker.optimizer.param_groups, worker.base_lrs, strict=True):
        group["lr"] = base * multiplier


def _stats_row(worker: Worker, plan: RoundPlan, timer: StepTimer) -> list[float]:
    return [timer.step_ms, timer.busy_s * 1000, worker._last_wait_ms, worker._last_distance,
            float(plan.slices[worker.rank].num_samples)]


def _boundary(worker: Worker, plan: RoundPlan, timer: StepTimer, pending: Any, *,
              blocking: bool) -> tuple[RoundStats, Any]:
    """One averaging event. The time from the first copy to the last (pack, reduce or wait,
    load or apply) is this rank's sync cost; the smallest over ranks is the communication
    proper (the others also waited for the slowest rank), and what tunes the anchor."""
    averager = worker.averager
    assert averager is not None
    start = time.perf_counter()
    rows = None
    if pending is not None:  # async: the average launched at the last boundary
        pending.wait()
        worker._last_distance = averager.distance_from_average()
        averager.apply_delta()
        rows = averager.stats()
    averager.pack(weight=plan.weights()[worker.rank], stats=_stats_row(worker, plan, timer),
                  keep_snapshot=True)
    if blocking:
        averager.all_reduce(async_op=False)
        worker._last_distance = averager.distance_from_average()
        averager.load_average()
        rows, pending = averager.stats(), None
    else:
        pending = averager.all_reduce(async_op=True)
    end = time.perf_counter()
    if rows is None:  # the first async round: nothing has arrived yet
        worker._last_wait_ms = (end - start) * 1000
        return RoundStats((NAN,) * worker.world_size, NAN, NAN), pending
    return _record_sync(worker, plan, start, end, rows, blocking=blocking), pending


def _record_sync(worker: Worker, plan: RoundPlan, start: float, end: float,
                 rows: list[list[float]], *, blocking: bool) -> RoundStats:
    elapsed_ms = (end - start) * 1000
    if blocking:
        worker._blocking_ms = elapsed_ms
    # A background average still costs its full time in CPU, memory and link bandwidth that the
    # compute shares (on a 2-core host, all of it): count it at least at what the last blocking
    # average cost, or the anchor shrinks and syncs multiply, each slowing the compute.
    worker._last_wait_ms = elapsed_ms if blocking else max(elapsed_ms, worker._blocking_ms)
    totals = worker.totals
    totals.wait_s += end - start
    totals.syncs += 1
    comm = [row[2] for row in rows if math.isfinite(row[2])]
    if comm and len(comm) == len(rows):
        totals.comm_ms.append(min(comm))
    event: dict[str, Any] = {"round": plan.round_index, "start": start, "end": end,
                             "wait_s": end - start, "blocking": blocking,
                             "bytes": worker.averager.bytes if worker.averager else 0}
    if worker.verify and blocking:
        event["checksum"] = checksum(worker.model)
    worker.timeline.event("sync", **event)
    distances = [row[3] for row in rows if math.isfinite(row[3])]
    worker._guard_distance = max(distances) if distances else NAN
    return RoundStats(tuple(row[0] for row in rows), min(comm) if comm else NAN,
                      max(row[1] for row in rows))


def guard_streak(streak: int, distance: float, threshold: float) -> tuple[int, bool]:
    """The divergence guard's rule: a round whose largest replica distance is above
    ``threshold`` extends the streak, any other round resets it; the third round in a row
    halves the anchor (and starts a new streak)."""
    streak = streak + 1 if distance > threshold else 0
    return (0, True) if streak >= 3 else (streak, False)


def _guarded(worker: Worker, state: PlanState, plan: RoundPlan) -> PlanState:
    """Apply :func:`guard_streak` to the distances every rank reported (the same on every rank,
    so every rank halves alike), logging verdicts and halvings to the timeline."""
    distance, worker._guard_distance = worker._guard_distance, NAN
    if not math.isfinite(distance):
        return state
    streak, halve = guard_streak(worker._guard_streak, distance,
                                 worker.config.divergence_threshold)
    worker._guard_streak = streak
    worker.timeline.event("guard", round=plan.round_index, distance=distance,
                          streak=3 if halve else streak, halve=halve)
    if not halve:
        return state
    before = state.anchor
    state = halve_anchor(state, reason=f"divergence guard: replica distance above "
                                       f"{worker.config.divergence_threshold:g} for 3 rounds")
    worker.timeline.event("anchor", round=plan.round_index, anchor=state.anchor,
                          previous=before, reason="divergence guard")
    return state
