"""El Che round planning: config, speed estimates, shares, calibration, elastic rounds, anchor
tuning and the divergence guard's levers, and whole runs as properties."""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fdl.engine.plan as plan_module
import fdl.engine.policies as policies_module
from fdl.engine.plan import (
    CALIBRATION_POOL,
    ELASTIC_CAP,
    SPEED_ALPHA,
    SPEED_CLIP,
    TAIL_MERGE,
    TAIL_POOL,
    PlanConfig,
    PlanConfigError,
    PlanState,
    RankSlice,
    RoundPlan,
    RoundStats,
    _cut_samples,
    advance,
    cut_after_next_round,
    epoch_size,
    halve_anchor,
    initial_state,
    next_round,
    pool_chunk,
    pool_share,
    pool_take,
    samples_budget,
    saved_state_problem,
    shares,
    solo_anchor,
    update_speed,
    with_ceiling,
)
from fdl.errors import UsageError

TARGET = 0.05  # the tests' overhead_target: batch 10 at 1 ms per sample makes wanted = 2 * sync_ms


def config(**overrides) -> PlanConfig:
    values = {"world_size": 2, "batch_size": 10, "dataset_size": 10_000, "epochs": 1,
              "overhead_target": TARGET}
    return PlanConfig(**(values | overrides))


def measured(*ms: float, n: int = 40, sync_ms: float = math.nan) -> RoundStats:
    """Every rank ran ``n`` samples at ``ms`` per sample; a NaN ``sync_ms`` leaves the anchor."""
    return RoundStats(busy_ms=tuple(m * n for m in ms), samples=(n,) * len(ms), sync_ms=sync_ms)


def calibrated(*ms: float, **overrides) -> PlanState:
    """The state before round 0 of a run whose speeds are already known."""
    return replace(initial_state(config(world_size=len(ms), **overrides)), ms_per_sample=ms)


def run_round(state: PlanState, stats: RoundStats, *, used: int | None = None) -> PlanState:
    """``advance`` past the state's next round; an elastic rank uses ``used`` samples (default:
    its whole reservation), no batch of a calibration pool is taken, an epoch's tail is."""
    plan = next_round(state)
    if plan.elastic is not None and used is None:
        used = plan.slices[plan.elastic].num_samples
    return drained(state, plan, stats, elastic_used=used)


def drained(state: PlanState, plan: RoundPlan, stats: RoundStats, **used: Any) -> PlanState:
    """``advance`` past ``plan``, its pool drained if it is an epoch's tail (none taken of a
    calibration pool unless ``pool_used`` says)."""
    if plan.pool and "pool_used" not in used:
        used["pool_used"] = plan.pool if plan.drains else 0
    return advance(state, plan, stats, **used)


# ---------------------------------------------------------------------------------------------
# PlanConfig validation


@pytest.mark.parametrize(("field", "value"), [
    ("world_size", 0),
    ("world_size", 1.5),
    ("batch_size", 0),
    ("batch_size", True),
    ("dataset_size", 19),
    ("epochs", 0),
    ("policy", "ddp"),
    ("calibration_steps", 0),
    ("calibration_steps", 2.0),
    ("min_anchor", 0),
    ("initial_anchor", 3),  # below the default min_anchor
    ("initial_anchor", 201),
    ("max_anchor", 3),
    ("overhead_target", 0),
    ("overhead_target", -0.1),
    ("overhead_target", math.inf),
    ("overhead_target", math.nan),
    ("overhead_target", True),
    ("dead_zone", -0.1),
    ("dead_zone", 1.0),
    ("dead_zone", "0.1"),
    ("max_samples", 0),
    ("max_samples", 19),  # below world_size * batch_size, as dataset_size
    ("max_samples", 100.0),
    ("max_samples", True),
])
def test_config_rejects_bad_field_naming_it(field, value):
    with pytest.raises(ValueError, match=rf"^{field} = {re.escape(repr(value))} is not allowed"):
        config(**{field: value})


def test_config_error_is_a_usage_error_naming_what_is_allowed():
    with pytest.raises(UsageError) as info:
        config(dataset_size=19)
    assert isinstance(info.value, PlanConfigError)
    assert info.value.exit_code == 2
    assert "world_size * batch_size" in str(info.value) and ">= 20" in str(info.value)


def test_config_accepts_the_edges():
    config(dataset_size=20, min_anchor=1, initial_anchor=1, max_anchor=1, dead_zone=0.0,
           calibration_steps=1)
    config(world_size=1, batch_size=1, dataset_size=1, policy="sync")


def test_min_anchor_defaults_to_4():
    assert PlanConfig(world_size=1, batch_size=1, dataset_size=1, epochs=1).min_anchor == 4


def test_min_anchor_above_max_names_max_anchor():
    with pytest.raises(ValueError, match=r"^max_anchor = 4 .* >= 5"):
        config(min_anchor=5, initial_anchor=5, max_anchor=4)


# ---------------------------------------------------------------------------------------------
# update_speed


def test_first_measurement_is_taken_raw():
    assert update_speed(None, 0.42) == 0.42
    assert update_speed(None, 0.42, weight=0.1) == 0.42


def test_a_full_round_moves_the_estimate_by_alpha():
    assert 0.5 <= SPEED_ALPHA <= 1.0  # a full round's mean is followed closely
    assert update_speed(1.0, 1.5) == pytest.approx(1.0 + SPEED_ALPHA * 0.5)
    assert update_speed(1.0, 0.8) == pytest.approx(1.0 - SPEED_ALPHA * 0.2)
    assert update_speed(1.0, 1.0) == 1.0


def test_a_partial_round_moves_it_in_proportion_and_weight_is_clamped():
    assert update_speed(1.0, 1.5, weight=0.1) == pytest.approx(1.0 + 0.1 * SPEED_ALPHA * 0.5)
    assert update_speed(1.0, 1.5, weight=3.0) == update_speed(1.0, 1.5)
    assert update_speed(1.0, 1.5, weight=-1.0) == 1.0
    assert update_speed(1.0, 1.5, weight=0.0) == 1.0


def test_an_outlier_is_clipped_to_a_factor_of_the_estimate():
    assert SPEED_CLIP > 1
    assert update_speed(1.0, 1000.0) == pytest.approx(1.0 + SPEED_ALPHA * (SPEED_CLIP - 1))
    assert update_speed(1.0, 1e-6) == pytest.approx(1.0 + SPEED_ALPHA * (1 / SPEED_CLIP - 1))


@pytest.mark.parametrize(("old", "new"), [(None, 0.0), (None, math.nan), (None, -1.0),
                                          (None, math.inf), (1.0, 0.0), (0.0, 1.0),
                                          (math.nan, 1.0), (math.inf, 1.0), (-1.0, 1.0)])
def test_update_speed_rejects_unusable_values(old, new):
    with pytest.raises(ValueError, match="update_speed"):
        update_speed(old, new)


# ---------------------------------------------------------------------------------------------
# shares


def share(anchor, ms, prev=None, dead_zone=0.01, batch_size=10):
    return shares(anchor=anchor, batch_size=batch_size, ms_per_sample=ms, prev=prev,
                  dead_zone=dead_zone)


def test_the_slowest_rank_runs_anchor_batches_the_others_as_many_samples_in_that_time():
    assert share(4, [0.4, 1.0]) == (100, 40)
    assert share(4, [1.0, 0.4, 0.5]) == (40, 100, 80)


def test_shares_are_whole_batches_rounded_half_up():
    # A partial batch in every round could be one sample, which BatchNorm refuses in training.
    assert share(4, [0.3, 1.0]) == (130, 40)  # 133.3 samples: 13.3 batches, not 133 samples
    assert share(4, [0.28, 1.0]) == (140, 40)  # 142.9 samples: 14.3 batches
    assert share(4, [0.26, 1.0]) == (150, 40)  # 153.8 samples: 15.4 batches, not 160
    assert share(4, [0.22, 1.0]) == (180, 40)  # 181.8 samples: 18.2 batches, not 190


def test_shares_round_half_up():
    assert share(1, [2.0, 5.0], batch_size=1) == (3, 1)  # 2.5 samples -> 3
    assert share(1, [2.0, 5.0], batch_size=2) == (6, 2)  # 5 samples, 2.5 batches -> 3
    assert share(1, [2.0, 4.5], batch_size=2) == (4, 2)  # 4.5 samples, 2.25 batches -> 2


def test_unmeasured_ranks_count_as_the_slowest_known():
    assert share(4, [None, None]) == (40, 40)
    assert share(4, [None, 0.5, 1.0]) == (40, 80, 40)
    assert share(4, [0.25, None]) == (40, 40)


def test_dead_zone_keeps_shares_when_speeds_wiggle_less_than_it():
    # 0.4 -> 0.398 ms: the ideal share 1005.03 (100.5 batches, rounding up to 1010) is within
    # 1% of 1000, so 1000 stays.
    assert share(40, [0.398, 1.0], prev=(1000, 400)) == (1000, 400)
    assert share(40, [0.398, 1.0], prev=(1000, 400), dead_zone=0.0) == (1010, 400)
    # 0.4 -> 0.403 ms: the ideal 99.26 rounds to the same 10 batches, dead zone or not.
    assert share(4, [0.403, 1.0], prev=(100, 40), dead_zone=0.0) == (100, 40)


