"""The divergence guard's rule, summary.json's numbers, and the per-rank timeline."""

from __future__ import annotations

import json

import pytest
import torch

from fdl.engine.config import resolve_config
from fdl.engine.policies import guard_streak
from fdl.engine.summary import build_summary
from fdl.engine.timeline import Timeline, read_events

# ---------------------------------------------------------------------------------------------
# guard_streak


def run_guard(distances: list[float], threshold: float = 0.5) -> list[tuple[int, bool]]:
    streak, verdicts = 0, []
    for distance in distances:
        streak, halve = guard_streak(streak, distance, threshold)
        verdicts.append((streak, halve))
    return verdicts


def test_three_rounds_above_halve_and_reset_the_streak():
    assert run_guard([0.6, 0.7, 0.9]) == [(1, False), (2, False), (0, True)]


def test_a_round_below_resets_the_streak():
    assert run_guard([0.6, 0.7, 0.1, 0.6, 0.6]) == [
        (1, False), (2, False), (0, False), (1, False), (2, False)]


def test_a_distance_equal_to_the_threshold_is_not_above_it():
    assert run_guard([0.6, 0.5, 0.6, 0.6, 0.6]) == [
        (1, False), (0, False), (1, False), (2, False), (0, True)]


def test_a_long_divergence_halves_every_third_round():
    verdicts = run_guard([2.0] * 7)
    assert [halve for _, halve in verdicts] == [False, False, True, False, False, True, False]


def test_a_streak_carried_over_goes_on_where_it_stopped():
    """The streak lives in the worker's checkpoint: a resumed rank passes the saved streak, and
    the guard halves on the round that completes three, whichever process saw the first two."""
    distances = [0.6, 0.7, 0.9, 0.1, 0.8, 0.8, 0.8, 0.8]
    whole = run_guard(distances)
    for cut in range(1, len(distances)):
        streak = whole[cut - 1][0]  # what the checkpoint after round ``cut - 1`` holds
        resumed = []
        for distance in distances[cut:]:
            streak, halve = guard_streak(streak, distance, 0.5)
            resumed.append((streak, halve))
        assert whole[:cut] + resumed == whole, cut


def test_the_threshold_is_the_argument():
    assert run_guard([0.9, 0.9, 0.9], threshold=1.0) == [(0, False)] * 3
    assert run_guard([0.9, 0.9, 0.9], threshold=0.1)[-1] == (0, True)


# ---------------------------------------------------------------------------------------------
# build_summary


def summary(**overrides) -> dict:
    values = {
        "config": resolve_config(script={"policy": "async", "epochs": 2,
                                         "simulate_slowdown": "1,2.5"}, env={}),
        "world_size": 2, "devices": ["cpu (4 threads)", "cpu (4 threads)"], "wall_s": 10.0,
        # [samples, busy_s, sleep_s, wait_s]
        "per_rank": [[600, 8.0, 0.0, 1.0], [400, 9.0, 5.0, 0.5]],
        "comm_ms": [20.0, 40.0, 30.0], "syncs": 3, "eval_metrics": {"accuracy": 0.9},
        "final_loss": 0.25, "extra": {"anchor": 4},
    }
    return build_summary(**(values | overrides))


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
    assert document["anchor"] == 4
    json.dumps(document)  # the contract is a JSON document


def test_summary_without_communication_has_no_sync_numbers():
    document = summary(comm_ms=[], syncs=0)
    assert document["sync"] == {"rounds": 0, "mean_ms": None, "overhead": None}


def test_summary_without_compute_has_no_overhead():
    document = summary(per_rank=[[0, 0.0, 0.0, 0.0], [0, 0.0, 0.0, 0.0]])
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
    document = summary(config=resolve_config(script={}, env={}), extra={})
    assert document["emulated_slowdown"] is None
    assert document["policy"] == "cadence"
    assert "anchor" not in document


# ---------------------------------------------------------------------------------------------
# Timeline


def test_timeline_writes_one_json_line_per_event(tmp_path):
    timeline = Timeline(tmp_path, rank=1)
    timeline.event("round", round=0, epoch=0, steps=4, step_ms=12.5)
    timeline.event("sync", round=0, wait_s=0.01, blocking=True)
    timeline.event("guard", round=0, distance=float("nan"), streak=0)
    timeline.close()
    path = tmp_path / "timeline" / "rank1.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 3
    assert all(isinstance(json.loads(line), dict) for line in lines)
    events = read_events(path)
    assert [event["kind"] for event in events] == ["round", "sync", "guard"]
    assert all(event["rank"] == 1 and isinstance(event["t"], float) for event in events)
    assert events[0] | {"t": 0} == {"t": 0, "rank": 1, "kind": "round", "round": 0, "epoch": 0,
                                    "steps": 4, "step_ms": 12.5}
    assert events[1]["blocking"] is True and events[1]["wait_s"] == 0.01
    assert events[0]["t"] <= events[1]["t"] <= events[2]["t"]


def test_timeline_serialises_non_json_numbers_as_floats(tmp_path):
    timeline = Timeline(tmp_path, rank=0)
    timeline.event("round", loss=torch.tensor(0.5))
    timeline.close()
    assert read_events(tmp_path / "timeline" / "rank0.jsonl")[0]["loss"] == 0.5


def test_timeline_without_a_run_dir_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    timeline = Timeline(None, rank=0)
    timeline.event("round", round=0)
    timeline.close()
    timeline.close()  # closing twice is harmless
    assert list(tmp_path.iterdir()) == []


def test_read_events_skips_blank_lines(tmp_path):
    path = tmp_path / "rank0.jsonl"
    path.write_text('{"kind": "a"}\n\n{"kind": "b"}\n', encoding="utf-8")
    assert [event["kind"] for event in read_events(path)] == ["a", "b"]
