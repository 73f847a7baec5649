"""The round loop: every rank runs its share of each round, then the round's boundary.

::

    state = yield from rounds(parts, state, boundary)   # every round, until the last epoch ends

One round, on every rank alike:

1. ``plan = next_round(state)``: the same plan everywhere (fdl.engine.plan).
2. :func:`run_slice` runs this rank's steps on its slice of the epoch's stream
   (fdl.engine.feed), then its part of the round's shared pool, timing each *whole* step
   (fetching and collating the batch, the host-to-device copy, the LR call, forward, backward,
   optimizer step): what the planner must balance is all of it. A step is ``accumulate``
   batches and ends on an optimizer step (fdl.engine.steps); the script's code between two
   batches is the step. Under ``sync`` the time a step spends in the gradient all-reduce
   (fdl.engine.grad_sync) is booked apart, as sync; the slowdown emulation sleeps on the rest
   (fdl.engine.speed). The rank's report closes the slice.
3. The boundary (fdl.engine.boundary): the average, the plan's next state, the guard, the
   epoch's end, the checkpoints.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from fdl.engine.boundary import Boundary, SliceResult
from fdl.engine.data import to_device
from fdl.engine.feed import StepSamples
from fdl.engine.parts import Parts
from fdl.engine.plan import (
    PlanState,
    RoundPlan,
    RoundStats,
    advance,
    next_round,
    pool_chunk,
    pool_share,
)
from fdl.engine.round_messages import ElasticSignal, SharedPool
from fdl.engine.speed import RunningMean, StepTimer
from fdl.engine.state import RoundReport


def rounds(parts: Parts, state: PlanState,
           boundary: Boundary) -> Generator[Any, None, PlanState]:
    """Every round of the plan, as the batches this rank trains on (on its device); the
    caller's code between two batches is the step. Returns the finished state."""
    while not state.finished:
        plan = parts.tallies.round_plan = next_round(state)
        done = yield from run_slice(parts, plan, state)
        _foresee(parts, plan, state, done)
        state = boundary.close(parts, plan, state, done)
    boundary.final_consensus()
    return state


def unequal_steps(parts: Parts) -> str | None:
    """Why a collective in a step cannot pair up now (fdl.engine.user_collectives), or None:
    alone, and under sync in a round cut evenly, every rank's steps meet. Sync's round that
    ends an epoch whose batches do not split evenly gives a rank one step fewer (it joins the
    gradient all-reduce, as torch's join does, but a collective of the script's is left
    alone)."""
    if parts.world_size == 1:
        return None
    policy = parts.config.policy
    if policy.local_steps:
        return (f"--policy {policy.name} trains (its ranks take different numbers of "
                f"steps between averages)")
    plan = parts.tallies.round_plan
    if plan is not None and len({piece.steps for piece in plan.slices}) > 1:
        steps = ", ".join(str(piece.steps) for piece in plan.slices)
        return (f"this round of --policy {policy.name} is cut unevenly (its ranks take "
                f"{steps} steps: the epoch's batches do not split evenly)")
    return None


def run_slice(parts: Parts, plan: RoundPlan,
              state: PlanState) -> Generator[Any, None, SliceResult]:
    """This rank's part of the round: its own steps (:func:`_own_steps`), then the shared
    pool's, if the round has one (:func:`_pool_steps`), then its report
    (:func:`_close_slice`). In the calibration round the run's very first step (allocations,
    lazy initialisation) is timed apart and left out of the report, so it does not pass for
    the rank's speed."""
    tally = RoundTally.open(parts)
    elastic_used = yield from _own_steps(parts, plan, state, tally)
    pool_used = yield from _pool_steps(parts, plan, state, tally)
    return SliceResult(_close_slice(parts, plan, tally), elastic_used, pool_used)


@dataclass
class RoundTally:
    """What one round's steps add up to on this rank while they run: the step timers, the
    samples their time covers and the time spent fetching batches (the scalars the script
    logs are summed on the device in ``Tallies.logged`` and read once, after the round)."""

    timer: StepTimer  # the timed steps; their running mean drives the slowdown emulation
    warmup: StepTimer  # the run's very first step, timed apart and never slowed (see open)
    mean: RunningMean
    started: float = field(default_factory=time.perf_counter)
    timed_samples: int = 0
    data_s: float = 0.0
    pool_samples: int = 0  # positions taken from the round's shared pool
    went_on: bool = False  # the slice's batches came from the pass started at the last boundary

    @classmethod
    def open(cls, parts: Parts) -> RoundTally:
        """The round's timers. The warm-up one is not slowed: what makes a run's first step
        slow is mostly once-only host work (torch.compile's compilation, allocations) that a
        slower device does not make slower (docs/elche.md "Slowdown emulation")."""
        tallies, device, sync = parts.tallies, parts.device, parts.replica.sync
        rank_state, mean = tallies.rank_state, tallies.compute_mean
        if mean is None or mean.count != rank_state.step_count:  # a start, a resume
            mean = RunningMean(rank_state.step_count, rank_state.step_total_s)
            tallies.compute_mean = mean
        return cls(timer=StepTimer(slowdown=tallies.slowdown, mean=mean, device=device,
                                   comm=sync, owed_s=tallies.sleep_owed_s),
                   warmup=StepTimer(device=device, comm=sync), mean=mean)

    @property
    def steps(self) -> int:
        return self.timer.steps + self.warmup.steps