def test_dead_zone_is_strict_and_gives_way_to_a_real_change():
    # ideal 990.0 (99 batches) and 1010.0 (101 batches): exactly 1% off 1000
    assert share(40, [400.0, 990.0], prev=(1000, 400)) == (990, 400)
    assert share(40, [400.0, 1010.0], prev=(1000, 400)) == (1010, 400)
    assert share(40, [400.0, 990.0], prev=(1000, 400), dead_zone=0.0101) == (1000, 400)
    assert share(4, [0.5, 1.0], prev=(100, 40)) == (80, 40)


def test_dead_zone_is_off_when_the_anchor_changed_or_the_world_did():
    # prev was planned with anchor 4 (its smallest share is 40); with anchor 5 it is recomputed
    # (125 samples: 12.5 batches, rounding up to 13).
    assert share(5, [0.4, 1.0], prev=(100, 40), dead_zone=0.5) == (130, 50)
    assert share(4, [0.4, 1.0, 1.0], prev=(100, 40), dead_zone=0.5) == (100, 40, 40)


@pytest.mark.parametrize("ms", [[0.0, 1.0], [math.nan, 1.0], [-1.0, None], [math.inf, 1.0]])
def test_shares_reject_bad_speeds(ms):
    with pytest.raises(ValueError, match="ms_per_sample"):
        share(4, ms)


def test_shares_reject_an_anchor_below_one():
    with pytest.raises(ValueError, match="anchor"):
        share(0, [1.0, 1.0])


# ---------------------------------------------------------------------------------------------
# next_round: calibration, elastic rounds, epoch ends, sync


def test_initial_state():
    state = initial_state(config(world_size=3, dataset_size=100))
    assert (state.round_index, state.epoch, state.position, state.anchor) == (0, 0, 0, 4)
    assert state.ms_per_sample == (None, None, None) and not state.calibrated
    assert (state.anchor_history, state.prev_shares, state.ceiling) == ((), None, None)
    assert not state.finished and state.samples_seen == 0


def test_calibration_round_gives_every_rank_calibration_steps_batches_in_rank_order():
    plan = next_round(initial_state(config(calibration_steps=3)))
    assert plan == RoundPlan(round_index=0, epoch=0, anchor=4, counts=(3, 3), slices=(
        RankSlice(0, 3, 0, 30), RankSlice(1, 3, 30, 60)), last_in_epoch=False, calibration=True,
        pool=CALIBRATION_POOL * 3, pool_stop=60 + CALIBRATION_POOL * 3 * 10)
    assert plan.num_samples == 60 and plan.weights() == (0.5, 0.5) and plan.pool_start == 60


@pytest.mark.parametrize("taken", [0, 1, CALIBRATION_POOL * 2])
def test_calibration_round_advances_by_the_pool_batches_taken(taken):
    state = initial_state(config())
    plan = next_round(state)
    assert plan.pool == CALIBRATION_POOL * 2 and plan.pool_start == 40
    after = advance(state, plan, measured(1.0, 1.0), pool_used=taken)
    assert after.position == 40 + 10 * taken and after.calibrated
    assert min(s.start for s in next_round(after).slices) == 40 + 10 * taken


@pytest.mark.parametrize("taken", [None, -1, CALIBRATION_POOL * 2 + 1])
def test_advance_refuses_a_pool_count_that_cannot_be(taken):
    state = initial_state(config())
    with pytest.raises(ValueError, match="pool"):
        advance(state, next_round(state), measured(1.0, 1.0), pool_used=taken)
    state = calibrated(1.0, 1.0)
    with pytest.raises(ValueError, match="without a pool"):
        advance(state, next_round(state), measured(1.0, 1.0), elastic_used=10, pool_used=2)


@pytest.mark.parametrize(("state", "pool"), [
    (initial_state(config(world_size=3, calibration_steps=2)), CALIBRATION_POOL * 2 * 2),
    (initial_state(config(policy="async")), CALIBRATION_POOL * 2),
    (initial_state(config(world_size=1)), 0),  # no one to wait for
    (initial_state(config(policy="sync")), 0),  # no calibration
    (calibrated(1.0, 1.0), 0),  # speeds known
    (initial_state(config(dataset_size=75)), 3),  # 35 past the slices: 3 whole batches short
    (initial_state(config(dataset_size=41)), 0),  # of the end, none when one would reach it
])
def test_calibration_pool_size(state, pool):
    plan = next_round(state)
    assert plan.pool == pool
    if pool:
        assert not plan.last_in_epoch
        assert plan.pool_start + pool * 10 < state.config.dataset_size


def test_calibration_lasts_while_any_speed_is_unknown():
    state = initial_state(config(world_size=3, calibration_steps=1))
    state = advance(state, next_round(state), RoundStats((10.0, math.nan, 30.0), (10, 10, 10),
                                                         math.nan), pool_used=0)
    assert state.ms_per_sample == (1.0, None, 3.0) and not state.calibrated
    plan = next_round(state)
    assert plan.calibration and plan.elastic is None
    assert [s.num_samples for s in plan.slices] == [10, 10, 10]
    state = advance(state, plan, RoundStats((10.0, 5.0, 30.0), (10, 10, 10), math.nan),
                    pool_used=2)
    assert state.calibrated and state.position == 80
    plan = next_round(state)
    assert not plan.calibration
    assert (plan.elastic, plan.signal_from) == (1, 2)
    assert [s.num_samples for s in plan.slices] == [120, 360, 40]  # shares (120, 240, 40)
    assert plan.slices[0].start == 80


def test_elastic_round_places_the_fastest_rank_last_with_a_reservation():
    plan = next_round(calibrated(0.4, 1.0))  # shares (100, 40)
    assert plan == RoundPlan(round_index=0, epoch=0, anchor=4, counts=(15, 4), slices=(
        RankSlice(0, 15, 40, 190), RankSlice(1, 4, 0, 40)), last_in_epoch=False,
        elastic=0, signal_from=1)
    assert plan.num_samples == 190 and plan.weights() == (0.5, 0.5)


def test_elastic_rank_is_the_fastest_and_waits_on_the_slowest():
    plan = next_round(calibrated(1.0, 0.25, 0.5))  # shares (40, 160, 80)
    assert (plan.elastic, plan.signal_from) == (1, 0)
    assert plan.slices == (RankSlice(0, 4, 0, 40), RankSlice(1, 24, 120, 360),
                           RankSlice(2, 8, 40, 120))
    assert plan.weights() == (1 / 3,) * 3
    plan = next_round(calibrated(1.0, 1.0, 1.0))
    assert None not in (plan.elastic, plan.signal_from) and plan.elastic != plan.signal_from


def test_reservation_is_the_cap_times_the_share_rounded_up_to_whole_batches():
    assert ELASTIC_CAP > 1
    plan = next_round(calibrated(0.3, 1.0))  # shares (130, 40): 195 samples, up to 20 batches
    assert plan.slices[0] == RankSlice(0, 20, 40, 40 + 10 * math.ceil(130 * ELASTIC_CAP / 10))
    assert plan.slices[0].num_samples == 200


def test_the_epochs_last_round_takes_what_is_left_balanced_by_speed():
    state = replace(calibrated(0.3, 1.0, dataset_size=1240), position=1000)
    # shares (130, 40): 240 left is within TAIL_MERGE x 170, so this round ends the epoch; of
    # its 24 batches TAIL_POOL (15%, rounded up: 4) are a pool the ranks drain, the other 20 at
    # 3 and 10 ms each: 16 and 4 end at 48 and 40 ms (15 and 5: 45 and 50)
    assert math.ceil(TAIL_POOL * 24) == 4
    plan = next_round(state)
    assert plan.elastic is None and plan.last_in_epoch and plan.drains
    assert plan.slices == (RankSlice(0, 16, 1000, 1160), RankSlice(1, 4, 1160, 1200))
    assert (plan.pool, plan.pool_start, plan.pool_stop, plan.num_samples) == (4, 1200, 1240, 240)
    with pytest.raises(ValueError, match=r"3 batches taken from a pool of 4 \(the epoch's tail"):
        advance(state, plan, measured(0.3, 1.0), pool_used=3)
    state = advance(state, plan, measured(0.3, 1.0), pool_used=4)
    assert (state.epoch, state.position) == (1, 0)


@pytest.mark.parametrize(("remaining", "pool", "slices"), [
    (2, 1, (0, 0)),  # a partial batch alone: one pool batch, whoever is free first
    (25, 3, (0, 0)),  # 2 whole batches (one per rank at least) and the partial one
    (205, 4, (12, 5)),  # 20 whole: 3 to the pool (15%), with the partial one
])
def test_the_epochs_tail_pool_is_a_share_of_its_batches_with_the_partial_one(remaining, pool,
                                                                           slices):
    state = replace(calibrated(0.4, 1.0, dataset_size=5000 + remaining), position=5000)
    plan = next_round(state)
    assert plan.drains and plan.pool == pool and plan.pool_stop == 5000 + remaining
    assert tuple(s.steps for s in plan.slices) == slices
    assert plan.num_samples == remaining


