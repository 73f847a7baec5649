"""A round's boundary: what every rank does between its last step of one round and its first of
the next (fdl.engine.rounds runs the steps).

1. The average (:meth:`Boundary.average`), when the policy averages here. The rank's
   :class:`~fdl.engine.state.RoundReport` rides in the same collective as the weighted
   parameters (and, in an epoch's last average, its figures for the epoch). ``cadence`` waits
   for the average and loads it; ``async`` first collects the average it launched at the
   previous boundary (``theta += avg - snapshot``), then launches this one in the background
   and goes on; it blocks where one model is needed (fdl.engine.policies). ``sync`` trains
   through its gradient all-reduce and averages only its buffers, at epoch ends.
2. ``state = advance(state, plan, round_stats(reports))`` with the reports that arrived (under
   async: the previous round's); ``--policy auto``'s choice once its figures are in; the
   divergence guard (fdl.engine.guard); a time budget.
3. An evaluation within the epoch when one is due, the epoch's end (the recorder, on the
   consensus: under async when the epoch's average lands, a round later) and the checkpoints.
   A time-based checkpoint is decided from the ranks' clocks in the reports, so every rank
   decides alike without a message, and under async it makes the boundary blocking first.

The last round of the last epoch ends with a blocking average under every policy:
:meth:`Boundary.final_consensus` checks that nothing is in flight, so every rank holds the
model ``run.finish()`` returns.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

from fdl.engine import guard
from fdl.engine.averaging import Averager, checksum
from fdl.engine.collectives import all_reduce_max
from fdl.engine.evaluation import evaluation_due
from fdl.engine.parts import Parts
from fdl.engine.plan import (
    PlanState,
    RoundPlan,
    RoundStats,
    advance,
    auto_choice,
    cut_after_next_round,
    ends_run,
    with_policy,
)
from fdl.engine.policies import PolicyChoice
from fdl.engine.recorder import EpochEnd
from fdl.engine.state import (
    NO_DISTANCE,
    NO_FIGURES,
    NUM_REPORT,
    RankFigures,
    RoundReport,
    largest_distance,
    round_stats,
)

SYNC_CLOCK_ROUNDS = 16  # under sync with max_time, the ranks compare clocks this often


@dataclass(frozen=True)
class SliceResult:
    """What a rank's part of a round leaves for the boundary: its report, and the same on
    every rank, the samples the elastic rank used (an elastic round) and the batches taken
    from the pool (a round with one); None where the round has neither."""

    report: RoundReport
    elastic_used: int | None
    pool_used: int | None


@dataclass(eq=False)
class Boundary:
    """What the boundaries carry from one round to the next (see the module docstring)."""

    pending: Any = None  # async: the average launched at the last boundary, in flight
    epoch_in_flight: EpochEnd | None = None  # async: an epoch's end awaiting its average
    figures_in_flight: bool = False  # the average in flight (or just landed) carries them
    epoch_rows: list[RankFigures] | None = None  # every rank's, once that average landed
    last_reports: list[RoundReport] = field(default_factory=list)
    choice: PolicyChoice | None = None  # --policy auto's, once made

    def close(self, parts: Parts, plan: RoundPlan, state: PlanState,
              done: SliceResult) -> PlanState:
        """The boundary after ``plan`` (every rank alike); returns the state the next round
        is planned from."""
        policy, averager = parts.config.policy, parts.replica.averager
        reports: list[RoundReport] | None = None
        consensus = averager is None
        due = evaluation_due(parts.evaluate_every, plan, state)
        if averager is not None and policy.averages_at(plan):
            consensus = policy.blocking(
                plan, checkpoint_due=self._checkpoint_due(parts, plan) or due,
                ends_run=ends_run(state, plan))
            reports = self.average(parts, plan, done.report, blocking=consensus)
        elif averager is None:
            reports = [done.report]
        stats = round_stats(reports) if reports else RoundStats.unknown(parts.world_size)
        advanced = advance(state, plan, stats, elastic_used=done.elastic_used,
                           pool_used=done.pool_used)
        if parts.replica.scheduler is not None:  # every rank's count alike at the round's end
            parts.replica.scheduler.advance(advanced.samples_seen)
        if advanced.anchor != state.anchor:
            parts.timeline.event("anchor", round=plan.round_index, anchor=advanced.anchor,
                                 previous=state.anchor, reason=advanced.anchor_history[-1][2])
        if policy.decides and reports and not plan.calibration:
            advanced = self._chosen_policy(parts, advanced, plan)
        state = _guarded(parts, advanced, plan, reports or [])
        state = _within_time(parts, state, plan, reports)
        self.last_reports = reports or self.last_reports
        if due and not plan.last_in_epoch and (consensus or not policy.local_steps):
            parts.recorder.evaluate_now(parts.replica.model, state)  # sync: replicas alike
        if plan.last_in_epoch:
            self._epoch_ended(parts, plan, state, consensus=consensus)
        elif consensus and parts.checkpointer is not None and \
                parts.checkpointer.due_within_epoch(self.last_reports):
            parts.checkpointer.at_round(state, parts.saving())
            self.last_reports = []
        return state

    def _epoch_ended(self, parts: Parts, plan: RoundPlan, state: PlanState, *,
                     consensus: bool) -> None:
        ending = parts.recorder.end_epoch(plan.epoch, state, parts.tallies,
                                          averaged=parts.replica.averager is not None)
        if not consensus:  # async runs on: the epoch ends on its consensus when it lands
            self.epoch_in_flight = ending
            return
        self._close_epoch(parts, ending)
        if parts.checkpointer is not None and not state.finished:
            parts.checkpointer.at_epoch_end(state, parts.saving())

    def _close_epoch(self, parts: Parts, ending: EpochEnd) -> None:
        rows, self.epoch_rows = self.epoch_rows, None
        parts.recorder.close_epoch(ending, rows, model=parts.replica.model,
                                   device=parts.device, hooks=parts.script)

    def average(self, parts: Parts, plan: RoundPlan, report: RoundReport, *,
                blocking: bool) -> list[RoundReport] | None:
        """One averaging event; returns the reports that arrived (None: the first background
        average, nothing has arrived yet). The time from the first copy to the last (pack,
        reduce or wait, load or apply) is what the average cost this rank
        (RankState.after_sync books it), less an epoch's end that waited for the average that
        landed here (async): its evaluation is not what the link costs, and the anchor tuner
        would grow the rounds for it."""
        averager, rank_state = parts.replica.averager, parts.tallies.rank_state
        assert averager is not None
        averager.check_unchanged(parts.replica.model)
        start = time.perf_counter()
        rows = None
        if self.pending is not None:  # async: the average launched at the last boundary
            self.pending.wait()
            rows = self._landed_rows(averager)
            rank_state.last_distance = averager.distance_from_average()
            averager.step_outer()
            if self.epoch_in_flight is not None:  # an epoch's end: this is its consensus
                begin = time.perf_counter()
                with averager.average_loaded():
                    self._close_epoch(parts, self.epoch_in_flight)
                self.epoch_in_flight = None
                start += time.perf_counter() - begin  # the evaluation is no average's cost
            averager.apply_delta()
        figures = parts.recorder.figures(parts.tallies) if plan.last_in_epoch else None
        averager.pack(weight=plan.weights()[parts.rank],
                      stats=report.to_row() + (NO_FIGURES if figures is None
                                               else figures.to_row()),
                      keep_snapshot=True)
        self.figures_in_flight = figures is not None
        if blocking:
            averager.all_reduce(async_op=False)
            rows, self.pending = self._landed_rows(averager), None
            rank_state.last_distance = averager.distance_from_average()
            averager.step_outer()
            averager.load_average()
        else:
            self.pending = averager.all_reduce(async_op=True)
        end = time.perf_counter()
        rank_state.after_sync((end - start) * 1000, blocking=blocking)
        reports = None if rows is None else [RoundReport.from_row(row[:NUM_REPORT])
                                             for row in rows]
        _record_sync(parts, plan, start, end, reports, blocking=blocking)
        if rows is not None:  # the replica's weights moved: an average landed
            parts.script.averaged()
        return reports

    def final_consensus(self) -> None:
        """The run's final average is its last round's blocking one (every policy blocks
        there): nothing may still be in flight, no epoch's end wait for one, and every rank
        now holds the same model."""
        if self.pending is not None or self.epoch_in_flight is not None:
            raise AssertionError("an average was still in flight after the last round")

    def _landed_rows(self, averager: Averager) -> list[list[float]]:
        """Every rank's stats row of the average that just completed; when it carried an
        epoch's figures, they are kept for the epoch's end."""
        rows = averager.stats()
        if self.figures_in_flight:
            self.epoch_rows = [RankFigures.from_row(row[NUM_REPORT:]) for row in rows]
            self.figures_in_flight = False
        return rows

    def _checkpoint_due(self, parts: Parts, plan: RoundPlan) -> bool:
        """Whether a checkpoint follows ``plan``'s average (async then waits for it): one
        every ``N`` epochs at an epoch's end, or a time-based one the ranks' last reports say
        is due."""
        checkpointer = parts.checkpointer
        if checkpointer is None:
            return False
        if plan.last_in_epoch:
            return checkpointer.due_at_epoch_end(plan.epoch + 1, self.last_reports)
        return checkpointer.due_within_epoch(self.last_reports)

    def _chosen_policy(self, parts: Parts, state: PlanState, plan: RoundPlan) -> PlanState:
        """``auto``: the policy the calibrated speeds and the averages' costs pick
        (fdl.engine.plan.auto_choice, alike on every rank), from the next round on: the run's
        config and the plan's state change, the replica binds what the policy needs (the
        gradient all-reduce for sync, async's snapshot) and the timeline logs it. Unusable
        figures leave the choice for the next boundary."""
        choice = auto_choice(state)
        if choice is None:
            return state
        self.choice = choice
        parts.config = replace(parts.config, policy=choice.policy)
        parts.replica.adopt(choice.policy)
        if parts.rank == 0:
            from fdl import console

            console.info(f"policy auto: {choice.policy.name}: {choice.reason}")
        parts.timeline.event("policy", round=plan.round_index, **choice.to_dict())
        return with_policy(state, choice.policy, reason=f"policy auto: {choice.policy.name}")


def _record_sync(parts: Parts, plan: RoundPlan, start: float, end: float,
                 reports: list[RoundReport] | None, *, blocking: bool) -> None:
    totals, averager = parts.tallies.totals, parts.replica.averager
    totals.add(wait_s=end - start)
    totals.syncs += 1
    if reports is not None:
        sync_ms = round_stats(reports).sync_ms
        if math.isfinite(sync_ms):
            totals.comm_ms.append(sync_ms)
    event: dict[str, Any] = {"round": plan.round_index, "start": start, "end": end,
                             "wait_s": end - start, "blocking": blocking,
                             "bytes": averager.bytes if averager is not None else 0}
    if parts.verify and blocking:
        event["checksum"] = checksum(parts.replica.model)
    parts.timeline.event("sync", **event)


def _guarded(parts: Parts, state: PlanState, plan: RoundPlan,
             reports: list[RoundReport]) -> PlanState:
    """Let the divergence guard (fdl.engine.guard) judge the largest replica distance the ranks
    reported — the same on every rank, so every rank acts alike — and log what it saw."""
    distance = largest_distance(reports) if reports else NO_DISTANCE
    if distance == NO_DISTANCE or not parts.config.policy.local_steps or parts.world_size == 1:
        return state
    before = state.anchor
    state, verdict = guard.observe(parts.tallies.rank_state.guard, state, distance=distance,
                                   lr_scale=parts.tallies.lr_scale, steps=plan.anchor,
                                   threshold=parts.config.divergence_threshold)
    parts.timeline.event("guard", round=plan.round_index, distance=distance,
                         level=verdict.level, streak=verdict.streak, halve=verdict.halved,
                         released=verdict.released)
    if verdict.halved and state.anchor != before:  # at anchor 1 it can only hold the ceiling
        parts.timeline.event("anchor", round=plan.round_index, anchor=state.anchor,
                             previous=before, reason="divergence guard")
    return state


def _within_time(parts: Parts, state: PlanState, plan: RoundPlan,
                 reports: list[RoundReport] | None) -> PlanState:
    """``max_time``: once the ranks' training clocks (the largest, from the reports every rank
    holds alike; under sync, which exchanges no reports mid-epoch, from a sum every
    ``SYNC_CLOCK_ROUNDS`` rounds) pass it, the next round is the run's last: the sample budget
    is cut at its end, so it ends an epoch with a blocking average, like any last round."""
    limit, tallies = parts.config.max_time, parts.tallies
    if limit is None or state.finished or tallies.time_up:
        return state
    if not reports:
        if plan.round_index % SYNC_CLOCK_ROUNDS:
            return state
        elapsed = all_reduce_max(tallies.elapsed_s(), world_size=parts.world_size,
                                 device=parts.device)
    else:
        elapsed = max(r.elapsed_s for r in reports)
    if elapsed < limit:
        return state
    tallies.time_up = True
    parts.timeline.event("budget", round=plan.round_index, elapsed_s=elapsed,
                         reason=f"max_time {limit:g}s reached: the next round is the last")
    return cut_after_next_round(state)