def _own_steps(parts: Parts, plan: RoundPlan, state: PlanState,
               tally: RoundTally) -> Generator[Any, None, int | None]:
    """The rank's planned steps on its slice of the epoch's stream; the elastic rank stops
    early once the slowest rank has posted that it is done. Returns the samples the elastic
    rank used (None: the round is not elastic)."""
    rank, feed, sync = parts.rank, parts.feed, parts.replica.sync
    mine = plan.slices[rank]
    steps = feed.steps(plan.epoch, mine.start, mine.stop)
    fetch = feed.fetcher(steps)
    tally.went_on = feed.went_on
    warm_first = plan.calibration and state.samples_seen == 0
    sliced = plan.pool_start - state.position  # the slices' positions: a pool's come after
    signal = ElasticSignal.open(plan, rank=rank)
    with sync.uneven([piece.steps for piece in plan.slices], rank=rank):
        for index, samples in enumerate(steps):
            if index and signal.arrived(plan):
                break
            sync.before_step(ranks_with_data=sum(s.steps > index for s in plan.slices))
            yield from _timed_step(parts, plan, state, tally, fetch, samples,
                                   progress=state.samples_seen + sliced * index
                                   / max(1, mine.steps), warm=warm_first and index == 0)
    return signal.close(plan, rank=rank, used=tally.timed_samples)


def _pool_steps(parts: Parts, plan: RoundPlan, state: PlanState,
                tally: RoundTally) -> Generator[Any, None, int | None]:
    """Whole steps of the round's shared pool after the rank's own steps: the calibration
    round's until every rank is done, the epoch's last round's until it is empty (its last
    step maybe partial); returns how many the ranks took (None: no pool)."""
    feed, rank = parts.feed, parts.rank
    order = feed.order(plan.epoch)
    workers = feed.uses_workers
    chunk = pool_chunk(state, rank)
    if workers:  # a pass of the loader's workers per take: enough batches to keep them busy
        assert feed.data is not None
        chunk = max(chunk, feed.data.num_workers)
    pool = SharedPool.open(plan, world_size=parts.world_size, chunk=chunk,
                           share=pool_share(state, rank))
    while taken := pool.take():
        steps = []
        for j in taken:
            low = plan.pool_start + j * feed.step_size
            high = min(low + feed.step_size, plan.pool_stop)
            steps.append((low, high, feed.step_samples(order, low, high)))
        # the calibration pool's single steps are made here; a drained pool's, by the workers
        fetch = feed.fetcher([s for _, _, s in steps]) if workers and plan.drains else None
        for low, high, samples in steps:
            yield from _timed_step(parts, plan, state, tally,
                                   fetch or feed.one_fetcher(samples), samples,
                                   progress=state.samples_seen + low - state.position,
                                   warm=False)
            tally.pool_samples += high - low
    return pool.close()


def _timed_step(parts: Parts, plan: RoundPlan, state: PlanState, tally: RoundTally,
                fetch: Callable[[], Any], samples: StepSamples, *,
                progress: float, warm: bool) -> Generator[Any, None, None]:
    """One whole optimizer step on ``samples``, timed as the planner must balance it:
    fetching and collating its batches (``fetch()`` each), the host-to-device copies, and
    the caller's code for each (forward, backward, the optimizer step). With ``accumulate``
    k the step is k batches, and the step must end on the optimizer's step: a round never
    ends between the batches of one."""
    feed, replica, tallies = parts.feed, parts.replica, parts.tallies
    count_parts = feed.accumulate
    if isinstance(samples, int):  # a stream: whole batches
        count = count_parts * feed.batch_size if samples >= count_parts else 0
    else:
        count = sum(len(chunk) for chunk in samples)
    if not count:  # an epoch's last few samples, too few for a step of k batches
        replica.sync.empty_step()  # the others' all-reduce of this step, joined
        return
    if parts.progress is not None and not parts.progress.written:
        # the display says so while the first step lasts (a compilation: seconds to minutes)
        _show_progress(parts, plan, samples=progress, first_step=True)
    clock = tally.warmup if warm else tally.timer
    clock.start()
    tallies.position = progress
    if replica.scheduler is not None:  # the step's LR: the global steps before it
        replica.scheduler.advance(progress)
    for part in range(count_parts):
        fetched = time.perf_counter()
        batch = to_device(fetch(), parts.device)
        tally.data_s += time.perf_counter() - fetched
        if part == count_parts - 1:
            replica.sync.last_batch()  # a loop's sync: reduce after the last
        yield batch
        replica.steps.check(after=part + 1, of=count_parts)
    clock.stop()
    if not warm:
        tally.timed_samples += count
    if parts.progress is not None and parts.progress.due():
        mine = plan.slices[parts.rank]
        _show_progress(parts, plan, samples=min(
            progress + plan.num_samples / max(1, mine.steps),
            state.samples_seen + plan.num_samples))