def test_a_tail_pool_take_is_half_the_ranks_speed_share_of_what_is_left_then_a_chunk():
    """Guided takes: 3 ranks at 1, 2 and 4 ms per sample have shares 4/7, 2/7, 1/7; a take is
    half the rank's share of what it saw left, at least its chunk (one step of the slowest)."""
    state = calibrated(1.0, 2.0, 4.0)
    assert [pool_share(state, r) for r in range(3)] == pytest.approx([4 / 7, 2 / 7, 1 / 7])
    assert [pool_chunk(state, r) for r in range(3)] == [4, 2, 1]
    assert pool_take(left=70, chunk=4, share=4 / 7) == 20
    assert pool_take(left=70, chunk=1, share=1 / 7) == 5
    assert pool_take(left=10, chunk=4, share=4 / 7) == 4  # the chunk once the pool is low
    assert pool_take(left=0, chunk=2, share=0.5) == 2
    assert pool_share(replace(state, ms_per_sample=(1.0, None, 4.0)), 0) == 0.0  # unknown


def test_guided_takes_drain_a_pool_in_fewer_round_trips_and_end_within_a_step():
    """The drain, simulated take by take (the earliest-free rank takes next): with guided takes
    the fast rank of a 1:2.5 pair needs well under half the round trips of fixed chunks, every
    batch is taken once, and the ranks finish within one step of the slowest."""
    state = calibrated(1.0, 2.5)

    def drain(guided: bool) -> tuple[list[int], list[float], int]:
        clocks, trips, seen, taken, size = [0.0, 0.0], [0, 0], [40, 40], 0, 40
        while taken < size:
            rank = min(range(2), key=lambda r: (clocks[r], r))
            count = pool_take(left=seen[rank], chunk=pool_chunk(state, rank),
                              share=pool_share(state, rank) if guided else 0.0)
            got = min(count, size - taken)
            taken += got
            seen[rank] = size - taken
            trips[rank] += 1
            clocks[rank] += got * state.ms_per_sample[rank]
        return trips, clocks, taken

    fixed, guided = drain(False), drain(True)
    assert fixed[2] == guided[2] == 40
    assert guided[0][0] * 2 < fixed[0][0]
    assert abs(guided[1][0] - guided[1][1]) <= 2.5


def test_reservation_leaves_the_epochs_last_round_half_a_full_one():
    state = replace(calibrated(0.3, 1.0, dataset_size=1240), position=940)
    # 300 left > 1.5 x 170: elastic, but the reservation (20 batches at the cap) stops short of
    # the end by half a full round (85) on top of the slow share: 17 batches
    plan = next_round(state)
    assert plan.elastic == 0 and not plan.last_in_epoch
    assert plan.slices == (RankSlice(0, 17, 980, 1150), RankSlice(1, 4, 940, 980))
    state = advance(state, plan, measured(0.3, 1.0), elastic_used=170)
    plan = next_round(state)  # the 90 left: one balanced round, 6 and 1 batches (18, 10 ms)
    assert plan.elastic is None and plan.last_in_epoch  # and a pool of 2 (one per rank)
    assert plan.slices == (RankSlice(0, 6, 1150, 1210), RankSlice(1, 1, 1210, 1220))
    assert (plan.pool, plan.pool_stop) == (2, 1240)


def test_no_sliver_of_a_round_is_left_at_the_epochs_end():
    """shares (100, 40): a full round's 140 and a 50-sample tail would pay two averages; with
    190 left (<= 1.5 x 140) one round takes them all, and with 211 left (> 210) the elastic
    round leaves the epoch's last one 70 samples or more."""
    plan = next_round(replace(calibrated(0.4, 1.0, dataset_size=1190), position=1000))
    assert plan.last_in_epoch and plan.num_samples == 190
    assert plan.slices == (RankSlice(0, 12, 1000, 1120), RankSlice(1, 4, 1120, 1160))
    assert (plan.pool, plan.pool_stop) == (3, 1190)
    plan = next_round(replace(calibrated(0.4, 1.0, dataset_size=1211), position=1000))
    assert plan.elastic == 0 and plan.slices[0] == RankSlice(0, 10, 1040, 1140)
    assert 1211 - plan.slices[0].stop >= 70


@pytest.mark.parametrize(("state", "elastic"), [
    (calibrated(0.4, 1.0, policy="async"), 0),
    (calibrated(0.4, 1.0, policy="sync"), None),
    (calibrated(0.4), None),
    (initial_state(config()), None),  # calibrating
])
def test_which_rounds_are_elastic(state, elastic):
    assert next_round(state).elastic == elastic


def test_round_exactly_filling_the_epoch_is_last_and_uncut():
    plan = next_round(initial_state(config(dataset_size=80, calibration_steps=4)))
    assert plan.last_in_epoch and plan.num_samples == 80 and plan.counts == (4, 4)


def test_last_round_is_cut_in_proportion_whole_batches_first():
    # planned (10, 4) batches of 10 with 75 samples left: 7 whole batches in proportion, then
    # the partial 5 (without known speeds, or under sync: no balanced end with a pool)
    assert _cut_samples((10, 4), remaining=75, batch_size=10) == [55, 20]
    state = replace(calibrated(0.4, 1.0, policy="sync", dataset_size=1075), position=1065)
    plan = next_round(state)  # sync: a batch per rank planned, 10 left
    assert plan.last_in_epoch and plan.elastic is None and not plan.pool
    assert plan.slices == (RankSlice(0, 1, 1065, 1075), RankSlice(1, 0, 1075, 1075))


def test_cut_round_may_leave_a_rank_without_samples():
    state = replace(initial_state(config(world_size=3, dataset_size=1015, calibration_steps=1)),
                    position=1000)
    plan = next_round(state)
    assert [s.num_samples for s in plan.slices] == [10, 5, 0]
    assert plan.counts == (1, 1, 0)
    assert plan.weights() == (1 / 3,) * 3


def test_sync_policy_plans_one_batch_per_rank_and_never_tunes():
    state = initial_state(config(world_size=3, policy="sync", dataset_size=95))
    assert state.anchor == 1
    plan = next_round(state)
    assert plan.anchor == 1 and plan.counts == (1, 1, 1) and not plan.calibration
    assert [s.num_samples for s in plan.slices] == [10, 10, 10]
    state = advance(state, plan, measured(1.0, 5.0, 2.0, n=10, sync_ms=1000.0))
    assert state.ms_per_sample == pytest.approx((1.0, 5.0, 2.0))
    assert state.anchor == 1 and state.anchor_history == ()
    assert next_round(state).counts == (1, 1, 1)


def test_next_round_refuses_a_finished_run():
    state = replace(initial_state(config()), epoch=1)
    assert state.finished
    with pytest.raises(ValueError, match="finished"):
        next_round(state)


# ---------------------------------------------------------------------------------------------
# Sample budgets: max_samples, epoch_size, samples_budget


