"""The divergence guard's rule (driven with the planner's own anchor tuner), summary.json's
numbers, and the per-rank timeline."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from fdl.engine.config import resolve_config
from fdl.engine.guard import (
    BASELINE_ALPHA,
    BASELINE_ROUNDS,
    RELEASE_ROUNDS,
    STREAK,
    Verdict,
    observe,
)
from fdl.engine.plan import PlanConfig, PlanState, RoundStats, advance, initial_state, next_round
from fdl.engine.state import GuardState, RankState
from fdl.rundir.summary import RankSummary, RunSummary
from fdl.rundir.timeline import EVENTS, Timeline, read_events
from fdl.settings import ENGINE_DEFAULTS

# ---------------------------------------------------------------------------------------------
# The divergence guard (fdl.engine.guard.observe)

THRESHOLD = 4.0
BASE_X = 0.0025  # the baseline rounds' distance / (lr_scale * steps)


def plan_state(*, anchor: int = 16) -> PlanState:
    """A cadence plan of two ranks, anchor ``anchor`` (the guard's lever is the anchor)."""
    config = PlanConfig(world_size=2, batch_size=8, dataset_size=10**7, epochs=1,
                        policy="cadence", initial_anchor=anchor, max_anchor=200)
    return initial_state(config)


def learnt(guard: GuardState | None = None) -> GuardState:
    """A guard that has learnt its baseline: BASE_X per LR and step."""
    guard = GuardState() if guard is None else guard
    for _ in range(BASELINE_ROUNDS):
        observe(guard, plan_state(), distance=BASE_X * 4, lr_scale=1.0, steps=4,
                threshold=THRESHOLD)
    return guard


def usual(guard: GuardState) -> float:
    """The guard's usual level of drift per LR and step, as it stands."""
    return guard.baseline_sum / guard.baseline_rounds


def at_level(guard: GuardState, state: PlanState, level: float, *, lr_scale: float = 1.0,
             steps: int = 4) -> tuple[PlanState, Verdict]:
    """Observe an average whose drift is ``level`` times the usual level as it stands."""
    return observe(guard, state, distance=level * usual(guard) * lr_scale * steps,
                   lr_scale=lr_scale, steps=steps, threshold=THRESHOLD)


def test_the_baseline_is_learnt_over_the_first_rounds_without_acting():
    guard, state = GuardState(), plan_state()
    xs = [0.001, 0.004, 0.002, 0.003, 0.005]
    assert len(xs) == BASELINE_ROUNDS
    for x in xs:  # even a large drift here only teaches the guard what is usual
        after, verdict = observe(guard, state, distance=x * 8 * 0.5, lr_scale=0.5, steps=8,
                                 threshold=THRESHOLD)
        assert after is state
        assert math.isnan(verdict.level) and verdict.streak == 0 and not verdict.halved
    assert guard.baseline_rounds == BASELINE_ROUNDS
    assert guard.baseline_sum == pytest.approx(sum(xs))
    _, verdict = observe(guard, state, distance=0.006 * 4, lr_scale=1.0, steps=4,
                         threshold=THRESHOLD)
    assert verdict.level == pytest.approx(0.006 / (sum(xs) / len(xs)))
    assert guard.baseline_rounds == BASELINE_ROUNDS  # learnt once; then it follows (below)


def test_the_usual_level_follows_calm_rounds_only_and_not_while_a_halving_is_held():
    guard, state = learnt(), plan_state()
    at_level(guard, state, THRESHOLD / 2)  # calm: the level moves up
    assert usual(guard) == pytest.approx(BASE_X * (1 + BASELINE_ALPHA * (THRESHOLD / 2 - 1)))
    before = usual(guard)
    _, verdict = at_level(guard, state, 0.75 * THRESHOLD)  # not calm: it teaches nothing
    assert verdict.streak == 0 and usual(guard) == pytest.approx(before)
    _, verdict = at_level(guard, state, 20.0)  # diverging: nothing either
    assert verdict.streak == 1 and usual(guard) == pytest.approx(before)
    held = replace(state, ceiling=8)
    at_level(guard, held, 1.5)  # calm, but the guard holds the anchor down
    assert usual(guard) == pytest.approx(before)


def test_a_model_that_leaves_its_plateau_is_not_taken_for_a_diverging_one():
    """What the first GPU run recorded (scripts/test-gpu, a CUDA worker beside a CPU one): the
    drift per step stayed near its first level, then rose 3.4x in one round as the model began
    to learn and stayed there. At the default threshold the guard lets it be; a guard judging
    against the first rounds alone with a threshold of 4 halved the anchor (what happened)."""
    field = [(0.0125, 4), (0.0103, 8), (0.0172, 8), (0.0178, 7), (0.0150, 7),  # the baseline
             (0.0134, 10), (0.0233, 10), (0.0514, 9), (0.1732, 9), (0.1691, 8), (0.1643, 7),
             (0.1509, 10), (0.1189, 10), (0.1082, 10)]
    guard, state = GuardState(), plan_state(anchor=10)
    for distance, steps in field:
        state, verdict = observe(guard, state, distance=distance, lr_scale=1.0, steps=steps,
                                 threshold=ENGINE_DEFAULTS["divergence_threshold"])
        assert not verdict.halved, (distance, steps, verdict)
    assert state.anchor == 10 and state.ceiling is None


def test_a_blow_up_of_the_loss_is_caught_at_the_default_threshold():
    """What the divergence run records (the loss scaled 100x half-way): 30-100x the level."""
    guard, state = learnt(), plan_state(anchor=4)
    for level in (100.0, 47.0, 31.0):
        state, verdict = observe(guard, state, distance=level * usual(guard) * 4, lr_scale=1.0,
                                 steps=4, threshold=ENGINE_DEFAULTS["divergence_threshold"])
    assert verdict.halved and state.anchor == 2


def test_three_rounds_above_the_threshold_halve_the_anchor_and_set_the_ceiling():
    guard, state = learnt(), plan_state(anchor=16)
    for streak in (1, 2):
        after, verdict = at_level(guard, state, 10.0)
        assert after is state and verdict.streak == streak and not verdict.halved
        assert verdict.level == pytest.approx(10.0)
    after, verdict = at_level(guard, state, 10.0)
    assert verdict.halved and verdict.streak == STREAK
    assert (after.anchor, after.ceiling) == (8, 8)
    assert after.anchor_history[-1][1] == 8
    assert after.anchor_history[-1][2].startswith("divergence guard")
    assert guard.streak == 0  # the next halving needs three more rounds
    again = after
    for _ in range(2):
        again, verdict = at_level(guard, again, 10.0)
        assert not verdict.halved
    again, verdict = at_level(guard, again, 10.0)
    assert verdict.halved and (again.anchor, again.ceiling) == (4, 4)


def test_a_round_at_or_below_the_threshold_breaks_the_streak():
    guard, state = learnt(), plan_state()
    streaks = [at_level(guard, state, level)[1].streak
               for level in (5.0, 6.0, THRESHOLD, 5.0, 5.0, 1.0, 9.0)]
    assert streaks == [1, 2, 0, 1, 2, 0, 1]
    assert state.ceiling is None


def grow(state: PlanState, rounds: int) -> list[int]:
    """Run ``rounds`` rounds whose averages cost far more than the overhead target allows:
    the tuner asks for a larger anchor every round. Returns the anchor after each."""
    anchors = []
    for _ in range(rounds):
        plan = next_round(state)
        samples = tuple(s.num_samples for s in plan.slices)  # 1 ms a sample on both ranks
        state = advance(state, plan, RoundStats(tuple(map(float, samples)), samples, 1000.0),
                        elastic_used=None if plan.elastic is None else samples[plan.elastic],
                        pool_used=(plan.pool if plan.drains else 0) if plan.pool else None)
        anchors.append(state.anchor)
    return anchors


def test_the_tuner_cannot_grow_a_halved_anchor_back():
    guard, state = learnt(), plan_state(anchor=16)
    for _ in range(STREAK):
        state, verdict = at_level(guard, state, 10.0)
    assert verdict.halved and state.anchor == 8
    assert max(grow(state, 10)) == 8
    # the same rounds without the ceiling: the tuner does ask for more
    assert max(grow(replace(state, ceiling=None), 10)) > 8


def test_a_halving_below_the_minimum_anchor_holds_too():
    guard, state = learnt(), plan_state(anchor=4)  # min_anchor is 4: the tuner clamps up to it
    for _ in range(STREAK):
        state, _ = at_level(guard, state, 10.0)
    assert (state.anchor, state.ceiling) == (2, 2)
    assert set(grow(state, 5)) == {2}


def test_the_ceiling_is_lifted_after_enough_calm_rounds_in_a_row():
    guard, state = learnt(), plan_state(anchor=16)
    for _ in range(STREAK):
        state, _ = at_level(guard, state, 10.0)
    assert state.ceiling == 8
    for _ in range(RELEASE_ROUNDS - 1):
        state, verdict = at_level(guard, state, 1.0)
        assert not verdict.released
    state, verdict = at_level(guard, state, THRESHOLD / 2)  # not calm: the count starts over
    assert state.ceiling == 8 and not verdict.released and verdict.streak == 0
    for _ in range(RELEASE_ROUNDS - 1):
        state, verdict = at_level(guard, state, 1.0)
    assert state.ceiling == 8 and not verdict.released
    state, verdict = at_level(guard, state, 1.0)
    assert verdict.released and state.ceiling is None and state.anchor == 8
    assert max(grow(state, 10)) > 8  # the tuner may grow it again
    for _ in range(RELEASE_ROUNDS):  # calm rounds without a ceiling release nothing
        state, verdict = at_level(guard, state, 1.0)
        assert not verdict.released


@pytest.mark.parametrize("blown", [math.nan, math.inf])
def test_a_replica_that_blew_up_counts_as_diverging(blown):
    guard, state = learnt(), plan_state(anchor=16)
    for streak in (1, 2, 3):
        state, verdict = observe(guard, state, distance=blown, lr_scale=1.0, steps=4,
                                 threshold=THRESHOLD)
        assert verdict.level == math.inf and verdict.streak == streak
    assert verdict.halved and state.anchor == 8


def test_a_blow_up_during_the_baseline_counts_and_does_not_teach_it():
    guard, state = GuardState(), plan_state(anchor=16)
    observe(guard, state, distance=0.01, lr_scale=1.0, steps=4, threshold=THRESHOLD)
    for _ in range(STREAK):
        state, verdict = observe(guard, state, distance=math.nan, lr_scale=1.0, steps=4,
                                 threshold=THRESHOLD)
    assert verdict.halved and state.anchor == 8
    assert (guard.baseline_rounds, guard.baseline_sum) == (1, pytest.approx(0.01 / 4))


def test_drift_is_judged_per_unit_of_learning_rate_and_step():
    """Drift grows with the LR and the steps between averages: ten times either, with ten
    times the drift, is the usual level; ten times the drift with neither is divergence."""
    guard, state = learnt(), plan_state()
    distance = 10 * BASE_X * 4
    for lr_scale, steps in ((10.0, 4), (1.0, 40), (2.5, 16)):
        _, verdict = observe(guard, state, distance=distance, lr_scale=lr_scale, steps=steps,
                             threshold=THRESHOLD)
        assert verdict.level == pytest.approx(1.0) and verdict.streak == 0
    _, verdict = observe(guard, state, distance=distance, lr_scale=1.0, steps=4,
                         threshold=THRESHOLD)
    assert verdict.level == pytest.approx(10.0) and verdict.streak == 1


def test_a_guard_restored_from_a_checkpoint_goes_on_where_it_stopped():
    """The guard's memory travels in RankState: a resumed rank halves on the round that
    completes the streak and releases on the one that completes the calm, whichever process
    saw the rounds before."""
    levels = [1.0, 6.0, 7.0, 1.0, 8.0, 8.0, 9.0] + [1.0] * RELEASE_ROUNDS + [5.0, 5.0]

    def run(guard: GuardState, state: PlanState, part: list[float]) -> tuple[list, PlanState]:
        verdicts = []
        for level in part:
            state, verdict = at_level(guard, state, level)
            verdicts.append((verdict.streak, verdict.halved, verdict.released, state.ceiling))
        return verdicts, state

    whole, _ = run(learnt(), plan_state(), levels)
    assert any(v[1] for v in whole) and any(v[2] for v in whole)
    for cut in range(1, len(levels)):
        guard = learnt()
        first, state = run(guard, plan_state(), levels[:cut])
        saved = RankState(guard=guard).to_dict()
        restored = RankState.from_dict(saved).guard
        rest, _ = run(restored, state, levels[cut:])
        assert first + rest == whole, cut


# ---------------------------------------------------------------------------------------------
# RunSummary's document


def summary(*, samples=(600, 400), busy_s=(8.0, 9.0), **overrides) -> dict:
    config = overrides.pop("config", resolve_config(script={"policy": "async", "epochs": 2},
                                                    env={"FDL_SLOWDOWN": "1,2.5"}))
    ranks = [RankSummary(device="cpu (4 threads)", samples=count, busy_s=busy)
             for count, busy in zip(samples, busy_s, strict=True)]
    values = {"policy": config.policy.name, "backend": config.backend,
              "emulated_slowdown": config.simulate_slowdown, "epochs": config.epochs,
              "wall_s": 10.0, "ranks": ranks, "comm_ms": [20.0, 40.0, 30.0], "syncs": 3,
              "eval": {"accuracy": 0.9}, "final_loss": 0.25, "final_anchor": 4}
    return RunSummary(**(values | overrides)).to_dict()


def test_summary_numbers_from_fixed_inputs():
    document = summary()
    assert document["policy"] == "async"
    assert document["backend"] == "auto"
    assert document["world_size"] == 2
    assert document["devices"] == ["cpu (4 threads)", "cpu (4 threads)"]
    assert document["emulated_slowdown"] == [1.0, 2.5]
    assert document["epochs"] == 2
    assert document["samples"] == 1000
    assert document["wall_s"] == 10.0
    assert document["throughput"] == {"samples_per_s": 100.0,
                                      "per_rank_samples_per_s": [60.0, 40.0]}
    # overhead: 90 ms of communication over the slowest rank's 9 s of compute
    assert document["sync"] == {"rounds": 3, "mean_ms": 30.0,
                                "overhead": pytest.approx(0.01)}
    assert document["idle_fraction"] == [pytest.approx(0.2), pytest.approx(0.1)]
    assert document["eval"] == {"accuracy": 0.9}
    assert document["final_loss"] == 0.25
    assert document["final_anchor"] == 4
    json.dumps(document)  # the contract is a JSON document


def test_summary_without_communication_has_no_sync_numbers():
    document = summary(comm_ms=[], syncs=0)
    assert document["sync"] == {"rounds": 0, "mean_ms": None, "overhead": None}


def test_summary_without_compute_has_no_overhead():
    document = summary(samples=[0, 0], busy_s=[0.0, 0.0])
    assert document["sync"]["overhead"] is None
    assert document["sync"]["mean_ms"] == 30.0
    assert document["samples"] == 0
    assert document["idle_fraction"] == [1.0, 1.0]


def test_summary_without_wall_time_has_no_rates():
    document = summary(wall_s=0.0)
    assert document["throughput"] == {"samples_per_s": None,
                                      "per_rank_samples_per_s": [None, None]}
    assert document["idle_fraction"] == [None, None]


def test_idle_fraction_never_goes_negative():
    document = summary(wall_s=5.0)  # busy 8 s and 9 s: clocks disagree, idle is 0, not < 0
    assert document["idle_fraction"] == [0.0, 0.0]


def test_summary_of_an_unemulated_run():
    document = summary(config=resolve_config(script={}, env={}), final_anchor=0)
    assert document["emulated_slowdown"] is None
    assert document["policy"] == "cadence"
    assert document["final_anchor"] == 0


# ---------------------------------------------------------------------------------------------
# Timeline


def fields(kind: str, **given) -> dict:
    """Every field an event of ``kind`` must carry (0 where not ``given``)."""
    return dict.fromkeys(EVENTS[kind], 0) | given


def test_timeline_writes_one_json_line_per_event(tmp_path):
    timeline = Timeline(tmp_path, rank=1)
    timeline.event("round", **fields("round", round=0, epoch=0, steps=4, step_ms=12.5))
    timeline.event("sync", **fields("sync", round=0, wait_s=0.01, blocking=True))
    timeline.event("guard", **fields("guard", round=0, distance=float("nan"), streak=0))
    timeline.close()
    path = tmp_path / "timeline" / "rank1.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 3
    assert all(isinstance(json.loads(line), dict) for line in lines)
    events = read_events(tmp_path, 1)
    assert [event["kind"] for event in events] == ["round", "sync", "guard"]
    assert all(event["rank"] == 1 and isinstance(event["t"], float) for event in events)
    assert events[0] | {"t": 0} == {"t": 0, "rank": 1, "kind": "round"} | fields(
        "round", round=0, epoch=0, steps=4, step_ms=12.5)
    assert events[1]["blocking"] is True and events[1]["wait_s"] == 0.01
    assert events[0]["t"] <= events[1]["t"] <= events[2]["t"]


def test_timeline_serialises_non_json_numbers_as_floats(tmp_path):
    timeline = Timeline(tmp_path, rank=0)
    timeline.event("round", **fields("round", loss=torch.tensor(0.5)))
    timeline.close()
    assert read_events(tmp_path, 0)[0]["loss"] == 0.5


def test_an_event_of_an_unknown_kind_or_without_its_fields_is_a_bug(tmp_path):
    timeline = Timeline(tmp_path, rank=0)
    with pytest.raises(KeyError):
        timeline.event("rounds", **fields("round"))
    with pytest.raises(AssertionError, match="a sync event without \\['wait_s'\\]"):
        timeline.event("sync", **{k: v for k, v in fields("sync").items() if k != "wait_s"})


def test_timeline_without_a_run_dir_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    timeline = Timeline(None, rank=0)
    timeline.event("round", **fields("round"))
    timeline.close()
    timeline.close()  # closing twice is harmless
    assert list(tmp_path.iterdir()) == []


def test_read_events_skips_blank_lines(tmp_path):
    path = tmp_path / "timeline" / "rank0.jsonl"
    path.parent.mkdir()
    path.write_text('{"kind": "a"}\n\n{"kind": "b"}\n', encoding="utf-8")
    assert [event["kind"] for event in read_events(tmp_path, 0)] == ["a", "b"]
