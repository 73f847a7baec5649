"""El Che round planning: counts, slices, EMA, anchor tuning, and whole runs as properties."""

from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass, replace
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fdl.engine.plan as plan_module
from fdl.engine.plan import (
    PlanConfig,
    PlanConfigError,
    PlanState,
    RankSlice,
    RoundPlan,
    RoundStats,
    advance,
    ema,
    halve_anchor,
    initial_state,
    next_round,
    step_counts,
)
from fdl.errors import UsageError


def config(**overrides) -> PlanConfig:
    values = {"world_size": 2, "batch_size": 10, "dataset_size": 10_000, "epochs": 1}
    return PlanConfig(**(values | overrides))


def stats(*step_ms: float, sync_ms: float = 1.0, compute_ms: float = 100.0) -> RoundStats:
    """Stats with overhead 0.01 (the anchor shrinks by one) unless sync/compute are given."""
    return RoundStats(step_ms=step_ms, sync_ms=sync_ms, compute_ms=compute_ms)


def steady(*step_ms: float) -> RoundStats:
    """Stats whose overhead (0.03) leaves the default anchor alone."""
    return stats(*step_ms, sync_ms=3.0, compute_ms=100.0)


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
    ("min_anchor", 0),
    ("initial_anchor", 0),
    ("initial_anchor", 201),
    ("max_anchor", 0),
    ("overhead_target", 0),
    ("overhead_target", -0.1),
    ("overhead_target", math.inf),
    ("overhead_target", math.nan),
    ("dead_zone", -0.1),
    ("dead_zone", 1.0),
    ("dead_zone", "0.1"),
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
    config(dataset_size=20, min_anchor=5, initial_anchor=5, max_anchor=5, dead_zone=0.0)
    config(world_size=1, batch_size=1, dataset_size=1, policy="sync")


def test_min_anchor_above_max_names_max_anchor():
    with pytest.raises(ValueError, match=r"^max_anchor = 4 .* >= 5"):
        config(min_anchor=5, initial_anchor=5, max_anchor=4)


# ---------------------------------------------------------------------------------------------
# ema


def test_ema_first_sample_is_raw():
    assert ema(None, 42.0) == 42.0


def test_ema_alpha_is_the_relative_error():
    assert ema(100.0, 150.0) == pytest.approx(100.0 + 0.5 * 50.0)
    assert ema(100.0, 60.0) == pytest.approx(100.0 - 0.4 * 40.0)


def test_ema_alpha_is_clamped_to_0_3_and_0_8():
    assert ema(100.0, 101.0) == pytest.approx(100.0 + 0.3 * 1.0)
    assert ema(100.0, 400.0) == pytest.approx(100.0 + 0.8 * 300.0)
    assert ema(100.0, 100.0) == 100.0


@pytest.mark.parametrize(("old", "new"), [(None, 0.0), (None, math.nan), (None, -1.0),
                                          (0.0, 1.0), (None, math.inf)])
def test_ema_rejects_unusable_values(old, new):
    with pytest.raises(ValueError, match="ema"):
        ema(old, new)


# ---------------------------------------------------------------------------------------------
# step_counts


def counts(anchor, speeds, prev=None, dead_zone=0.1):
    return step_counts(anchor=anchor, speed_ms=speeds, prev=prev, dead_zone=dead_zone)


def test_fast_rank_does_proportionally_more_steps():
    assert counts(4, [40.0, 100.0]) == (10, 4)
    assert counts(4, [100.0, 40.0, 50.0]) == (4, 10, 8)


def test_counts_round_half_up_and_never_below_one():
    assert counts(1, [100.0, 40.0]) == (1, 3)  # 2.5 -> 3
    assert counts(3, [100.0, 100.0]) == (3, 3)


def test_unmeasured_ranks_count_as_the_slowest_known():
    assert counts(4, [None, None]) == (4, 4)
    assert counts(4, [None, 50.0, 100.0]) == (4, 8, 4)
    assert counts(4, [25.0, None]) == (4, 4)