def whole_run(config: PlanConfig, *ms: float) -> list[RoundPlan]:
    """Every plan of a run at steady speeds ``ms`` (elastic ranks use their reservation, half
    the pool is taken)."""
    state, plans = replace(initial_state(config), ms_per_sample=ms), []
    while not state.finished:
        plan = next_round(state)
        plans.append(plan)
        state = run_round(state, measured(*ms)) if not plan.pool or plan.drains else advance(
            state, plan, measured(*ms), pool_used=plan.pool // 2)
    assert state.samples_seen == config.num_samples and state.epoch == config.num_epochs
    return plans


def epoch_ends(plans: list[RoundPlan]) -> dict[int, int]:
    """Per epoch, the last position its rounds reached."""
    ends: dict[int, int] = {}
    for plan in plans:
        ends[plan.epoch] = max(ends.get(plan.epoch, 0), *(s.stop for s in plan.slices),
                               plan.pool_stop if plan.drains else 0)
    return ends


def test_a_budget_cuts_the_last_epoch_short():
    budgeted = config(dataset_size=1000, epochs=3, max_samples=2500)
    assert (budgeted.num_samples, budgeted.num_epochs) == (2500, 3)
    assert [epoch_size(budgeted, e) for e in range(3)] == [1000, 1000, 500]
    plans = whole_run(budgeted, 0.4, 1.0)
    assert epoch_ends(plans) == {0: 1000, 1: 1000, 2: 500}
    assert [p.epoch for p in plans if p.last_in_epoch] == [0, 1, 2]
    assert plans[-1].last_in_epoch and plans[-1].epoch == 2


def test_a_budget_on_an_epochs_end_or_beyond_the_epochs_cuts_nothing():
    assert config(dataset_size=1000, epochs=3, max_samples=2000).num_epochs == 2
    assert epoch_size(config(dataset_size=1000, epochs=3, max_samples=2000), 1) == 1000
    for max_samples in (3000, 3001, None):
        whole = config(dataset_size=1000, epochs=3, max_samples=max_samples)
        assert (whole.num_samples, whole.num_epochs) == (3000, 3)
        assert epoch_ends(whole_run(whole, 0.4, 1.0)) == {0: 1000, 1: 1000, 2: 1000}


@pytest.mark.parametrize("epoch", [-1, 3, 1.0, None])
def test_epoch_size_refuses_an_epoch_the_run_does_not_have(epoch):
    with pytest.raises(ValueError, match=r"^epoch_size: epoch .* not one of the run's 3"):
        epoch_size(config(dataset_size=1000, epochs=3, max_samples=2500), epoch)


def test_the_round_that_reaches_the_cut_is_the_tail_merged_last_one():
    """The cut ends the epoch as an epoch of that size ends: 240 left within TAIL_MERGE x 170
    is one balanced round (as in test_the_epochs_last_round_takes_what_is_left_balanced_by_
    speed), and the run is finished after it."""
    state = replace(calibrated(0.3, 1.0, dataset_size=5000, epochs=2, max_samples=6240),
                    epoch=1, position=1000)
    plan = next_round(state)
    assert plan.elastic is None and plan.last_in_epoch
    assert plan.slices == (RankSlice(0, 16, 1000, 1160), RankSlice(1, 4, 1160, 1200))
    assert (plan.pool, plan.pool_stop) == (4, 1240)
    state = drained(state, plan, measured(0.3, 1.0))
    assert state.finished and (state.epoch, state.position, state.samples_seen) == (2, 0, 6240)
    with pytest.raises(ValueError, match=r"finished \(6240 samples, 2 epochs\)"):
        next_round(state)


@pytest.mark.parametrize("position", [0, 1000, 4000])
def test_a_time_budget_cut_makes_the_next_round_the_runs_last(position):
    """max_time: once the clocks pass it, the round after the boundary ends the run, as an
    epoch's last round (a blocking average, the epoch's end), and no sample is planned twice."""
    state = replace(calibrated(0.3, 1.0, dataset_size=5000, epochs=3), epoch=1,
                    position=position)
    cut = cut_after_next_round(state)
    plan = next_round(cut)
    assert plan.last_in_epoch and plan.epoch == 1
    assert plan.slices[0].start == position
    after = drained(cut, plan, measured(0.3, 1.0))
    assert after.finished and after.samples_seen == state.samples_seen + plan.num_samples
    assert cut_after_next_round(after) is after


def test_the_elastic_reservation_stops_short_of_the_cut():
    # as test_reservation_leaves_the_epochs_last_round_half_a_full_one, at a cut
    state = replace(calibrated(0.3, 1.0, dataset_size=9000, max_samples=1240), position=940)
    plan = next_round(state)
    assert plan.elastic == 0 and not plan.last_in_epoch
    assert plan.slices == (RankSlice(0, 17, 980, 1150), RankSlice(1, 4, 940, 980))


def test_a_cut_of_a_few_samples_is_one_round():
    plans = whole_run(config(dataset_size=1000, epochs=2, max_samples=1003), 0.4, 1.0)
    assert epoch_ends(plans) == {0: 1000, 1: 3}
    assert plans[-1].epoch == 1 and plans[-1].num_samples == 3 and plans[-1].last_in_epoch


def test_streaming_data_is_one_epoch_of_the_budget():
    """Data without len(): ``PlanConfig(dataset_size=max_samples, epochs=1)``."""
    stream = config(dataset_size=2500, epochs=1)
    assert (stream.num_samples, stream.num_epochs, epoch_size(stream, 0)) == (2500, 1, 2500)
    plans = whole_run(stream, 0.4, 1.0)
    assert epoch_ends(plans) == {0: 2500} and plans[-1].last_in_epoch


def test_a_step_is_a_global_ddp_step():
    assert samples_budget(max_steps=100, max_samples=None, world_size=2, batch_size=32) == 6400
    assert samples_budget(max_steps=100, max_samples=None, world_size=2, batch_size=32,
                          accumulate=4) == 25_600
    assert samples_budget(max_steps=100, max_samples=5000, world_size=2, batch_size=32) == 5000
    assert samples_budget(max_steps=10, max_samples=5000, world_size=2, batch_size=32) == 640
    assert samples_budget(max_steps=None, max_samples=5000, world_size=2, batch_size=32) == 5000
    assert samples_budget(max_steps=None, max_samples=None, world_size=2, batch_size=32) is None


@pytest.mark.parametrize(("field", "value"), [
    ("max_steps", 0), ("max_steps", 1.5), ("max_samples", -1), ("max_samples", True),
    ("world_size", 0), ("batch_size", None), ("accumulate", 0),
])
def test_samples_budget_names_a_bad_value(field, value):
    arguments = {"max_steps": 10, "max_samples": None, "world_size": 2, "batch_size": 32,
                 "accumulate": 1, field: value}
    with pytest.raises(PlanConfigError, match=rf"^{field} = {re.escape(repr(value))} is not"):
        samples_budget(**arguments)


# ---------------------------------------------------------------------------------------------
# advance: positions, speeds, the anchor tuner


def test_advance_consumes_samples_and_wraps_epochs():
    state = initial_state(config(dataset_size=100, epochs=2, calibration_steps=4))
    plan = next_round(state)
    assert plan.pool == 1  # 20 samples past the slices: one whole batch short of the end
    state = advance(state, plan, measured(1.0, 1.0), pool_used=0)
    assert (state.round_index, state.epoch, state.position, state.samples_seen) == (1, 0, 80, 80)
    assert not plan.last_in_epoch
    state = drained(state, plan := next_round(state), measured(1.0, 1.0, n=10))
    assert plan.last_in_epoch and plan.num_samples == 20 and plan.pool == 2  # a batch per rank
    assert (state.epoch, state.position, state.samples_seen) == (1, 0, 100)


@pytest.mark.parametrize("used", [1, 90, 150])
def test_elastic_round_advances_by_what_the_elastic_rank_used(used):
    state = calibrated(0.4, 1.0)
    state = advance(state, next_round(state), measured(0.4, 1.0), elastic_used=used)
    assert state.position == state.samples_seen == 40 + used
    assert min(s.start for s in next_round(state).slices) == 40 + used


@pytest.mark.parametrize("used", [None, 0, -1, 151])
def test_elastic_round_needs_what_was_used_within_the_reservation(used):
    state = calibrated(0.4, 1.0)
    with pytest.raises(ValueError, match="elastic rank used"):
        advance(state, next_round(state), measured(0.4, 1.0), elastic_used=used)


def test_speeds_are_ms_per_sample_and_kept_without_a_measurement():
    state = initial_state(config(world_size=3))
    state = run_round(state, RoundStats((8.0, math.nan, 60.0), (20, 20, 20), math.nan))
    assert state.ms_per_sample == (0.4, None, 3.0)
    state = run_round(state, RoundStats((0.0, 20.0, 90.0), (20, 20, 0), math.nan))
    assert state.ms_per_sample == (0.4, 1.0, 3.0)
    state = run_round(state, RoundStats.unknown(3))
    assert state.ms_per_sample == (0.4, 1.0, 3.0)


def test_a_speed_moves_by_the_share_of_a_full_round_it_covers():
    state = calibrated(1.0, 1.0)  # shares (40, 40); rank 1 is elastic, reserving 60
    after = advance(state, next_round(state), RoundStats((30.0, 30.0), (20, 60), math.nan),
                    elastic_used=60)
    assert after.ms_per_sample == pytest.approx((1.0 + SPEED_ALPHA * 0.5 * 0.5,
                                                 1.0 + SPEED_ALPHA * (0.5 - 1.0)))



def test_a_slow_ranks_whole_share_is_a_full_measurement():
    """Weighed against the fast rank's larger share, each of the slow rank's rounds read as a
    partial one and a bad first estimate lingered for rounds (seen in a real bench run)."""
    state = calibrated(1.0, 3.0)
    plan = next_round(state)
    slow = plan.slices[1].num_samples
    assert slow < plan.slices[0].num_samples
    stats = RoundStats((plan.slices[0].num_samples * 1.0, slow * 2.0),
                       (plan.slices[0].num_samples, slow), math.nan)
    after = advance(state, plan, stats, elastic_used=plan.slices[plan.elastic].num_samples
                    if plan.elastic is not None else None)
    assert after.ms_per_sample[1] == pytest.approx(3.0 + SPEED_ALPHA * (2.0 - 3.0))

def tuned(wanted: float, *, anchor: int = 4, ceiling: int | None = None, **overrides) -> PlanState:
    """The state after one round whose averaging cost makes ``wanted`` the ideal anchor."""
    state = replace(calibrated(1.0, 1.0, **overrides), anchor=anchor, ceiling=ceiling)
    return run_round(state, measured(1.0, 1.0, sync_ms=wanted * TARGET * 10 * 1.0))


def test_anchor_grows_to_the_wanted_anchor():
    state = tuned(6.0)
    assert state.anchor == 6
    assert state.anchor_history == ((1, 6, "overhead 0.075 > 0.05"),)
    assert tuned(6.3).anchor == 7


def test_anchor_at_most_doubles_at_the_first_ask_and_grows_whole_at_the_second():
    """One slow average (the first, while connections are made) at most doubles the anchor;
    when the next average asks for more again (a slow link), it gets all it asks for, so the
    anchor is not six rounds of costly averages away from where it pays."""
    assert tuned(50.0).anchor == 8
    assert tuned(50.0, anchor=8).anchor == 16
    once = tuned(50.0)
    sync_ms = 50.0 * TARGET * 10 * 1.0
    again = run_round(once, measured(1.0, 1.0, sync_ms=sync_ms))
    assert (once.anchor, again.anchor) == (8, 50)
    assert again.anchor_history[-1] == (2, 50, "overhead 0.312 > 0.05")  # at anchor 8
    # a round that held the anchor, then an ask: it doubles again
    steady = run_round(again, measured(1.0, 1.0, sync_ms=sync_ms))
    assert steady.anchor == 50 and steady.anchor_history == again.anchor_history
    asks = run_round(replace(steady, anchor=10), measured(1.0, 1.0, sync_ms=4.0 * sync_ms))
    assert asks.anchor == 20
    # and a ceiling (the divergence guard's) still caps the whole growth
    assert run_round(replace(once, ceiling=12), measured(1.0, 1.0, sync_ms=sync_ms)).anchor == 12


def test_anchor_growth_is_not_inflated_by_float_noise():
    state = calibrated(1.0, 1.0, batch_size=1)
    # 3 * 0.1 / 0.05 is 6.000000000000001, not 6
    assert run_round(state, measured(1.0, 1.0, sync_ms=3 * 0.1)).anchor == 6


def test_anchor_shrinks_by_one_below_half_the_wanted_and_holds_in_between():
    state = tuned(3.9, anchor=8)
    assert state.anchor == 7
    assert state.anchor_history == ((1, 7, "overhead 0.0244 < 0.025"),)
    for wanted in (4.0, 6.0, 8.0):
        state = tuned(wanted, anchor=8)
        assert state.anchor == 8 and state.anchor_history == ()
    assert tuned(8.01, anchor=8).anchor == 9
    assert tuned(0.0, anchor=8).anchor == 7  # a free average is a measurement too


def test_tuner_uses_the_slowest_rank_as_measured_in_the_same_round():
    state = calibrated(1.0, 1.0)
    # wanted = 4 / (0.05 * 10 * 2.0) = 4 exactly: held. From the fast rank (0.5) it would be 16,
    # from the updated estimate (1.7) 4.7.
    assert run_round(state, measured(0.5, 2.0, sync_ms=4.0)).anchor == 4
    assert run_round(state, measured(0.5, 2.0, sync_ms=4.1)).anchor == 5


def test_calibration_round_tunes_the_anchor():
    state = initial_state(config())
    state = advance(state, next_round(state), measured(1.0, 1.0, n=20, sync_ms=3.0),
                    pool_used=0)
    assert state.anchor == 6 and state.anchor_history[0][:2] == (1, 6)


def test_anchor_is_clamped_to_min_max_and_the_ceiling():
    assert tuned(500.0, anchor=40, max_anchor=50).anchor == 50
    assert tuned(0.0).anchor == 4 and tuned(0.0).anchor_history == ()  # min_anchor 4
    assert tuned(50.0, ceiling=6).anchor == 6


@pytest.mark.parametrize("stats", [
    measured(1.0, 1.0, sync_ms=math.nan),
    measured(1.0, 1.0, sync_ms=math.inf),
    measured(1.0, 1.0, sync_ms=-1.0),
    RoundStats((math.nan, 0.0), (40, 40), 100.0),
    RoundStats((40.0, 40.0), (0, 0), 100.0),
])
def test_unusable_stats_leave_the_anchor_alone(stats):
    state = run_round(calibrated(1.0, 1.0), stats)
    assert state.anchor == 4 and state.anchor_history == ()


def test_prev_shares_are_the_planned_shares_before_any_cut_or_reservation():
    assert run_round(initial_state(config()), measured(1.0, 1.0)).prev_shares is None
    state = run_round(calibrated(0.4, 1.0), measured(0.4, 1.0), used=120)
    assert state.prev_shares == (100, 40)
    # the dead zone holds them: a small wiggle keeps the share, and so the reservation
    plan = next_round(replace(state, ms_per_sample=(0.403, 1.0)))
    assert plan.slices[0].num_samples == 150
    cut = replace(calibrated(0.4, 1.0, dataset_size=1075, epochs=2), position=1000)
    assert run_round(cut, measured(0.4, 1.0)).prev_shares == (100, 40)


def test_advance_rejects_a_plan_from_another_state_and_stats_of_another_world():
    state = initial_state(config())
    plan = next_round(state)
    later = advance(state, plan, measured(1.0, 1.0), pool_used=0)
    with pytest.raises(ValueError, match="not made from state"):
        advance(later, plan, measured(1.0, 1.0), pool_used=0)
    with pytest.raises(ValueError, match="world_size"):
        advance(state, plan, measured(1.0, 1.0, 1.0))
    with pytest.raises(ValueError, match="world_size"):
        advance(state, plan, RoundStats((40.0, 40.0), (40,), 1.0))


def test_a_vanishing_step_time_doubles_the_anchor_up_to_its_maximum():
    # the float found by hypothesis for the old planner, carried over: 1e10 ms of averaging over
    # steps of 2e-300 ms is an infinite overhead; the anchor doubles per round, to max_anchor.
    state = initial_state(PlanConfig(world_size=2, batch_size=1, dataset_size=100_000,
                                     epochs=1, max_anchor=50))
    anchors = []
    for _ in range(6):
        state = run_round(state, RoundStats((4e-300, 4e-300), (2, 2), 1e10))
        anchors.append(state.anchor)
    assert anchors == [8, 16, 32, 50, 50, 50]


@pytest.mark.parametrize(("policy", "cap", "steps"), [
    ("cadence", None, 50), ("sync", None, 50), ("async", 250, 25), ("cadence", 5, 1)])
def test_a_single_worker_runs_rounds_of_max_anchor_steps_within_the_cap(policy, cap, steps):
    """Nothing to average: a single worker's rounds are max_anchor steps (after cadence's and
    async's calibration round), or the steps that fit in ``round_cap`` samples."""
    state = initial_state(PlanConfig(world_size=1, batch_size=10, dataset_size=100_000,
                                     epochs=1, max_anchor=50, policy=policy, round_cap=cap))
    if policy != "sync":
        plan = next_round(state)
        assert plan.calibration and plan.counts == (2,)
        state = run_round(state, measured(1.0))
    for _ in range(3):
        plan = next_round(state)
        assert plan.counts == (steps,) and not plan.pool and plan.elastic is None
        state = run_round(state, measured(1.0, n=steps * 10, sync_ms=50.0))
        assert state.anchor == steps


def test_a_busy_time_that_underflows_per_sample_is_no_measurement():
    state = initial_state(config())
    after = advance(state, next_round(state), RoundStats((5e-324, 20.0), (20, 20), math.nan),
                    pool_used=0)
    assert after.ms_per_sample == (None, 1.0)


def test_a_speed_ratio_beyond_float_range_still_plans_a_round():
    # found by hypothesis: one sample in 5e-324 ms is finite and > 0 per sample, so it is taken
    # raw; the fast rank's ideal share, 40 * 1.0 / 5e-324, is inf, and shares() cannot round it.
    state = advance(initial_state(config()), next_round(initial_state(config())),
                    RoundStats((5e-324, 20.0), (1, 20), math.nan), pool_used=0)
    plan = next_round(state)
    assert plan.num_samples <= 10_000 - state.position
    assert all(s.stop <= 10_000 for s in plan.slices)


# ---------------------------------------------------------------------------------------------
# halve_anchor, with_ceiling


def test_halve_anchor_records_the_reason_and_sets_the_ceiling():
    state = replace(initial_state(config()), anchor=17, round_index=9)
    state = halve_anchor(state, reason="loss diverged")
    assert (state.anchor, state.ceiling) == (8, 8)
    assert state.anchor_history == ((9, 8, "loss diverged"),)


def test_halve_anchor_goes_below_min_anchor_down_to_one():
    state = halve_anchor(initial_state(config()), reason="a")  # min_anchor 4
    assert (state.anchor, state.ceiling) == (2, 2)
    state = halve_anchor(state, reason="b")
    assert (state.anchor, state.ceiling) == (1, 1)
    again = halve_anchor(state, reason="c")
    assert again == state and len(again.anchor_history) == 2


def test_the_tuner_cannot_grow_a_halved_anchor_until_the_ceiling_is_lifted():
    state = halve_anchor(replace(calibrated(1.0, 1.0), anchor=16), reason="diverged")
    grow = measured(1.0, 1.0, sync_ms=50.0 * TARGET * 10)  # wanted 50
    held = run_round(state, grow)
    assert (held.anchor, held.ceiling) == (8, 8)
    assert run_round(state, measured(1.0, 1.0, sync_ms=0.0)).anchor == 7  # shrinking still works
    lifted = with_ceiling(held, None)
    assert lifted.ceiling is None
    assert (lifted.anchor, lifted.anchor_history) == (held.anchor, held.anchor_history)
    assert run_round(lifted, grow).anchor == 16
    assert run_round(with_ceiling(held, 12), grow).anchor == 12


def test_an_anchor_halved_below_min_anchor_holds_on_target_and_grows_back_to_min_anchor():
    lifted = with_ceiling(halve_anchor(calibrated(1.0, 1.0), reason="diverged"), None)
    assert lifted.anchor == 2  # min_anchor 4
    assert run_round(lifted, measured(1.0, 1.0, sync_ms=2.0 * TARGET * 10)).anchor == 2
    assert run_round(lifted, measured(1.0, 1.0, sync_ms=2.5 * TARGET * 10)).anchor == 4


def test_halve_anchor_is_a_no_op_under_sync():
    state = initial_state(config(policy="sync"))
    assert halve_anchor(state, reason="x") == state


# ---------------------------------------------------------------------------------------------
# Purity


@pytest.mark.parametrize("module", [plan_module, policies_module])
def test_the_plan_imports_nothing_impure(module):
    """No clock, randomness, file or process access can reach the plan: only these modules."""
    tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "math", "collections.abc", "dataclasses", "typing",
                        "fdl.errors", "fdl.settings", "fdl.engine.policies"}


