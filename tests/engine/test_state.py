"""fdl.engine.state: a round's report as a row of the averaging collective, the planner's view
of a round, the guard's input, how an average's cost is booked, and a rank's state as
checkpoint data (read back as untrusted input)."""

from __future__ import annotations

import io
import math

import pytest
import torch

from fdl.engine.plan import RoundStats
from fdl.engine.state import (
    NO_DISTANCE,
    REPORT_FIELDS,
    GuardState,
    RankFigures,
    RankState,
    RoundReport,
    largest_distance,
    round_stats,
)

NAN, INF = math.nan, math.inf


def report(*, busy_ms: float = 100.0, samples: int = 64, wait_ms: float = 5.0,
           distance: float = 0.01, since_checkpoint_s: float = 2.0,
           elapsed_s: float = 0.0) -> RoundReport:
    return RoundReport(busy_ms=busy_ms, samples=samples, wait_ms=wait_ms, distance=distance,
                       since_checkpoint_s=since_checkpoint_s, elapsed_s=elapsed_s)


# --- RankFigures <-> a row of floats ---------------------------------------------------------


def test_figures_cross_ranks_as_a_row_and_a_stretch_is_the_difference_of_two_marks():
    run = RankFigures(samples=640, busy_s=3.5, sleep_s=1.25, wait_s=0.5, loss_sum=12.0,
                      loss_steps=10)
    assert RankFigures.from_row(torch.tensor(run.to_row(), dtype=torch.float64).tolist()) == run
    mark = RankFigures(samples=128, busy_s=1.0, sleep_s=0.25, wait_s=0.125)
    assert run.minus(mark) == RankFigures(samples=512, busy_s=2.5, sleep_s=1.0, wait_s=0.375,
                                          loss_sum=12.0, loss_steps=10)
    with pytest.raises(ValueError):
        RankFigures.from_row([1.0, 2.0])


# --- RoundReport <-> a row of floats --------------------------------------------------------


def test_a_report_survives_its_row_and_the_float_buffer_it_travels_in():
    sent = report(busy_ms=123.25, samples=96, wait_ms=NAN, distance=NO_DISTANCE,
                  since_checkpoint_s=7.5, elapsed_s=61.5)
    row = sent.to_row()
    assert row == pytest.approx([123.25, 96.0, NAN, -1.0, 7.5, 61.5], nan_ok=True)
    assert len(row) == len(REPORT_FIELDS) and all(isinstance(x, float) for x in row)
    # through a float32 buffer, as the averaging collective carries it
    received = RoundReport.from_row(torch.tensor(row, dtype=torch.float32).tolist())
    assert received.samples == 96 and isinstance(received.samples, int)
    assert (received.busy_ms, received.distance, received.since_checkpoint_s,
            received.elapsed_s) == (123.25, -1.0, 7.5, 61.5)
    assert math.isnan(received.wait_ms)


def test_a_row_without_a_sample_count_reads_as_no_samples():
    received = RoundReport.from_row([NAN, NAN, NAN, NO_DISTANCE, 0.0, 0.0])
    assert received.samples == 0
    assert math.isnan(received.busy_ms)


def test_a_row_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError):
        RoundReport.from_row([1.0, 2.0, 3.0])
    with pytest.raises(ValueError):
        RoundReport.from_row([*report().to_row(), 0.0])


# --- round_stats: the planner's view -------------------------------------------------------


def test_round_stats_passes_each_rank_through_and_takes_the_smallest_wait():
    stats = round_stats([report(busy_ms=100.0, samples=64, wait_ms=9.0),
                         report(busy_ms=250.0, samples=32, wait_ms=4.0),
                         report(busy_ms=80.0, samples=0, wait_ms=6.5)])
    assert stats == RoundStats((100.0, 250.0, 80.0), (64, 32, 0), 4.0)


@pytest.mark.parametrize("unknown", [NAN, INF, -INF])
def test_round_stats_has_no_sync_time_unless_every_rank_measured_one(unknown):
    stats = round_stats([report(wait_ms=3.0), report(wait_ms=unknown)])
    assert math.isnan(stats.sync_ms)
    assert stats.busy_ms == (100.0, 100.0) and stats.samples == (64, 64)


# --- largest_distance: the guard's input ---------------------------------------------------


def test_largest_distance_is_the_largest_reported():
    assert largest_distance([report(distance=0.02), report(distance=0.5),
                             report(distance=0.1)]) == 0.5


def test_largest_distance_ignores_ranks_that_measured_none():
    assert largest_distance([report(distance=NO_DISTANCE), report(distance=0.03)]) == 0.03
    assert largest_distance([report(distance=NO_DISTANCE)] * 2) == NO_DISTANCE
    assert largest_distance([]) == NO_DISTANCE