def test_dead_zone_keeps_counts_when_speeds_wiggle_less_than_10_percent():
    prev = counts(4, [40.0, 100.0])
    assert prev == (10, 4)
    # 40 -> 42.5 ms: ideal count 9.41 (rounds to 9) is within 10% of 10, so 10 stays.
    assert counts(4, [42.5, 100.0], prev) == (10, 4)
    assert counts(4, [42.5, 100.0], prev, dead_zone=0.0) == (9, 4)


def test_dead_zone_gives_way_to_a_real_change():
    assert counts(4, [50.0, 100.0], (10, 4)) == (8, 4)


def test_dead_zone_is_off_when_the_anchor_changed():
    # prev was planned with anchor min(prev) = 4; with anchor 5 the counts are recomputed.
    assert counts(5, [40.0, 100.0], (10, 4)) == (13, 5)


@pytest.mark.parametrize("speeds", [[0.0, 1.0], [math.nan, 1.0], [-1.0, None]])
def test_step_counts_rejects_bad_speeds(speeds):
    with pytest.raises(ValueError, match="speed_ms"):
        counts(4, speeds)


# ---------------------------------------------------------------------------------------------
# next_round


def test_initial_state():
    state = initial_state(config(world_size=3, dataset_size=100))
    assert (state.round_index, state.epoch, state.position, state.anchor) == (0, 0, 0, 4)
    assert state.speed_ms == (None, None, None)
    assert (state.anchor_history, state.prev_counts) == ((), None)
    assert not state.finished and state.samples_seen == 0


def test_first_round_gives_every_rank_anchor_batches_in_rank_order():
    plan = next_round(initial_state(config()))
    assert plan == RoundPlan(round_index=0, epoch=0, anchor=4, counts=(4, 4), slices=(
        RankSlice(0, 4, 0, 40), RankSlice(1, 4, 40, 80)), last_in_epoch=False)
    assert plan.num_samples == 80 and plan.weights() == (0.5, 0.5)


def test_measured_speeds_shape_the_next_round():
    state = initial_state(config())
    state = advance(state, next_round(state), steady(40.0, 100.0))
    plan = next_round(state)
    assert plan.counts == (10, 4)
    assert [(s.start, s.stop) for s in plan.slices] == [(80, 180), (180, 220)]
    assert plan.weights() == pytest.approx((100 / 140, 40 / 140))


def test_round_exactly_filling_the_epoch_is_last_and_uncut():
    plan = next_round(initial_state(config(dataset_size=80)))
    assert plan.counts == (4, 4) and plan.last_in_epoch and plan.num_samples == 80


def test_last_round_is_cut_in_proportion_whole_batches_first():
    state = replace(initial_state(config(dataset_size=1075)), position=1000,
                    speed_ms=(40.0, 100.0))
    plan = next_round(state)  # planned (10, 4) = 140 samples, 75 remain: 7 batches + 5
    assert plan.last_in_epoch
    assert plan.slices == (RankSlice(0, 6, 1000, 1055), RankSlice(1, 2, 1055, 1075))
    assert plan.counts == (6, 2)


def test_cut_round_may_leave_a_rank_without_samples():
    state = replace(initial_state(config(world_size=3, dataset_size=1015)), position=1000)
    plan = next_round(state)
    assert [s.num_samples for s in plan.slices] == [10, 5, 0]
    assert plan.counts == (1, 1, 0)
    assert plan.weights() == (10 / 15, 5 / 15, 0.0)


def test_sync_policy_plans_one_equal_step_per_rank():
    state = initial_state(config(world_size=3, policy="sync", dataset_size=95))
    assert state.anchor == 1
    plan = next_round(state)
    assert plan.anchor == 1 and plan.counts == (1, 1, 1)
    assert [s.num_samples for s in plan.slices] == [10, 10, 10]
    state = advance(state, plan, stats(10.0, 50.0, 20.0, sync_ms=90.0, compute_ms=10.0))
    plan = next_round(state)
    assert plan.counts == (1, 1, 1) and state.anchor == 1 and state.anchor_history == ()