# ---------------------------------------------------------------------------------------------
# Whole runs, as properties


@st.composite
def configs(draw, policies=("sync", "cadence", "async")) -> PlanConfig:
    """A third of them without a sample budget, half with one that cuts an epoch short
    (any epoch, anywhere in it: a last epoch of one sample too), the rest with one beyond
    the epochs' samples (no effect)."""
    world, batch = draw(st.integers(1, 6)), draw(st.integers(1, 16))
    min_anchor = draw(st.integers(1, 4))
    initial = draw(st.integers(min_anchor, min_anchor + 8))
    dataset_size = world * batch * draw(st.integers(1, 30)) + draw(st.integers(0, world * batch))
    epochs = draw(st.integers(1, 3))
    budget = draw(st.sampled_from(("none", "none", "cut", "cut", "cut", "beyond")))
    max_samples = None
    if budget == "cut":  # at least one batch per rank, as PlanConfig asks of any budget
        epoch = epochs - 1 - draw(st.integers(0, epochs - 1))  # the last one most often
        cut = epoch * dataset_size + draw(st.integers(1, dataset_size))
        max_samples = max(world * batch, cut)
    elif budget == "beyond":
        max_samples = epochs * dataset_size + draw(st.integers(0, dataset_size))
    return PlanConfig(
        world_size=world,
        batch_size=batch,
        dataset_size=dataset_size,
        epochs=epochs,
        max_samples=max_samples,
        policy=draw(st.sampled_from(policies)),
        calibration_steps=draw(st.integers(1, 3)),
        initial_anchor=initial,
        min_anchor=min_anchor,
        max_anchor=draw(st.integers(initial, initial + 40)),
        overhead_target=draw(st.floats(0.01, 0.5)),
        dead_zone=draw(st.floats(0.0, 0.5)),
    )


