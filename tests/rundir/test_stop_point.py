"""Where a run that did not finish stopped, read back from hand-made run directories. No
processes (the real runs are in tests/launch/test_run_end.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fdl.rundir.stop_point import StopPoint, stop_point


def write_run(run: Path, events: dict[int, list[dict]], *, epochs: int | None = 3,
              checkpoints: dict[str, str] | None = None) -> Path:
    (run / "timeline").mkdir(parents=True)
    engine = {"epochs": {"value": epochs, "source": "script"}} if epochs else {}
    (run / "config.json").write_text(json.dumps({"fdl_version": "0", "engine": engine}))
    for rank, rank_events in events.items():
        (run / "timeline" / f"rank{rank}.jsonl").write_text(
            "".join(json.dumps({"t": 1.0, "rank": rank, **e}) + "\n" for e in rank_events))
    for name, manifest in (checkpoints or {}).items():
        (run / "checkpoints" / name).mkdir(parents=True)
        (run / "checkpoints" / name / "manifest.json").write_text(manifest)
    return run


START = {"kind": "start", "attempt": 0, "world_size": 2, "epoch": 0, "round": 0}
MANIFEST = json.dumps({"world_size": 1, "files": {
    name: {"size": 1, "sha256": "0"} for name in ("model.pt", "engine.json", "rank0.pt")}})


def rnd(index: int, epoch: int) -> dict:
    return {"kind": "round", "round": index, "epoch": epoch, "steps": 1, "samples": 1,
            "compute_s": 0.1, "data_s": 0.0}


@pytest.mark.parametrize(("events", "where"), [
    ([START, rnd(0, 0), rnd(1, 0)], "in epoch 1 of 3 (after round 1)"),
    # epoch 1 ended, epoch 2's first round had not: the run was in epoch 2
    ([START, rnd(0, 0), rnd(1, 0), {"kind": "epoch", "epoch": 1}],
     "in epoch 2 of 3 (after round 1)"),
    ([START], "in epoch 1 of 3 (before its first round ended)"),
    # a resumed attempt, interrupted before its first round ended
    ([START, rnd(0, 0), {**START, "attempt": 1, "epoch": 1, "round": 5}],
     "in epoch 2 of 3 (before its first round ended)"),
    # after the last epoch ended (the final evaluation): still the last epoch
    ([START, rnd(0, 2), {"kind": "epoch", "epoch": 3}], "in epoch 3 of 3 (after round 0)"),
    ([], "before its first round ended"),
])
def test_where_a_run_stopped(tmp_path, events, where):
    assert stop_point(write_run(tmp_path / "run", {0: events})).where() == where


def test_the_lowest_rank_here_speaks_when_rank_0_left_nothing(tmp_path):
    run = write_run(tmp_path / "run", {1: [START, rnd(0, 0)], 3: [START]})
    assert stop_point(run) == StopPoint(epoch=1, epochs=3, round=0, checkpoint=None)


def test_no_timeline_is_no_stop_point(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    assert stop_point(run) is None


def test_epochs_unknown_and_a_config_fdl_cannot_use_leave_them_out(tmp_path):
    run = write_run(tmp_path / "run", {0: [START, rnd(4, 1)]}, epochs=None)
    assert stop_point(run).where() == "in epoch 2 (after round 4)"
    (run / "config.json").write_text('{"engine": 3}')
    assert stop_point(run).where() == "in epoch 2 (after round 4)"


def test_the_newest_checkpoint_with_a_manifest_in_place_counts(tmp_path):
    run = write_run(tmp_path / "run", {0: [START]}, checkpoints={
        "ckpt-r00000004": MANIFEST, "ckpt-r00000009": MANIFEST,
        "ckpt-r00000012": "{torn"})  # being written when the run stopped
    assert stop_point(run).checkpoint == "ckpt-r00000009"