def test_next_round_refuses_a_finished_run():
    state = replace(initial_state(config()), epoch=1)
    assert state.finished
    with pytest.raises(ValueError, match="finished"):
        next_round(state)


# ---------------------------------------------------------------------------------------------
# advance


def test_advance_consumes_samples_and_wraps_epochs():
    state = initial_state(config(dataset_size=100, epochs=2))
    state = advance(state, plan := next_round(state), steady(10.0, 10.0))
    assert (state.round_index, state.epoch, state.position, state.samples_seen) == (1, 0, 80, 80)
    assert not plan.last_in_epoch
    state = advance(state, plan := next_round(state), steady(10.0, 10.0))
    assert plan.last_in_epoch and plan.num_samples == 20
    assert (state.epoch, state.position, state.samples_seen) == (1, 0, 100)
    assert state.samples_seen / (2 * 100) == 0.5


def test_advance_updates_speed_emas_and_keeps_them_for_ranks_without_steps():
    state = initial_state(config(world_size=3))
    state = advance(state, next_round(state), steady(40.0, math.nan, 100.0))
    assert state.speed_ms == (40.0, None, 100.0)
    state = advance(state, next_round(state), steady(52.0, 80.0, 0.0))
    assert state.speed_ms == (pytest.approx(40.0 + 0.3 * 12.0), 80.0, 100.0)


def test_advance_ignores_step_ms_of_a_rank_that_ran_no_step():
    state = replace(initial_state(config(world_size=3, dataset_size=1015)), position=1000)
    plan = next_round(state)
    assert plan.counts[2] == 0
    assert advance(state, plan, steady(10.0, 10.0, 5.0)).speed_ms == (10.0, 10.0, None)


def tuned(overhead: float, *, anchor: int = 4, **overrides) -> PlanState:
    state = replace(initial_state(config(**overrides)), anchor=anchor)
    return advance(state, next_round(state), stats(10.0, 10.0, sync_ms=overhead * 100.0))


def test_anchor_grows_in_proportion_to_the_overhead():
    state = tuned(0.2)
    assert state.anchor == 16
    assert state.anchor_history == ((1, 16, "overhead 0.2 > 0.05"),)


def test_anchor_growth_is_not_inflated_by_float_noise():
    assert tuned(0.1, anchor=3).anchor == 6


def test_anchor_shrinks_by_one_below_half_the_target():
    state = tuned(0.02)
    assert state.anchor == 3
    assert state.anchor_history == ((1, 3, "overhead 0.02 < 0.025"),)


def test_anchor_holds_between_half_the_target_and_the_target():
    for overhead in (0.025, 0.04, 0.05):
        state = tuned(overhead)
        assert state.anchor == 4 and state.anchor_history == ()


def test_anchor_is_clamped():
    assert tuned(5.0, max_anchor=50).anchor == 50
    assert tuned(0.0, anchor=2, min_anchor=2, initial_anchor=2).anchor == 2
    assert tuned(0.0, anchor=2, min_anchor=2, initial_anchor=2).anchor_history == ()


@pytest.mark.parametrize(("sync_ms", "compute_ms"), [(5.0, 0.0), (math.nan, 10.0),
                                                     (5.0, math.inf), (-1.0, 10.0)])
def test_unusable_overhead_leaves_the_anchor_alone(sync_ms, compute_ms):
    state = initial_state(config())
    state = advance(state, next_round(state), stats(1.0, 1.0, sync_ms=sync_ms,
                                                    compute_ms=compute_ms))
    assert state.anchor == 4


def test_cut_round_does_not_tune_the_anchor():
    state = replace(initial_state(config(dataset_size=1050)), position=1000)
    plan = next_round(state)
    assert plan.last_in_epoch and plan.num_samples == 50
    assert advance(state, plan, stats(1.0, 1.0, sync_ms=50.0)).anchor == 4