@dataclass(frozen=True)
class Weather:
    """What happens in a round besides the plan: per-rank jitter on the base speeds, what the
    average cost, how much of its reservation an elastic rank uses, what the guard does."""

    jitter: tuple[float, ...]
    sync_ms: float
    elastic_fraction: float  # used = max(1, ceil(fraction * reserved)): anything in (0, reserved]
    guard: str  # "", "halve" or "lift"
    lost_rank: int  # this rank (if it exists) reports ``lost_busy`` instead of its busy time
    lost_busy: float


weathers = st.builds(
    Weather,
    jitter=st.lists(st.floats(0.5, 2.0), min_size=6, max_size=6).map(tuple),
    sync_ms=st.floats(0.0, 500.0) | st.just(math.nan),
    elastic_fraction=st.floats(0.0, 1.0),
    guard=st.sampled_from(["", "", "", "halve", "lift"]),
    lost_rank=st.integers(0, 11),
    lost_busy=st.sampled_from([math.nan, math.inf, 0.0, -1.0]),
)
speeds_ms = st.lists(st.floats(0.01, 3.0), min_size=6, max_size=6)


@dataclass(frozen=True)
class Round:
    """One round of a whole run: the state it was planned from, the plan, what the elastic rank
    used, the stats the ranks exchanged and the state ``advance`` made of them (before the
    guard acted)."""

    state: PlanState
    plan: RoundPlan
    elastic_used: int | None
    stats: RoundStats
    after: PlanState
    pool_used: int = 0

    @property
    def planned(self) -> tuple[int, ...]:
        """The round's samples per rank before any cut or reservation."""
        config = self.state.config
        if self.plan.calibration:
            return (config.calibration_steps * config.batch_size,) * config.world_size
        assert self.after.prev_shares is not None
        return self.after.prev_shares

    def used(self, rank: int) -> tuple[int, int]:
        """The positions ``[start, stop)`` rank ``rank`` consumed."""
        mine = self.plan.slices[rank]
        if rank == self.plan.elastic:
            assert self.elastic_used is not None
            return mine.start, mine.start + self.elastic_used
        return mine.start, mine.stop

    def pool_range(self) -> tuple[int, int]:
        """The positions the ranks took from the round's pool, whoever took them."""
        start = self.plan.pool_start
        if self.plan.drains:
            return start, self.plan.pool_stop
        return start, start + self.pool_used * self.state.config.batch_size


def run_to_the_end(config: PlanConfig, base_ms, weather) -> tuple[PlanState, list[Round]]:
    """Every round of a whole run, with the weather cycled. Every rank holds its own state,
    from its own config as each worker builds one, and advances it with the stats the ranks
    exchanged: every rank plans every round as rank 0 does (the rounds returned are rank 0's)."""
    states, rounds = [initial_state(replace(config)) for _ in range(config.world_size)], []
    while not states[0].finished:
        state = states[0]
        plan = next_round(state)
        assert all(next_round(other) == plan for other in states[1:])
        today = weather[plan.round_index % len(weather)]
        used = None
        if plan.elastic is not None:
            reserved = plan.slices[plan.elastic].num_samples
            used = max(1, math.ceil(today.elastic_fraction * reserved))
        samples = tuple(used if r == plan.elastic else s.num_samples
                        for r, s in enumerate(plan.slices))
        busy = tuple(today.lost_busy if r == today.lost_rank else
                     base_ms[r] * today.jitter[r] * n if n else math.nan
                     for r, n in enumerate(samples))
        stats = RoundStats(busy_ms=busy, samples=samples, sync_ms=today.sync_ms)
        taken = plan.pool if plan.drains else \
            min(plan.pool, math.floor(today.elastic_fraction * (plan.pool + 1)))
        states = [advance(s, plan, stats, elastic_used=used,
                          pool_used=taken if plan.pool else None) for s in states]
        rounds.append(Round(state, plan, used, stats, states[0], taken))
        states = [guarded(s, today.guard) for s in states]
    assert all(s == states[0] for s in states)
    return states[0], rounds