@pytest.mark.parametrize("blown", [NAN, INF])
def test_a_replica_that_blew_up_is_infinitely_far(blown):
    assert largest_distance([report(distance=0.01), report(distance=blown)]) == INF
    assert largest_distance([report(distance=blown), report(distance=NO_DISTANCE)]) == INF


# --- RankState: what an average cost, and the report it feeds -------------------------------


def test_a_blocking_average_books_its_own_time():
    state = RankState()
    state.after_sync(12.0, blocking=True)
    assert (state.last_wait_ms, state.last_blocking_ms) == (12.0, 12.0)
    state.after_sync(3.0, blocking=True)  # a cheaper blocking one replaces it
    assert (state.last_wait_ms, state.last_blocking_ms) == (3.0, 3.0)


def test_a_background_average_costs_at_least_the_last_blocking_one():
    state = RankState()
    state.after_sync(10.0, blocking=True)
    state.after_sync(0.5, blocking=False)  # the host barely waited: the link still worked
    assert (state.last_wait_ms, state.last_blocking_ms) == (10.0, 10.0)
    state.after_sync(25.0, blocking=False)  # one that waited longer books what it waited
    assert (state.last_wait_ms, state.last_blocking_ms) == (25.0, 10.0)


def test_a_background_average_before_any_blocking_one_books_its_time():
    state = RankState()
    state.after_sync(0.5, blocking=False)
    assert state.last_wait_ms == 0.5


def test_the_report_carries_the_previous_average():
    state = RankState()
    first = state.report(busy_ms=50.0, samples=32, since_checkpoint_s=1.0)
    assert math.isnan(first.wait_ms) and first.distance == NO_DISTANCE
    state.after_sync(8.0, blocking=True)
    state.last_distance = 0.25
    later = state.report(busy_ms=60.0, samples=64, since_checkpoint_s=4.0)
    assert later == RoundReport(busy_ms=60.0, samples=64, wait_ms=8.0, distance=0.25,
                                since_checkpoint_s=4.0)


# --- RankState as checkpoint data -----------------------------------------------------------


def used_state() -> RankState:
    state = RankState(step_count=40, step_total_s=1.25, epoch_loss=[12.5, 40],
                      last_distance=0.03, last_blocking_ms=4.0,
                      guard=GuardState(baseline_sum=0.5, baseline_rounds=5, streak=2, calm=1))
    state.after_sync(6.0, blocking=False)
    return state


def through_a_checkpoint_file(data: dict) -> dict:
    """What recovery reads back: torch.save, then torch.load with weights_only=True."""
    buffer = io.BytesIO()
    torch.save(data, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_a_rank_state_survives_a_checkpoint_file():
    state = used_state()
    restored = RankState.from_dict(through_a_checkpoint_file(state.to_dict()))
    assert restored == state
    assert restored.guard == GuardState(baseline_sum=0.5, baseline_rounds=5, streak=2, calm=1)
    restored.guard.streak += 1  # a copy: the restored state is not the saved one's
    assert state.guard.streak == 2


def test_a_fresh_rank_state_survives_its_nans():
    restored = RankState.from_dict(through_a_checkpoint_file(RankState().to_dict()))
    assert math.isnan(restored.last_wait_ms)
    assert restored.last_distance == NO_DISTANCE and restored.guard == GuardState()


def with_changes(**changes) -> dict:
    return {**used_state().to_dict(), **changes}


def guard_with(**changes) -> dict:
    return with_changes(guard={**used_state().to_dict()["guard"], **changes})


@pytest.mark.parametrize("data", [
    [1, 2],
    "rank state",
    {},
    with_changes(guard_streak=0),  # a field of v1's checkpoints
    {k: v for k, v in used_state().to_dict().items() if k != "last_distance"},
    with_changes(guard=[0.0, 0, 0, 0]),
    guard_with(level=3.0),
    {**used_state().to_dict(), "guard": {"streak": 1}},
    with_changes(step_count="40"),
    with_changes(step_count=1.5),
    with_changes(step_count=-1),
    with_changes(step_count=True),
    with_changes(step_total_s="1.25"),
    with_changes(last_wait_ms=None),
    with_changes(last_distance=[0.1]),
    with_changes(epoch_loss=[1.0]),
    with_changes(epoch_loss=(1.0, 2)),
    with_changes(epoch_loss=["1.0", 2]),
    guard_with(streak=-3),
    guard_with(calm="2"),
    guard_with(baseline_rounds=5.0),
    guard_with(baseline_sum=None),
], ids=["list", "str", "empty", "extra-field", "missing-field", "guard-list", "guard-extra",
        "guard-missing", "count-str", "count-float", "count-negative", "count-bool",
        "total-str", "wait-none", "distance-list", "loss-short", "loss-tuple", "loss-str",
        "streak-negative", "calm-str", "baseline-rounds-float", "baseline-sum-none"])
def test_checkpoint_data_that_is_not_a_rank_state_is_refused(data):
    with pytest.raises(ValueError):
        RankState.from_dict(data)