def test_prev_counts_are_the_uncut_counts():
    state = replace(initial_state(config(dataset_size=1050, epochs=2)), position=1000,
                    speed_ms=(40.0, 100.0))
    plan = next_round(state)
    assert plan.counts != (10, 4)
    assert advance(state, plan, steady(40.0, 100.0)).prev_counts == (10, 4)


def test_advance_rejects_a_plan_from_another_state():
    state = initial_state(config())
    plan = next_round(state)
    later = advance(state, plan, steady(1.0, 1.0))
    with pytest.raises(ValueError, match="not made from state"):
        advance(later, plan, steady(1.0, 1.0))
    with pytest.raises(ValueError, match="world_size"):
        advance(state, plan, steady(1.0, 1.0, 1.0))


# ---------------------------------------------------------------------------------------------
# halve_anchor


def test_halve_anchor_records_the_reason():
    state = replace(initial_state(config()), anchor=17, round_index=9)
    state = halve_anchor(state, reason="loss diverged")
    assert state.anchor == 8
    assert state.anchor_history == ((9, 8, "loss diverged"),)


def test_halve_anchor_stops_at_min_anchor_and_records_only_changes():
    state = replace(initial_state(config(min_anchor=3, initial_anchor=3)), anchor=5)
    state = halve_anchor(state, reason="a")
    assert state.anchor == 3
    assert halve_anchor(state, reason="b") == state


def test_halve_anchor_is_a_no_op_under_sync():
    state = initial_state(config(policy="sync"))
    assert halve_anchor(state, reason="x") == state


# ---------------------------------------------------------------------------------------------
# Purity


def test_plan_module_imports_nothing_impure():
    """No clock, randomness, file or process access can reach the plan: only these modules."""
    tree = ast.parse(Path(plan_module.__file__).read_text(encoding="utf-8"))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "math", "collections.abc", "dataclasses", "fdl.errors",
                        "fdl.settings"}


# ---------------------------------------------------------------------------------------------
# Whole runs, as properties


@st.composite
def configs(draw) -> PlanConfig:
    world, batch = draw(st.integers(1, 8)), draw(st.integers(1, 16))
    min_anchor = draw(st.integers(1, 3))
    initial = draw(st.integers(min_anchor, min_anchor + 8))
    return PlanConfig(
        world_size=world,
        batch_size=batch,
        dataset_size=world * batch * draw(st.integers(1, 25)) + draw(st.integers(0, world * batch)),
        epochs=draw(st.integers(1, 3)),
        policy=draw(st.sampled_from(["sync", "cadence", "async"])),
        initial_anchor=initial,
        min_anchor=min_anchor,
        max_anchor=draw(st.integers(initial, initial + 40)),
        overhead_target=draw(st.floats(0.01, 0.5)),
        dead_zone=draw(st.floats(0.0, 0.5)),
    )


round_stats = st.tuples(
    st.lists(st.floats(0.5, 2.0), min_size=8, max_size=8),  # jitter per rank
    st.floats(0.0, 500.0) | st.just(math.nan),               # sync_ms
    st.floats(0.0, 5000.0),                                  # compute_ms
    st.booleans(),                                           # divergence guard fires
)
speeds_ms = st.lists(st.floats(1.0, 300.0), min_size=8, max_size=8)


@dataclass(frozen=True)
class Round:
    """One round of a whole run: the state it was planned from, the plan, the stats the ranks
    reported and the state ``advance`` made of them (before any halving)."""

    state: PlanState
    plan: RoundPlan
    stats: RoundStats
    after: PlanState

    @property
    def planned(self) -> tuple[int, ...]:
        """The round's counts before any cut at the epoch end (``advance`` records them)."""
        assert self.after.prev_counts is not None
        return self.after.prev_counts