def guarded(state: PlanState, guard: str) -> PlanState:
    """``state`` after the divergence guard did ``guard`` ("halve", "lift" or nothing)."""
    if guard == "halve":
        halved = halve_anchor(state, reason="diverged")
        if state.config.policy.name == "sync" or state.config.world_size == 1:
            assert halved == state
        else:
            assert halved.anchor == halved.ceiling == max(1, state.anchor // 2)
        return halved
    if guard == "lift":
        lifted = with_ceiling(state, None)
        assert lifted.ceiling is None
        return lifted
    return state


def check_layout(step: Round) -> None:
    """Contiguous, disjoint slices from the state's position: ranks in order, the elastic rank
    last and short of the epoch's end; steps cover the samples; uniform weights."""
    state, plan = step.state, step.plan
    config = state.config
    assert (plan.round_index, plan.epoch, plan.anchor) == (state.round_index, state.epoch,
                                                           state.anchor)
    assert [s.rank for s in plan.slices] == list(range(config.world_size))
    order = [r for r in range(config.world_size) if r != plan.elastic]
    laid = [plan.slices[r] for r in order + ([] if plan.elastic is None else [plan.elastic])]
    size = epoch_size(config, state.epoch)  # the epoch's end, or the budget's cut
    assert laid[0].start == state.position
    assert all(a.stop == b.start for a, b in pairwise(laid))
    assert laid[-1].stop <= size
    assert plan.last_in_epoch == (plan.elastic is None and
                                  (plan.pool_stop if plan.pool else laid[-1].stop) == size)
    if plan.pool:  # right after the slices, in whole batches but for an epoch's partial last
        assert config.world_size > 1 and config.policy.name != "sync"
        assert plan.pool_start == laid[-1].stop
        assert plan.pool == -(-(plan.pool_stop - plan.pool_start) // config.batch_size)
    if plan.pool and not plan.drains:  # the calibration round's: short of the epoch's end
        assert plan.calibration and plan.pool_stop < size
        assert plan.pool_stop == plan.pool_start + plan.pool * config.batch_size
    if plan.drains:  # the epoch's last round's: its tail, at least a batch per rank
        assert not plan.calibration and plan.elastic is None
        assert plan.pool >= min(config.world_size, (size - plan.pool_start) // config.batch_size)
    assert plan.counts == tuple(s.steps for s in plan.slices)
    assert all(s.steps == -(-s.num_samples // config.batch_size) for s in plan.slices)
    assert plan.weights() == (1 / config.world_size,) * config.world_size


def check_shares(step: Round) -> None:
    """The round's kind (calibration, elastic, full or cut) and samples, from the state."""
    state, plan, planned = step.state, step.plan, step.planned
    config = state.config
    local = config.policy.name != "sync"
    assert plan.calibration == (local and not state.calibrated)
    assert (step.after.prev_shares is None) == plan.calibration
    if config.world_size == 1 and not plan.calibration:  # rounds of solo_anchor steps
        assert planned == (solo_anchor(config) * config.batch_size,) == (
            state.anchor * config.batch_size,)
    elif not local:
        assert planned == (config.batch_size,) * config.world_size
    elif not plan.calibration:
        check_shares_follow_speeds(state, planned)
    remaining = epoch_size(config, state.epoch) - state.position
    samples = [s.num_samples for s in plan.slices]
    if plan.elastic is not None:
        check_elastic(state, plan, planned, remaining)
        return
    assert plan.signal_from is None
    if local and state.calibrated and remaining <= TAIL_MERGE * sum(planned):
        # the epoch's last round, balanced by speed
        assert plan.last_in_epoch and plan.num_samples == remaining
        check_balanced(state.ms_per_sample, samples, config.batch_size)
        return
    if local and state.calibrated:  # a full round, no elastic rank (one rank)
        assert config.world_size == 1 and samples == list(planned)
    elif sum(planned) <= remaining:
        assert samples == list(planned)
    else:  # cut to what the epoch has left: whole batches in proportion to the planned steps
        assert plan.last_in_epoch and plan.num_samples == remaining
        steps = [-(-n // config.batch_size) for n in planned]
        whole = remaining // config.batch_size
        for s, c in zip(plan.slices, steps, strict=True):
            assert whole * c // sum(steps) <= s.num_samples // config.batch_size <= s.steps <= c
        assert sum(s.num_samples % config.batch_size != 0 for s in plan.slices) <= 1


def check_balanced(ms, samples, batch_size: int) -> None:
    """Whole batches, at most one partial one, and no batch could move to another rank and
    end the round sooner (the longest time is as short as whole batches allow)."""
    assert sum(n % batch_size != 0 for n in samples) <= 1
    times = [n * m for n, m in zip(samples, ms, strict=True)]
    longest = max(times)
    for r, n in enumerate(samples):
        if times[r] < longest * (1 - 1e-9) or n == 0:
            continue
        moved = min(batch_size, n % batch_size or batch_size)
        for other in range(len(samples)):
            if other != r:
                assert (samples[other] + moved) * ms[other] >= longest * (1 - 1e-9)


def fastest_candidates(ms: tuple[float | None, ...]) -> set[int]:
    """Ranks that may be picked as the elastic one: the fastest other than a slowest rank."""
    slowest = [s for s in range(len(ms)) if ms[s] == max(ms)]
    return {f for s in slowest for f in range(len(ms))
            if f != s and ms[f] == min(ms[r] for r in range(len(ms)) if r != s)}


def check_elastic(state: PlanState, plan: RoundPlan, planned, remaining: int) -> None:
    fast, slow = plan.elastic, plan.signal_from
    ms = state.ms_per_sample
    assert state.config.policy.name != "sync" and state.calibrated
    assert fast in fastest_candidates(ms) and slow != fast and ms[slow] == max(ms)
    others = sum(planned) - planned[fast]
    assert remaining > TAIL_MERGE * sum(planned)
    reserved, batch = plan.slices[fast].num_samples, state.config.batch_size
    # whole batches: the cap rounded up, or as many as leave the epoch's last round at least
    # (TAIL_MERGE - 1) of a full one
    assert reserved % batch == 0
    capped = batch * math.ceil(planned[fast] * ELASTIC_CAP / batch)
    left = math.ceil((TAIL_MERGE - 1) * sum(planned))
    assert reserved == min(capped, (remaining - others - left) // batch * batch)
    assert planned[fast] <= reserved <= remaining - others - left
    assert all(s.num_samples == n for s, n in zip(plan.slices, planned, strict=True)
               if s.rank != fast)


def check_shares_follow_speeds(state: PlanState, planned: tuple[int, ...]) -> None:
    """The documented rule, computed here from the state's speeds: the slowest rank runs
    ``anchor * batch_size`` samples, rank r ``that * ms_slow / ms_r`` rounded half up to whole
    batches (an unmeasured rank counts as the slowest), or the previous shares stand because
    every rank's ideal is within the dead zone of them."""
    config = state.config
    base = state.anchor * config.batch_size
    slow = max((ms for ms in state.ms_per_sample if ms is not None), default=1.0)
    ideal = [base * slow / (slow if ms is None else ms) for ms in state.ms_per_sample]
    assert min(planned) == base >= 1
    assert all(n % config.batch_size == 0 for n in planned)
    rounded = all(rounds_half_up_to_batches(x, n, config.batch_size)
                  for x, n in zip(ideal, planned, strict=True))
    held = planned == state.prev_shares and all(
        abs(x - n) < config.dead_zone * n for x, n in zip(ideal, planned, strict=True))
    assert rounded or held, (ideal, planned, state.prev_shares)


def rounds_half_up_to_batches(ideal: float, share: int, batch_size: int) -> bool:
    """``share`` is ``ideal`` rounded half up to a multiple of ``batch_size`` (float noise
    aside): within half a batch of it, and a tie goes up."""
    tolerance = 1e-9 * ideal
    return (share % batch_size == 0
            and -batch_size / 2 - tolerance < share - ideal <= batch_size / 2 + tolerance)


def check_speeds(step: Round) -> None:
    """A rank that reported a measurement moves its estimate ``SPEED_ALPHA x`` the share of a
    full round it covered (its own planned share) toward the clipped measurement (all the way
    the first time); one that reported none, or one that is not finite and > 0 per sample, keeps
    its estimate."""
    for old, new, busy, n, full in zip(step.state.ms_per_sample, step.after.ms_per_sample,
                                       step.stats.busy_ms, step.stats.samples, step.planned,
                                       strict=True):
        if not (n and usable(busy / n)):
            assert new == old
        elif old is None:
            assert new == busy / n
        else:
            clipped = min(max(busy / n, old / SPEED_CLIP), old * SPEED_CLIP)
            weight = min(n / full, 1.0)
            assert new == pytest.approx(old + SPEED_ALPHA * weight * (clipped - old))


def usable(ms: float) -> bool:
    return math.isfinite(ms) and ms > 0


def check_anchor(step: Round) -> None:
    """The tuner's documented rule; every change recorded with the first round it plans."""
    state, after, stats = step.state, step.after, step.stats
    config = state.config
    expected = state.anchor
    ms = [busy / n for busy, n in zip(stats.busy_ms, stats.samples, strict=True)
          if n and usable(busy / n)]
    if config.policy.name != "sync" and config.world_size > 1 and ms and \
            0 <= stats.sync_ms < math.inf:  # a single worker's anchor is solo_anchor's
        wanted = stats.sync_ms / (config.overhead_target * config.batch_size * max(ms))
        high = min(config.max_anchor, state.ceiling or config.max_anchor)
        if wanted > state.anchor:  # grow to the wanted anchor: at most doubling, unless the
            # round just run was the first with an anchor grown (then all of it)
            last = state.anchor_history[-1] if state.anchor_history else None
            whole = last is not None and last[0] == state.round_index and " > " in last[2]
            grown = math.ceil(wanted - 1e-9) if math.isfinite(wanted) else 2 * state.anchor
            limit = grown if whole else 2 * state.anchor
            expected = min(max(min(grown, limit), config.min_anchor), high)
        elif wanted < state.anchor / 2:  # shrink by one
            expected = min(max(state.anchor - 1, config.min_anchor), high)
    assert after.anchor == expected
    if after.anchor != state.anchor:
        round_index, anchor, reason = after.anchor_history[-1]
        assert (round_index, anchor) == (after.round_index, after.anchor)
        assert reason.startswith("overhead ")
    else:
        assert after.anchor_history == state.anchor_history
    assert 1 <= after.anchor <= config.max_anchor
    assert config.world_size > 1 or after.anchor == solo_anchor(config)
    assert config.policy.name != "sync" or config.world_size == 1 or after.anchor == 1
    assert state.ceiling is None or after.anchor <= state.ceiling


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), speeds=speeds_ms, weather=st.lists(weathers, min_size=1, max_size=6))
def test_whole_run_uses_every_sample_of_every_epoch_exactly_once(config, speeds, weather):
    """Including elastic rounds whose elastic rank uses anything in (0, reserved], and a sample
    budget that cuts the last epoch: its positions below the cut are used once, none beyond."""
    final, rounds = run_to_the_end(config, speeds, weather)
    # the documented budget, computed here: min(epochs x dataset_size, max_samples) samples,
    # every epoch whole but the last, which ends at the cut
    total = min(config.epochs * config.dataset_size, config.max_samples or math.inf)
    sizes = [min(config.dataset_size, total - e * config.dataset_size)
             for e in range(math.ceil(total / config.dataset_size))]
    assert (config.num_samples, config.num_epochs) == (total, len(sizes))
    assert [epoch_size(config, e) for e in range(len(sizes))] == sizes
    assert sum(sizes) == total and min(sizes) >= 1
    used: dict[int, list[tuple[int, int]]] = {}
    seen = 0
    for step in rounds:
        check_layout(step)
        check_shares(step)
        check_speeds(step)
        check_anchor(step)
        assert step.state.samples_seen == seen
        ranges = [step.used(r) for r in range(config.world_size)] + [step.pool_range()]
        seen += sum(stop - start for start, stop in ranges)
        assert step.after.samples_seen == seen
        used.setdefault(step.plan.epoch, []).extend(r for r in ranges if r[1] > r[0])
    assert sorted(used) == list(range(len(sizes)))
    for epoch, ranges in used.items():
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] == sizes[epoch]  # to the cut, none beyond
        assert all(a[1] == b[0] for a, b in pairwise(ranges))  # disjoint, no gaps
    assert [step.plan.epoch for step in rounds if step.plan.last_in_epoch] == list(
        range(len(sizes)))
    assert not any(step.state.finished for step in rounds)
    assert final.finished and final.epoch == len(sizes) and final.position == 0
    assert final.samples_seen == seen == total
    with pytest.raises(ValueError):
        next_round(final)


@settings(max_examples=200, deadline=None)
@given(config=configs(policies=("cadence", "async")), speeds=speeds_ms,
       sync_ms=st.floats(0.0, 50.0))
def test_steady_speeds_balance_every_round_after_one_calibration_round(config, speeds, sync_ms):
    """El Che's point: with speeds that do not change (and no dead zone), one calibration round
    measures them; from then on every rank's share of a full round takes the slowest rank's
    ``anchor x batch_size x ms_slow`` to within half a batch, and the elastic rank's
    reservation lasts until the slowest rank is done: from anchor 2 (at anchor 1 half a batch
    is a third of a rank's round) and unless the epoch's end held it short of the cap."""
    config = replace(config, dead_zone=0.0)
    ms = tuple(speeds[:config.world_size])
    state, num_calibrations = initial_state(config), 0
    while not state.finished:
        plan = next_round(state)
        num_calibrations += plan.calibration
        used = None
        if plan.elastic is not None:  # it runs until the slowest rank is done
            fast, reserved = plan.elastic, plan.slices[plan.elastic].num_samples
            slowest_done = max(s.num_samples * ms[s.rank] for s in plan.slices if s.rank != fast)
            needed = max(1, math.ceil(slowest_done / ms[fast] - 1e-9))
            used = min(reserved, needed)
        samples = [used if s.rank == plan.elastic else s.num_samples for s in plan.slices]
        stats = RoundStats(tuple(m * n for m, n in zip(ms, samples, strict=True)),
                           tuple(samples), sync_ms)
        after = drained(state, plan, stats, elastic_used=used,
                        **({"pool_used": plan.pool // 2} if plan.pool and not plan.drains else {}))
        remaining = epoch_size(config, state.epoch) - state.position
        if plan.elastic is not None and state.anchor >= 2:
            planned, batch = after.prev_shares, config.batch_size
            capped = batch * math.ceil(planned[fast] * ELASTIC_CAP / batch)
            if reserved == capped:  # not held short by the epoch's end
                assert needed <= reserved, (needed, reserved, plan)
        if not plan.calibration and (plan.elastic is not None
                                     or sum(after.prev_shares) <= remaining):  # a full round
            assert state.ms_per_sample == pytest.approx(ms)
            slowest = state.anchor * config.batch_size * max(ms)
            for n, m in zip(after.prev_shares, ms, strict=True):
                assert abs(n * m - slowest) <= config.batch_size * m / 2 + 1e-6 * slowest
        state = after
    assert num_calibrations == 1


@settings(max_examples=200, deadline=None)
@given(config=configs(), speeds=speeds_ms, weather=st.lists(weathers, min_size=1, max_size=6),
       fraction=st.floats(0.0, 1.0))
def test_a_cut_plans_the_epoch_as_an_epoch_of_its_size(config, speeds, weather, fraction):
    """One epoch cut at ``max_samples`` is planned round for round as an epoch of
    ``max_samples`` samples (which is how data without len() is planned): tail merge, balanced
    split, elastic reservations and calibration pool all look at the cut as at an epoch's end."""
    low = config.world_size * config.batch_size
    cut = low + math.floor(fraction * (config.dataset_size - low))
    budgeted = replace(config, epochs=1, max_samples=cut)
    stream = replace(config, epochs=1, dataset_size=cut, max_samples=None)
    final, rounds = run_to_the_end(budgeted, speeds, weather)
    final_stream, rounds_stream = run_to_the_end(stream, speeds, weather)
    assert [step.plan for step in rounds] == [step.plan for step in rounds_stream]
    assert final == replace(final_stream, config=budgeted)
    assert final.samples_seen == cut


@settings(max_examples=200, deadline=None)
@given(ratio=st.floats(1.0, 8.0), anchor=st.integers(1, 50), batch_size=st.integers(1, 64),
       slow=st.floats(0.01, 1000.0))
def test_shares_follow_the_speed_ratio(ratio, anchor, batch_size, slow):
    fast_share, slow_share = shares(anchor=anchor, batch_size=batch_size,
                                    ms_per_sample=[slow / ratio, slow], prev=None, dead_zone=0.0)
    base = anchor * batch_size
    assert slow_share == base
    assert rounds_half_up_to_batches(base * ratio, fast_share, batch_size)


# ---------------------------------------------------------------------------------------------
# The state a checkpoint keeps (engine.json)


@settings(max_examples=100, deadline=None)
@given(config=configs(), speeds=speeds_ms, weather=st.lists(weathers, min_size=1, max_size=6))
def test_every_state_of_a_run_comes_back_from_its_saved_form(config, speeds, weather):
    """What a checkpoint writes (through JSON, as engine.json holds it) gives back the state
    the run was in, at every round: the next round is planned exactly as it would have been."""
    _, rounds = run_to_the_end(config, speeds, weather)
    for step in rounds:
        saved = json.loads(json.dumps(step.state.to_dict()))
        assert saved_state_problem(saved) is None
        restored = PlanState.from_dict(saved, config)
        assert restored == step.state
        assert next_round(restored) == step.plan


def test_the_saved_state_keeps_the_budget_and_one_saved_before_budgets_loads():
    config = PlanConfig(world_size=2, batch_size=4, dataset_size=100, epochs=3, max_samples=250)
    state = replace(initial_state(config), round_index=7, epoch=2, position=16, anchor=5,
                    ms_per_sample=(1.0, 2.5), prev_shares=(48, 20))
    saved = json.loads(json.dumps(state.to_dict()))
    assert saved["max_samples"] == 250
    assert PlanState.from_dict(saved, config) == state
    unbudgeted = replace(config, max_samples=None)
    old = {k: v for k, v in initial_state(unbudgeted).to_dict().items() if k != "max_samples"}
    assert saved_state_problem(old) is None
    assert PlanState.from_dict(old, unbudgeted) == initial_state(unbudgeted)
    for bad in (0, -1, 2.5, True, "250"):
        problem = saved_state_problem({**saved, "max_samples": bad})
        assert problem == (f"the plan state's 'max_samples' is {bad!r}, expected an integer "
                           ">= 1 or null")


def test_a_state_saved_past_a_smaller_budget_is_finished_under_it():
    """A run resumed with a budget its checkpoint has already used up has nothing to plan."""
    config = PlanConfig(world_size=2, batch_size=4, dataset_size=100, epochs=3)
    saved = replace(initial_state(config), epoch=2, position=60).to_dict()
    for max_samples, finished in ((250, True), (260, True), (261, False), (None, False)):
        state = PlanState.from_dict(saved, replace(config, max_samples=max_samples))
        assert state.finished == finished
        assert state.samples_seen == 260
    assert next_round(PlanState.from_dict(saved, replace(config, max_samples=261))).num_samples == 1


def test_a_resume_with_other_ranks_or_another_policy_measures_again():
    config = PlanConfig(world_size=2, batch_size=4, dataset_size=100, epochs=2, policy="async")
    state = replace(initial_state(config), round_index=5, epoch=1, position=40, anchor=9,
                    ms_per_sample=(1.0, 2.5), prev_shares=(90, 36), ceiling=9,
                    anchor_history=((3, 9, "overhead 0.1 > 0.02"),))
    saved = state.to_dict()
    three = replace(config, world_size=3)
    wider = PlanState.from_dict(saved, three)
    assert (wider.round_index, wider.epoch, wider.position, wider.anchor) == (5, 1, 40, 9)
    assert wider.ms_per_sample == (None, None, None) and wider.prev_shares is None
    assert wider.ceiling is None and wider.anchor_history == state.anchor_history
    other = PlanState.from_dict(saved, replace(config, policy="cadence"))
    assert other.anchor == config.initial_anchor and other.ms_per_sample == (None, None)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("epoch", -1, "'epoch' is -1, expected an integer >= 0"),
    ("anchor", 0, "'anchor' is 0, expected an integer >= 1"),
    ("ms_per_sample", [1.0, "fast"], "'ms_per_sample' is [1.0, 'fast']"),
    ("ms_per_sample", [1.0], "describes 2 ranks with 1 speeds"),
    ("anchor_history", [[1, 2]], "'anchor_history' is [[1, 2]]"),
    ("policy", "ddp", "'policy' is 'ddp', expected sync | cadence | async"),
    ("position", 101, "position 101 is beyond its 100 samples"),
    ("ceiling", True, "'ceiling' is True"),
])
def test_a_saved_state_that_is_not_what_to_dict_writes_is_refused(field, value, message):
    config = PlanConfig(world_size=2, batch_size=4, dataset_size=100, epochs=2)
    saved = {**initial_state(config).to_dict(), field: value}
    assert message in saved_state_problem(saved)
    with pytest.raises(ValueError, match=re.escape(message)):
        PlanState.from_dict(saved, config)
    missing = initial_state(config).to_dict()
    del missing[field]
    assert saved_state_problem(missing) == f"the plan state has no {field!r}"
