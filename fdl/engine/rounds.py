"""The round loop: every rank runs its share of each round, then the policy's average.

::

    state = train(replica, state)   # every round of the plan, until the last epoch ends

One round, on every rank alike:

1. ``plan = next_round(state)`` — the same plan everywhere (fdl.engine.plan).
2. :func:`run_slice` runs this rank's steps on its slice of the epoch's stream, timing each
   *whole* step (fetching and collating the batch, the host-to-device copy, the LR call,
   forward, backward, optimizer step): what the planner must balance is all of it. Under
   ``sync`` the time a step spends in DDP's gradient all-reduce (fdl.engine.ddp_comm) is
   booked apart, as sync; the slowdown emulation sleeps on the rest (fdl.engine.speed).
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
from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from torch import nn

from fdl.engine import guard
from fdl.engine.averaging import Averager, checksum
from fdl.engine.collectives import all_reduce_max, broadcast_from
from fdl.engine.config import EngineConfig
from fdl.engine.data import epoch_permutation, to_device
from fdl.engine.ddp_comm import DdpCommMeter
from fdl.engine.grad_sync import GradSync
from fdl.engine.h2d import DeviceCopies
from fdl.engine.plan import (
    PlanState,
    RoundPlan,
    RoundStats,
    advance,
    auto_choice,
    cut_after_next_round,
    ends_run,
    next_round,
    pool_chunk,
    pool_share,
    with_policy,
)
from fdl.engine.policies import Policy, PolicyChoice
from fdl.engine.round_messages import ElasticSignal, SharedPool
from fdl.engine.speed import RunningMean, StepTimer
from fdl.engine.state import (
    FIGURE_FIELDS,
    NO_DISTANCE,
    REPORT_FIELDS,
    RankFigures,
    RankState,
    RoundReport,
    largest_distance,
    round_stats,
)
from fdl.engine.steps import DrivenScheduler, Logged, StepWatch
from fdl.rundir.progress import ProgressFile
from fdl.rundir.timeline import Timeline

# A rank's stats row in an average: its round's report, then, in the epoch's last average, its
# figures for the epoch (zeros in the others): the epoch's end needs no collective of its own.
NUM_REPORT = len(REPORT_FIELDS)
NUM_STATS = NUM_REPORT + len(FIGURE_FIELDS)
NO_FIGURES = [0.0] * len(FIGURE_FIELDS)
SYNC_CLOCK_ROUNDS = 16  # under sync with max_time, the ranks compare clocks this often


@dataclass
class Totals:
    samples: int = 0
    steps: int = 0
    busy_s: float = 0.0
    sleep_s: float = 0.0
    wait_s: float = 0.0
    comm_s: float = 0.0  # DDP's all-reduce inside the steps (sync)
    data_s: float = 0.0  # waiting for batches inside the steps
    syncs: int = 0
    comm_ms: list[float] = field(default_factory=list)  # min-over-ranks wait per averaging

    def figures(self) -> RankFigures:
        """The totals so far as the figures ranks exchange (the loss is the epoch's business)."""
        return RankFigures(samples=self.samples, busy_s=self.busy_s, sleep_s=self.sleep_s,
                           wait_s=self.wait_s, comm_s=self.comm_s, data_s=self.data_s)


class CheckpointHook(Protocol):
    """Where the round loop offers a checkpoint (fdl.engine.recovery.Checkpointer)."""

    def since_last_s(self) -> float: ...

    def due_within_epoch(self, reports: list[RoundReport]) -> bool: ...

    def at_round(self, state: PlanState, replica: Replica) -> None: ...

    def at_epoch_end(self, state: PlanState, replica: Replica) -> None: ...

    def due_at_epoch_end(self, epochs_done: int, reports: list[RoundReport]) -> bool: ...


@dataclass
class Replica:
    """This rank's replica of the model and what it trains it with. Its round-to-round
    bookkeeping is ``rank_state`` (what recovery saves); nothing outside this module writes the
    other fields mid-run."""

    rank: int
    world_size: int
    device: torch.device
    model: nn.Module
    step_model: nn.Module  # DDP wrapper under sync, else the model
    optimizer: torch.optim.Optimizer
    dataset: Any  # a map-style dataset, or None for a stream
    config: EngineConfig
    timeline: Timeline
    averager: Averager | None
    # An epoch ended: takes its figures and returns what needs the consensus (evaluation,
    # record), run at once after a blocking average or, under async, when the average lands.
    on_epoch_end: Callable[[int, Replica, PlanState], Callable[[], None]]
    # This rank's figures for the epoch so far (fdl.engine.epochs), taken when the epoch's last
    # average is packed: they ride in it, and the epoch's end reads every rank's from it.
    epoch_figures: Callable[[Replica], RankFigures] | None = None
    figures_in_flight: bool = False  # the average in flight (or just landed) carries them
    epoch_rows: list[RankFigures] | None = None  # every rank's, once that average landed
    checkpointer: CheckpointHook | None = None
    progress: ProgressFile | None = None  # rank 0's live progress, when fdl run shows it
    slowdown: float = 1.0
    # Times each step's gradient all-reduce under sync: DDP's comm hook (fdl.Trainer) or the
    # optimizer's pre-step all-reduce (a loop script; fdl.engine.grad_sync).
    comm_meter: DdpCommMeter | GradSync | None = None
    steps: StepWatch | None = None  # the optimizer steps the user's code took
    scheduler: DrivenScheduler | None = None  # run.batches(scheduler=): stepped by the engine
    accumulate: int = 1  # batches per optimizer step
    logged: Logged = field(default_factory=Logged)  # run.log's scalars, summed on the device
    position: float = 0.0  # samples of the run done, as this rank's share of the round stands
    started: float = field(default_factory=time.perf_counter)  # the training clock's zero
    time_up: bool = False  # max_time passed: the next round is the last
    verify: bool = False
    rank_state: RankState = field(default_factory=RankState)
    totals: Totals = field(default_factory=Totals)
    # Each param group's LR as the optimizer was made: the LR scale the guard divides by is
    # the current LR over these. Taken before a checkpoint is loaded (whose optimizer state
    # holds the LR already scaled).
    base_lrs: list[float] = field(default_factory=list)
    lr_scale: float = 1.0
    # The slowdown emulation's memory across rounds: the recent steps' compute (rank_state
    # keeps its value for checkpoints) and the oversleep the next sleeps pay back.
    compute_mean: RunningMean | None = None
    sleep_owed_s: float = 0.0
    on_scalars: Callable[[dict[str, float]], None] | None = None  # each round's logged means
    stream: Any = None  # data without len() (fdl.engine.shards): batches instead of positions
    evaluate_every: int | None = None  # samples between evaluations within an epoch
    on_evaluate: Callable[[Replica, PlanState], None] | None = None
    after_average: list[Callable[[], None]] = field(default_factory=list)  # run.after_average
    copies: DeviceCopies | None = None  # CUDA: batches copied one ahead on a side stream
    epoch_in_flight: Callable[[], None] | None = None  # async: an epoch's end awaiting its average
    # auto's choice was made (fdl.engine.loop rebuilds the step and the averaging for it)
    on_policy: Callable[[Replica, PolicyChoice], None] | None = None
    round_plan: RoundPlan | None = None  # the round running now (set by :func:`rounds`)
    _orders: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def policy(self) -> Policy:
        return self.config.policy

    @property
    def step_size(self) -> int:
        """The samples of one step, the plan's unit: ``accumulate`` batches."""
        return self.config.batch_size * self.accumulate

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            self._orders = {epoch: epoch_permutation(seed=self.config.seed, epoch=epoch,
                                                     size=len(self.dataset))}
        return self._orders[epoch]


def rounds(replica: Replica, state: PlanState) -> Generator[Any, None, PlanState]:
    """Every round of the plan, as the batches this rank trains on (on its device); the
    caller's code between two batches is the step. Returns the finished state."""
    pending, last_reports = None, []
    while not state.finished:
        policy = replica.policy  # auto's choice changes it once
        plan = replica.round_plan = next_round(state)
        done = yield from run_slice(replica, plan, state)
        _fetch_ahead(replica, plan, state, done)
        reports: list[RoundReport] | None = None
        consensus = replica.averager is None
        evaluation_due = _evaluation_due(replica, plan, state)
        if replica.averager is not None and policy.averages_at(plan):
            consensus = policy.blocking(
                plan, checkpoint_due=_checkpoint_due(replica, plan, last_reports)
                or evaluation_due, ends_run=ends_run(state, plan))
            reports, pending = average(replica, plan, done.report, pending, blocking=consensus)
        elif replica.averager is None:
            reports = [done.report]
        stats = round_stats(reports) if reports else RoundStats.unknown(replica.world_size)
        advanced = advance(state, plan, stats, elastic_used=done.elastic_used,
                           pool_used=done.pool_used)
        if replica.scheduler is not None:  # every rank's count alike at the round's end
            replica.scheduler.advance(advanced.samples_seen)
        if advanced.anchor != state.anchor:
            replica.timeline.event("anchor", round=plan.round_index, anchor=advanced.anchor,
                                  previous=state.anchor, reason=advanced.anchor_history[-1][2])
        if policy.decides and reports and not plan.calibration:
            advanced = _chosen_policy(replica, advanced, plan)
        state = _guarded(replica, advanced, plan, reports or [])
        state = _within_time(replica, state, plan, reports)
        last_reports = reports or last_reports
        if evaluation_due and not plan.last_in_epoch and replica.on_evaluate is not None and \
                (consensus or not policy.local_steps):  # sync: DDP keeps the replicas alike
            replica.on_evaluate(replica, state)
        if plan.last_in_epoch:
            finish = replica.on_epoch_end(plan.epoch, replica, state)
            if consensus:
                finish()
                if replica.checkpointer is not None and not state.finished:
                    replica.checkpointer.at_epoch_end(state, replica)
            else:  # async runs on: the epoch ends on its consensus when its average lands
                replica.epoch_in_flight = finish
        elif consensus and replica.checkpointer is not None and \
                replica.checkpointer.due_within_epoch(last_reports):
            replica.checkpointer.at_round(state, replica)
            last_reports = []
    final_consensus(replica, pending)
    return state


def run_slice(replica: Replica, plan: RoundPlan,
              state: PlanState) -> Generator[Any, None, SliceResult]:
    """This rank's part of the round: its own steps (:func:`_own_steps`), then the shared
    pool's, if the round has one (:func:`_pool_steps`), then its report
    (:func:`_close_slice`). In the calibration round the run's very first step (allocations,
    lazy initialisation) is timed apart and left out of the report, so it does not pass for
    the rank's speed."""
    tally = RoundTally.open(replica)
    elastic_used = yield from _own_steps(replica, plan, state, tally)
    pool_used = yield from _pool_steps(replica, plan, state, tally)
    return SliceResult(_close_slice(replica, plan, tally), elastic_used, pool_used)


@dataclass(frozen=True)
class SliceResult:
    """What a rank's part of a round leaves for the boundary: its report, and the same on
    every rank, the samples the elastic rank used (an elastic round) and the batches taken
    from the pool (a round with one); None where the round has neither."""

    report: RoundReport
    elastic_used: int | None
    pool_used: int | None


@dataclass
class RoundTally:
    """What one round's steps add up to on this rank while they run: the step timers, the
    samples their time covers and the time spent fetching batches (the scalars the script
    logs are summed on the device in ``Replica.logged`` and read once, after the round)."""

    timer: StepTimer  # the timed steps; their running mean drives the slowdown emulation
    warmup: StepTimer  # the run's very first step, timed apart and never slowed (see open)
    mean: RunningMean
    started: float = field(default_factory=time.perf_counter)
    timed_samples: int = 0
    data_s: float = 0.0
    pool_samples: int = 0  # positions taken from the round's shared pool
    went_on: bool = False  # the slice's batches came from the pass started at the last boundary

    @classmethod
    def open(cls, replica: Replica) -> RoundTally:
        """The round's timers. The warm-up one is not slowed: what makes a run's first step
        slow is mostly once-only host work (torch.compile's compilation, allocations) that a
        slower device does not make slower: emulated at 2.5x, the slow rank slept 1.5x its
        ~26 s compilation while the fast one waited (fdl init -t loop with COMPILE=1, fresh
        inductor caches: 74 s end to end, 39 s unslowed)."""
        rank_state, mean = replica.rank_state, replica.compute_mean
        if mean is None or mean.count != rank_state.step_count:  # a start, a resume
            mean = RunningMean(rank_state.step_count, rank_state.step_total_s)
            replica.compute_mean = mean
        return cls(timer=StepTimer(slowdown=replica.slowdown, mean=mean,
                                   device=replica.device,
                                   comm=replica.comm_meter, owed_s=replica.sleep_owed_s),
                   warmup=StepTimer(device=replica.device, comm=replica.comm_meter),
                   mean=mean)

    @property
    def steps(self) -> int:
        return self.timer.steps + self.warmup.steps


def _own_steps(replica: Replica, plan: RoundPlan, state: PlanState,
               tally: RoundTally) -> Generator[Any, None, int | None]:
    """The rank's planned steps on its slice of the epoch's stream; the elastic rank stops
    early once the slowest rank has posted that it is done. Returns the samples the elastic
    rank used (None: the round is not elastic)."""
    mine, step_size = plan.slices[replica.rank], replica.step_size
    order = replica.order(plan.epoch) if replica.stream is None else None
    steps = [_samples(replica, order, low, min(low + step_size, mine.stop))
             for low in range(mine.start, mine.stop, step_size)]
    fetch = _ahead(replica, _slice_fetch(replica, steps), steps)
    tally.went_on = replica.stream is None and replica.dataset.went_on
    warm_first = plan.calibration and state.samples_seen == 0
    sliced = plan.pool_start - state.position  # the slices' positions: a pool's come after
    signal = ElasticSignal.open(plan, rank=replica.rank)
    with _joined_if_uneven(replica, plan):
        for index, samples in enumerate(steps):
            if index and signal.arrived(plan):
                break
            if replica.comm_meter is not None:  # the mean is over the ranks with data
                replica.comm_meter.ranks_with_data = sum(s.steps > index for s in plan.slices)
            yield from _timed_step(replica, plan, state, tally, fetch, samples,
                                   progress=state.samples_seen + sliced * index
                                   / max(1, mine.steps), warm=warm_first and index == 0)
        _shadow_steps(replica, plan)
    return signal.close(plan, rank=replica.rank, used=tally.timed_samples)


def _shadow_steps(replica: Replica, plan: RoundPlan) -> None:
    """A loop script under sync all-reduces its gradients in each step (fdl.engine.grad_sync):
    a rank with fewer steps than the others in an epoch's cut last round joins their remaining
    all-reduces with zeros, then takes the parameters of a rank that made every step, as DDP's
    ``join`` does for fdl.Trainer (its ``_sync_final_model``): the joined rank's optimizer did
    not step, so its replica would otherwise stay behind for the rest of the run (its optimizer
    state stays its own, as under DDP)."""
    shadow = getattr(replica.comm_meter, "shadow", None)
    if shadow is None or not replica.policy.wraps_ddp or replica.world_size == 1:
        return
    most = max(s.steps for s in plan.slices)
    for index in range(plan.slices[replica.rank].steps, most):
        shadow(ranks_with_data=sum(s.steps > index for s in plan.slices))
    if any(s.steps < most for s in plan.slices):  # the plan's: alike on every rank
        full = next(rank for rank, s in enumerate(plan.slices) if s.steps == most)
        meter = replica.comm_meter
        broadcast_from([p.data for p in replica.model.parameters()], full,
                       via_host=meter.via_host, group=meter.process_group)


def _joined_if_uneven(replica: Replica, plan: RoundPlan) -> contextlib.AbstractContextManager:
    """DDP needs every rank in every gradient all-reduce: a rank left without samples in an
    epoch's cut last round joins (shadows the collectives) instead of hanging the others; the
    gradient is divided by the ranks that have data, as a plain DDP step on them would be."""
    join = getattr(replica.step_model, "join", None)
    if join is not None and replica.policy.wraps_ddp and replica.world_size > 1 and \
            any(s.steps == 0 for s in plan.slices):
        return join(divide_by_initial_world_size=False)
    return contextlib.nullcontext()


def _pool_steps(replica: Replica, plan: RoundPlan, state: PlanState,
                tally: RoundTally) -> Generator[Any, None, int | None]:
    """Whole steps of the round's shared pool after the rank's own steps: the calibration
    round's until every rank is done, the epoch's last round's until it is empty (its last
    step maybe partial); returns how many the ranks took (None: no pool)."""
    step_size = replica.step_size
    order = replica.order(plan.epoch) if replica.stream is None else None
    workers = replica.stream is None and replica.dataset.data.uses_workers
    chunk = pool_chunk(state, replica.rank)
    if workers:  # a pass of the loader's workers per take: enough batches to keep them busy
        chunk = max(chunk, replica.dataset.data.num_workers)
    pool = SharedPool.open(plan, world_size=replica.world_size, chunk=chunk,
                           share=pool_share(state, replica.rank))
    while taken := pool.take():
        steps = []
        for j in taken:
            low = plan.pool_start + j * step_size
            high = min(low + step_size, plan.pool_stop)
            steps.append((low, high, _samples(replica, order, low, high)))
        # the calibration pool's single steps are made here; a drained pool's, by the workers
        fetch = _ahead(replica, _slice_fetch(replica, [s for _, _, s in steps]),
                       [s for _, _, s in steps]) if workers and plan.drains else None
        for low, high, samples in steps:
            yield from _timed_step(replica, plan, state, tally,
                                   fetch or _ahead(replica, _one_fetch(replica, samples),
                                                   [samples]), samples,
                                   progress=state.samples_seen + low - state.position,
                                   warm=False)
            tally.pool_samples += high - low
    return pool.close()


def _samples(replica: Replica, order: torch.Tensor | None, low: int,
             high: int) -> list[torch.Tensor] | int:
    """A step's samples, stream positions ``[low, high)``: their indices in the epoch's order,
    split into the step's ``accumulate`` batches (as evenly as they go; none when there are
    fewer samples than batches: an epoch's last few), or, for a stream, how many."""
    if order is None:
        return high - low
    indices = order[low:high]
    return list(indices.tensor_split(replica.accumulate)) \
        if len(indices) >= replica.accumulate else []


def _slice_fetch(replica: Replica, steps: list[list[torch.Tensor] | int]) -> Callable[[], Any]:
    """The next batch of the slice, each call: a stream's next batch, or the slice's batches in
    order, fetched ahead by the dataset's DataLoader workers when it has them
    (fdl.engine.batch_loader)."""
    if replica.stream is not None:
        return replica.stream.next_batch
    batches = replica.dataset.batches([chunk for step in steps if not isinstance(step, int)
                                       for chunk in step])
    return lambda: next(batches)


def _ahead(replica: Replica, fetch: Callable[[], Any],
           steps: list[list[torch.Tensor] | int]) -> Callable[[], Any]:
    """On CUDA, ``fetch`` with each batch's copy to the device issued one batch ahead on a
    side stream (fdl.engine.h2d), for the batches ``steps`` hold; a stream's batches (no
    positions to stop at) and CPU batches as they come."""
    if replica.copies is None or replica.stream is not None:
        return fetch
    return replica.copies.ahead(fetch, sum(len(s) for s in steps if not isinstance(s, int)))


def _fetch_ahead(replica: Replica, plan: RoundPlan, state: PlanState,
                 done: SliceResult) -> None:
    """Hand the loader's workers this rank's slice of the next round as the plan foresees it
    now, before the boundary (its average, an epoch's end), so they fetch its first batches
    meanwhile (fdl.engine.batch_loader). What the round used is known on every rank by now,
    so the next round's first position is exact; the ranks' shares are foreseen from the
    speeds before this round's (``RoundStats.unknown``): the rank whose slice comes first
    foresees right unless the average changes which rank that is, the others as long as it
    leaves the split alone. A wrong
    foresight costs the batches fetched meanwhile, never a wrong batch: the loader checks."""
    if replica.stream is not None or not replica.dataset.data.uses_workers:
        return
    foreseen = advance(state, plan, RoundStats.unknown(replica.world_size),
                       elastic_used=done.elastic_used, pool_used=done.pool_used)
    if foreseen.finished:
        return
    next_plan = next_round(foreseen)
    mine, step_size = next_plan.slices[replica.rank], replica.step_size
    order = replica.order(next_plan.epoch)
    replica.dataset.fetch_ahead([batch for low in range(mine.start, mine.stop, step_size)
                                 for batch in _samples(replica, order, low,
                                                       min(low + step_size, mine.stop))])


def _one_fetch(replica: Replica, samples: list[torch.Tensor] | int) -> Callable[[], Any]:
    """A pool's step, made in this process (the calibration pool's batches come one at a
    time; a drained pool's, without loader workers)."""
    if replica.stream is not None:
        return replica.stream.next_batch
    chunks = iter(samples if not isinstance(samples, int) else [])
    return lambda: replica.dataset.collate(next(chunks))


def _timed_step(replica: Replica, plan: RoundPlan, state: PlanState, tally: RoundTally,
                fetch: Callable[[], Any], samples: list[torch.Tensor] | int, *,
                progress: float, warm: bool) -> Generator[Any, None, None]:
    """One whole optimizer step on ``samples`` (its batches' indices into the dataset; for a
    stream, a count), timed as the planner must balance it: fetching and collating its
    batches (``fetch()`` each), the host-to-device copies, and the caller's code for each
    (forward, backward, the optimizer step). With ``accumulate`` k the step is k batches, and
    the step must end on the optimizer's step: a round never ends between the batches of
    one."""
    parts = replica.accumulate
    if isinstance(samples, int):  # a stream: whole batches
        count = parts * replica.config.batch_size if samples >= parts else 0
    else:
        count = sum(len(chunk) for chunk in samples)
    if not count:  # an epoch's last few samples, too few for a step of k batches
        shadow = getattr(replica.comm_meter, "shadow", None)
        if shadow is not None:  # a loop's sync: the others' all-reduce of this step, joined
            shadow(ranks_with_data=replica.comm_meter.ranks_with_data)
        return
    if replica.progress is not None and not replica.progress.written:
        # the display says so while the first step lasts (a compilation: half a minute)
        _show_progress(replica, plan, samples=progress, first_step=True)
    clock = tally.warmup if warm else tally.timer
    clock.start()
    replica.position = progress
    if replica.scheduler is not None:  # the step's LR: the global steps before it
        replica.scheduler.advance(progress)
    arm = getattr(replica.comm_meter, "arm", None)  # a loop's sync: reduce after the last
    for part in range(parts):
        fetched = time.perf_counter()
        batch = to_device(fetch(), replica.device)
        tally.data_s += time.perf_counter() - fetched
        if arm is not None and part == parts - 1:
            arm()
        yield batch
        if replica.steps is not None:
            replica.steps.check(after=part + 1, of=parts)
    clock.stop()
    if not warm:
        tally.timed_samples += count
    if replica.progress is not None and replica.progress.due():
        mine = plan.slices[replica.rank]
        _show_progress(replica, plan, samples=min(
            progress + plan.num_samples / max(1, mine.steps),
            state.samples_seen + plan.num_samples))


def _close_slice(replica: Replica, plan: RoundPlan, tally: RoundTally) -> RoundReport:
    """Read the round's loss and step times (the one wait for the device per round), book the
    round and build the rank's report."""
    rank_state, timer = replica.rank_state, tally.timer
    means = replica.logged.read()
    loss = means.get("loss")
    if loss is not None:  # the epoch's loss: a sum over steps (a script may log none)
        rank_state.epoch_loss[0] += loss * tally.steps
        rank_state.epoch_loss[1] += tally.steps
    if replica.progress is not None and loss is not None:
        replica.progress.loss = loss
    if means:
        replica.timeline.event("scalars", round=plan.round_index, values=means)
        if replica.on_scalars is not None:
            replica.on_scalars(means)
    replica.lr_scale = _lr_scale(replica)
    timer.finish()
    tally.warmup.finish()
    rank_state.step_count, rank_state.step_total_s = tally.mean.count, tally.mean.total
    replica.sleep_owed_s = timer.owed_s
    mine = plan.slices[replica.rank]
    used = mine.num_samples if plan.elastic != replica.rank else tally.timed_samples
    _book_round(replica, plan, used + tally.pool_samples, tally,
                compute_s=time.perf_counter() - tally.started)
    since = replica.checkpointer.since_last_s() if replica.checkpointer is not None else 0.0
    return rank_state.report(busy_ms=timer.busy_s * 1000 if timer.steps else math.nan,
                             samples=tally.timed_samples if timer.steps else 0,
                             since_checkpoint_s=since, elapsed_s=replica.elapsed_s())


def _show_progress(replica: Replica, plan: RoundPlan, *, samples: float,
                   first_step: bool = False) -> None:
    assert replica.progress is not None
    totals = replica.totals
    sliced = [s.num_samples for s in plan.slices]  # the planned split (a pool is anyone's)
    shares = [n / sum(sliced) for n in sliced] if sum(sliced) else \
        [1 / len(sliced)] * len(sliced)
    replica.progress.write(samples=samples, epoch=plan.epoch, shares=shares,
                          anchor=plan.anchor, sync_s=totals.wait_s + totals.comm_s,
                          busy_s=totals.busy_s, data_s=totals.data_s, first_step=first_step)


def _book_round(replica: Replica, plan: RoundPlan, used: int, tally: RoundTally, *,
                compute_s: float) -> None:
    totals, timer, warmup = replica.totals, tally.timer, tally.warmup
    totals.samples += used
    totals.steps += tally.steps
    totals.busy_s += timer.busy_s + warmup.busy_s
    totals.sleep_s += timer.sleep_s + warmup.sleep_s
    totals.comm_s += timer.comm_s + warmup.comm_s
    totals.data_s += tally.data_s
    replica.timeline.event("round", round=plan.round_index, epoch=plan.epoch, steps=tally.steps,
                           samples=used, planned=plan.slices[replica.rank].num_samples,
                           compute_s=compute_s, data_s=tally.data_s,
                           busy_s=timer.busy_s + warmup.busy_s, step_ms=timer.step_ms,
                           sleep_s=timer.sleep_s + warmup.sleep_s,
                           comm_s=timer.comm_s + warmup.comm_s, anchor=plan.anchor,
                           lr_scale=replica.lr_scale, fetched_ahead=tally.went_on)


def _lr_scale(replica: Replica) -> float:
    """The optimizer's LR now over its LR when the run began (the first param group's): what
    the divergence guard divides the replicas' drift by."""
    if not replica.base_lrs or not replica.base_lrs[0]:
        return 1.0
    return float(replica.optimizer.param_groups[0]["lr"]) / replica.base_lrs[0]


def average(replica: Replica, plan: RoundPlan, report: RoundReport, pending: Any, *,
            blocking: bool) -> tuple[list[RoundReport] | None, Any]:
    """One averaging event; returns the reports that arrived (None: the first background
    average, nothing has arrived yet) and the average still in flight (None when blocking).
    The time from the first copy to the last (pack, reduce or wait, load or apply) is what the
    average cost this rank (RankState.after_sync books it), less an epoch's end that waited for
    the average that landed here (async): its evaluation is not what the link costs, and the
    anchor tuner would grow the rounds for it."""
    averager, rank_state = replica.averager, replica.rank_state
    assert averager is not None
    start = time.perf_counter()
    rows = None
    if pending is not None:  # async: the average launched at the last boundary
        pending.wait()
        rows = _landed_rows(replica, averager)
        rank_state.last_distance = averager.distance_from_average()
        averager.step_outer()
        if replica.epoch_in_flight is not None:  # it was an epoch's end: that is its consensus
            begin = time.perf_counter()
            with averager.average_loaded():
                replica.epoch_in_flight()
            replica.epoch_in_flight = None
            start += time.perf_counter() - begin  # the epoch's end (evaluation) is no average's
        averager.apply_delta()
    figures = replica.epoch_figures(replica) \
        if plan.last_in_epoch and replica.epoch_figures is not None else None
    averager.pack(weight=plan.weights()[replica.rank],
                  stats=report.to_row() + (NO_FIGURES if figures is None else figures.to_row()),
                  keep_snapshot=True)
    replica.figures_in_flight = figures is not None
    if blocking:
        averager.all_reduce(async_op=False)
        rows, pending = _landed_rows(replica, averager), None
        rank_state.last_distance = averager.distance_from_average()
        averager.step_outer()
        averager.load_average()
    else:
        pending = averager.all_reduce(async_op=True)
    end = time.perf_counter()
    rank_state.after_sync((end - start) * 1000, blocking=blocking)
    reports = None if rows is None else [RoundReport.from_row(row[:NUM_REPORT]) for row in rows]
    _record_sync(replica, plan, start, end, reports, blocking=blocking)
    if rows is not None:  # the replica's weights moved: an average landed
        for hook in replica.after_average:
            hook()
    return reports, pending


def _landed_rows(replica: Replica, averager: Averager) -> list[list[float]]:
    """Every rank's stats row of the average that just completed; when it carried an epoch's
    figures, they are kept for the epoch's end (``replica.epoch_rows``)."""
    rows = averager.stats()
    if replica.figures_in_flight:
        replica.epoch_rows = [RankFigures.from_row(row[NUM_REPORT:]) for row in rows]
        replica.figures_in_flight = False
    return rows


def _chosen_policy(replica: Replica, state: PlanState, plan: RoundPlan) -> PlanState:
    """``auto``: the policy the calibrated speeds and the averages' costs pick
    (fdl.engine.plan.auto_choice, alike on every rank), from the next round on: the replica's
    config and the plan's state change, the run's hook (fdl.engine.loop) rebuilds what the
    policy needs (DDP or the gradient all-reduce for sync, async's snapshot) and the timeline
    logs it. Unusable figures leave the choice for the next boundary."""
    choice = auto_choice(state)
    if choice is None:
        return state
    replica.config = replace(replica.config, policy=choice.policy)
    if replica.on_policy is not None:
        replica.on_policy(replica, choice)
    replica.timeline.event("policy", round=plan.round_index, **choice.to_dict())
    return with_policy(state, choice.policy, reason=f"policy auto: {choice.policy.name}")


def _record_sync(replica: Replica, plan: RoundPlan, start: float, end: float,
                 reports: list[RoundReport] | None, *, blocking: bool) -> None:
    totals = replica.totals
    totals.wait_s += end - start
    totals.syncs += 1
    if reports is not None:
        sync_ms = round_stats(reports).sync_ms
        if math.isfinite(sync_ms):
            totals.comm_ms.append(sync_ms)
    event: dict[str, Any] = {"round": plan.round_index, "start": start, "end": end,
                             "wait_s": end - start, "blocking": blocking,
                             "bytes": replica.averager.bytes if replica.averager else 0}
    if replica.verify and blocking:
        event["checksum"] = checksum(replica.model)
    replica.timeline.event("sync", **event)


def _guarded(replica: Replica, state: PlanState, plan: RoundPlan,
             reports: list[RoundReport]) -> PlanState:
    """Let the divergence guard (fdl.engine.guard) judge the largest replica distance the ranks
    reported — the same on every rank, so every rank acts alike — and log what it saw."""
    distance = largest_distance(reports) if reports else NO_DISTANCE
    if distance == NO_DISTANCE or not replica.policy.local_steps or replica.world_size == 1:
        return state
    before = state.anchor
    state, verdict = guard.observe(replica.rank_state.guard, state, distance=distance,
                                   lr_scale=replica.lr_scale, steps=plan.anchor,
                                   threshold=replica.config.divergence_threshold)
    replica.timeline.event("guard", round=plan.round_index, distance=distance,
                          level=verdict.level, streak=verdict.streak, halve=verdict.halved,
                          released=verdict.released)
    if verdict.halved and state.anchor != before:  # at anchor 1 it can only hold the ceiling
        replica.timeline.event("anchor", round=plan.round_index, anchor=state.anchor,
                              previous=before, reason="divergence guard")
    return state


def _checkpoint_due(replica: Replica, plan: RoundPlan, reports: list[RoundReport]) -> bool:
    """Whether a checkpoint follows ``plan``'s average (async then waits for it): one every
    ``N`` epochs at an epoch's end, or a time-based one the ranks' last reports say is due."""
    checkpointer = replica.checkpointer
    if checkpointer is None:
        return False
    if plan.last_in_epoch:
        return checkpointer.due_at_epoch_end(plan.epoch + 1, reports)
    return checkpointer.due_within_epoch(reports)


def _evaluation_due(replica: Replica, plan: RoundPlan, state: PlanState) -> bool:
    """Whether ``plan`` crosses a multiple of ``evaluate_every`` samples (the same on every
    rank: it is the plan's). An epoch's end evaluates anyway."""
    every = replica.evaluate_every
    if every is None or plan.last_in_epoch:
        return False
    return (state.samples_seen + plan.num_samples) // every > state.samples_seen // every


def _within_time(replica: Replica, state: PlanState, plan: RoundPlan,
                 reports: list[RoundReport] | None) -> PlanState:
    """``max_time``: once the ranks' training clocks (the largest, from the reports every rank
    holds alike; under sync, which exchanges no reports mid-epoch, from a sum every
    ``SYNC_CLOCK_ROUNDS`` rounds) pass it, the next round is the run's last: the sample budget
    is cut at its end, so it ends an epoch with a blocking average, like any last round."""
    limit = replica.config.max_time
    if limit is None or state.finished or replica.time_up:
        return state
    if not reports:
        if plan.round_index % SYNC_CLOCK_ROUNDS:
            return state
        elapsed = all_reduce_max(replica.elapsed_s(), world_size=replica.world_size,
                                 device=replica.device)
    else:
        elapsed = max(r.elapsed_s for r in reports)
    if elapsed < limit:
        return state
    replica.time_up = True
    replica.timeline.event("budget", round=plan.round_index, elapsed_s=elapsed,
                           reason=f"max_time {limit:g}s reached: the next round is the last")
    return cut_after_next_round(state)


def final_consensus(replica: Replica, pending: Any) -> None:
    """The run's final average is its last round's blocking one (every policy blocks there):
    nothing may still be in flight, no epoch's end wait for one, and every rank now holds the
    same model."""
    if pending is not None or replica.epoch_in_flight is not None:
        raise AssertionError("an average was still in flight after the last round")