def stats_for(plan: RoundPlan, base_ms, template) -> RoundStats:
    jitter, sync_ms, compute_ms, _ = template
    step_ms = tuple(base * j if steps else math.nan
                    for base, j, steps in zip(base_ms, jitter, plan.counts, strict=False))
    return RoundStats(step_ms=step_ms, sync_ms=sync_ms, compute_ms=compute_ms)


def run_to_the_end(config: PlanConfig, base_ms, templates) -> tuple[PlanState, list[Round]]:
    """Every round of a whole run, with cycled stats and guard firings."""
    state, rounds = initial_state(config), []
    while not state.finished:
        plan = next_round(state)
        template = templates[plan.round_index % len(templates)]
        stats = stats_for(plan, base_ms, template)
        after = advance(state, plan, stats)
        rounds.append(Round(state, plan, stats, after))
        state = after
        if template[3] and plan.round_index % 3 == 0:
            state = halve_anchor(state, reason="diverged")
    return state, rounds


def check_slices(state: PlanState, plan: RoundPlan) -> None:
    """Contiguous, disjoint slices in rank order from the state's position; whole batches."""
    config = state.config
    assert (plan.round_index, plan.epoch) == (state.round_index, state.epoch)
    assert [s.rank for s in plan.slices] == list(range(config.world_size))
    assert plan.slices[0].start == state.position
    assert all(a.stop == b.start for a, b in pairwise(plan.slices))
    assert plan.slices[-1].stop <= config.dataset_size
    assert plan.last_in_epoch == (plan.slices[-1].stop == config.dataset_size)
    assert plan.counts == tuple(s.steps for s in plan.slices)
    assert all(s.steps == -(-s.num_samples // config.batch_size) for s in plan.slices)
    weights = plan.weights()
    assert math.isclose(sum(weights), 1.0)
    assert all(math.isclose(w, s.num_samples / plan.num_samples) for w, s in
               zip(weights, plan.slices, strict=True))


def check_counts_follow_speeds(state: PlanState, planned: tuple[int, ...]) -> None:
    """The documented rule, computed here from the state's speeds: the slowest rank runs the
    anchor, rank r ``anchor * ms_slow / ms_r`` rounded (an unmeasured rank counts as the
    slowest), or the previous counts stand because every rank's ideal is within the dead zone
    of them."""
    config = state.config
    if config.policy == "sync":
        assert planned == (1,) * config.world_size
        return
    slow = max((ms for ms in state.speed_ms if ms is not None), default=1.0)
    ideal = [state.anchor * slow / (slow if ms is None else ms) for ms in state.speed_ms]
    assert min(planned) == state.anchor >= 1
    rounded = all(abs(x - c) <= 0.5 + 1e-9 * x for x, c in zip(ideal, planned, strict=True))
    held = planned == state.prev_counts and all(
        abs(x - c) < config.dead_zone * c for x, c in zip(ideal, planned, strict=True))
    assert rounded or held, (ideal, planned, state.prev_counts)


def check_round(step: Round) -> None:
    state, plan, planned = step.state, step.plan, step.planned
    config = state.config
    low, high = (1, 1) if config.policy == "sync" else (config.min_anchor, config.max_anchor)
    assert low <= plan.anchor == state.anchor <= high
    check_slices(state, plan)
    check_counts_follow_speeds(state, planned)
    remaining = config.dataset_size - state.position
    if sum(planned) * config.batch_size <= remaining:  # a full round
        assert plan.counts == planned
        assert all(s.num_samples == s.steps * config.batch_size for s in plan.slices)
    else:  # cut to what the epoch has left, never over the planned counts
        assert plan.last_in_epoch and plan.num_samples == remaining
        assert all(c <= p for c, p in zip(plan.counts, planned, strict=True))


def check_speeds(step: Round) -> None:
    """A rank that ran steps moves its speed 30 to 80% of the way to what it reported (all of
    the way the first time); one that ran none keeps its estimate."""
    for old, new, ms, steps in zip(step.state.speed_ms, step.after.speed_ms, step.stats.step_ms,
                                   step.plan.counts, strict=True):
        if not steps:
            assert new == old
        elif old is None or ms == old:
            assert new == ms
        else:
            assert 0.3 - 1e-9 <= (new - old) / (ms - old) <= 0.8 + 1e-9


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), speeds=speeds_ms, templates=st.lists(round_stats, min_size=1,
                                                              max_size=6))