def _close_slice(parts: Parts, plan: RoundPlan, tally: RoundTally) -> RoundReport:
    """Read the round's loss and step times (the one wait for the device per round), book the
    round and build the rank's report."""
    tallies, timer = parts.tallies, tally.timer
    rank_state = tallies.rank_state
    means = tallies.logged.read()
    loss = means.get("loss")
    if loss is not None:  # the epoch's loss: a sum over steps (a script may log none)
        rank_state.epoch_loss[0] += loss * tally.steps
        rank_state.epoch_loss[1] += tally.steps
    if parts.progress is not None and loss is not None:
        parts.progress.loss = loss
    if means:
        parts.timeline.event("scalars", round=plan.round_index, values=means)
        parts.recorder.scalars(means, position=tallies.position)
    tallies.lr_scale = parts.replica.lr_scale()
    timer.finish()
    tally.warmup.finish()
    rank_state.step_count, rank_state.step_total_s = tally.mean.count, tally.mean.total
    tallies.sleep_owed_s = timer.owed_s
    mine = plan.slices[parts.rank]
    used = mine.num_samples if plan.elastic != parts.rank else tally.timed_samples
    _book_round(parts, plan, used + tally.pool_samples, tally,
                compute_s=time.perf_counter() - tally.started)
    checkpointer = parts.checkpointer
    since = checkpointer.since_last_s() if checkpointer is not None else 0.0
    return rank_state.report(busy_ms=timer.busy_s * 1000 if timer.steps else math.nan,
                             samples=tally.timed_samples if timer.steps else 0,
                             since_checkpoint_s=since, elapsed_s=tallies.elapsed_s())


def _show_progress(parts: Parts, plan: RoundPlan, *, samples: float,
                   first_step: bool = False) -> None:
    assert parts.progress is not None
    figures = parts.tallies.totals.figures
    sliced = [s.num_samples for s in plan.slices]  # the planned split (a pool is anyone's)
    shares = [n / sum(sliced) for n in sliced] if sum(sliced) else \
        [1 / len(sliced)] * len(sliced)
    parts.progress.write(samples=samples, epoch=plan.epoch, shares=shares,
                         anchor=plan.anchor, sync_s=figures.wait_s + figures.comm_s,
                         busy_s=figures.busy_s, data_s=figures.data_s, first_step=first_step)


def _book_round(parts: Parts, plan: RoundPlan, used: int, tally: RoundTally, *,
                compute_s: float) -> None:
    totals, timer, warmup = parts.tallies.totals, tally.timer, tally.warmup
    totals.add(samples=used, busy_s=timer.busy_s + warmup.busy_s,
               sleep_s=timer.sleep_s + warmup.sleep_s, comm_s=timer.comm_s + warmup.comm_s,
               data_s=tally.data_s)
    totals.steps += tally.steps
    parts.timeline.event("round", round=plan.round_index, epoch=plan.epoch, steps=tally.steps,
                         samples=used, planned=plan.slices[parts.rank].num_samples,
                         compute_s=compute_s, data_s=tally.data_s,
                         busy_s=timer.busy_s + warmup.busy_s, step_ms=timer.step_ms,
                         sleep_s=timer.sleep_s + warmup.sleep_s,
                         comm_s=timer.comm_s + warmup.comm_s, anchor=plan.anchor,
                         lr_scale=parts.tallies.lr_scale, fetched_ahead=tally.went_on)


def _foresee(parts: Parts, plan: RoundPlan, state: PlanState, done: SliceResult) -> None:
    """Hand the loader's workers this rank's slice of the next round as the plan foresees it
    now, before the boundary (its average, an epoch's end), so they fetch its first batches
    meanwhile (fdl.engine.batch_loader). What the round used is known on every rank by now,
    so the next round's first position is exact; the ranks' shares are foreseen from the
    speeds before this round's (``RoundStats.unknown``): the rank whose slice comes first
    foresees right unless the average changes which rank that is, the others as long as it
    leaves the split alone. A wrong foresight costs the batches fetched meanwhile, never a
    wrong batch: the loader checks."""
    if not parts.feed.uses_workers:
        return
    foreseen = advance(state, plan, RoundStats.unknown(parts.world_size),
                       elastic_used=done.elastic_used, pool_used=done.pool_used)
    if foreseen.finished:
        return
    next_plan = next_round(foreseen)
    mine = next_plan.slices[parts.rank]
    parts.feed.foresee(next_plan.epoch, mine.start, mine.stop)