def test_whole_run_assigns_every_sample_once_per_epoch(config, speeds, templates):
    final, rounds = run_to_the_end(config, speeds, templates)
    epochs: dict[int, list[RankSlice]] = {}
    for step in rounds:
        check_round(step)
        check_speeds(step)
        epochs.setdefault(step.plan.epoch, []).extend(step.plan.slices)
        done = sum(r.plan.num_samples for r in rounds[: step.plan.round_index])
        assert step.state.samples_seen == done
    assert sorted(epochs) == list(range(config.epochs))
    for slices in epochs.values():
        covered = sorted((s.start, s.stop) for s in slices if s.num_samples)
        assert covered[0][0] == 0 and covered[-1][1] == config.dataset_size
        assert all(a[1] == b[0] for a, b in pairwise(covered))  # disjoint, no gaps
    assert sum(step.plan.last_in_epoch for step in rounds) == config.epochs
    assert final.finished and final.epoch == config.epochs and final.position == 0
    assert final.samples_seen == config.epochs * config.dataset_size
    assert all(config.min_anchor <= a <= config.max_anchor for _, a, _ in final.anchor_history)
    with pytest.raises(ValueError):
        next_round(final)


@settings(max_examples=100, deadline=None)
@given(config=configs(), speeds=speeds_ms, sync_ms=st.floats(0.0, 50.0))
def test_steady_speeds_let_every_rank_finish_a_round_within_half_a_step(config, speeds,
                                                                        sync_ms):
    """El Che's point: with speeds that do not change (and no dead zone), once every rank has
    been measured each full round gives rank r ``c_r`` steps with ``c_r x ms_r`` within half
    of one of its steps of the slowest rank's ``anchor x ms_slow``: no rank idles longer."""
    config = replace(config, policy="cadence", dead_zone=0.0)
    state = initial_state(config)
    while not state.finished:
        plan = next_round(state)
        step_ms = tuple(ms if steps else math.nan
                        for ms, steps in zip(speeds, plan.counts, strict=False))
        after = advance(state, plan, RoundStats(step_ms=step_ms, sync_ms=sync_ms,
                                                compute_ms=100.0))
        full = plan.counts == after.prev_counts  # not cut at the epoch end
        if full and None not in state.speed_ms:
            assert state.speed_ms == tuple(speeds[:config.world_size])  # ema(x, x) == x
            slowest = state.anchor * max(state.speed_ms)
            for steps, ms in zip(plan.counts, state.speed_ms, strict=True):
                assert abs(steps * ms - slowest) <= ms / 2 + 1e-9 * slowest
        state = after


@settings(max_examples=100, deadline=None)
@given(ratio=st.floats(1.0, 8.0), anchor=st.integers(1, 50), slow=st.floats(1.0, 1000.0))
def test_counts_follow_the_speed_ratio(ratio, anchor, slow):
    fast_count, slow_count = counts(anchor, [slow / ratio, slow])
    assert slow_count == anchor
    assert abs(fast_count - anchor * ratio) <= 0.5 + 1e-9 * anchor * ratio


def test_a_vanishing_compute_time_grows_the_anchor_to_its_maximum():
    # found by hypothesis: sync 1 ms over 5e-324 ms of compute is an infinite overhead
    config = PlanConfig(world_size=1, batch_size=1, dataset_size=100, epochs=1, max_anchor=50)
    state = initial_state(config)
    plan = next_round(state)
    after = advance(state, plan, RoundStats(step_ms=(1.0,), sync_ms=1.0, compute_ms=5e-324))
    assert after.anchor == 50
