"""Rank 0's progress snapshots (fdl.rundir.progress): when they are written, and what they say."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fdl.rundir.progress import WINDOW_S, ProgressFile


def _writer(tmp_path: Path, **env: str) -> ProgressFile | None:
    return ProgressFile.from_env(tmp_path, rank=0, epochs=4, epoch_size=1000, world_size=2,
                                 env=env)


def test_only_rank_0_with_a_run_directory_and_a_positive_interval_writes(tmp_path: Path) -> None:
    assert _writer(tmp_path) is None  # fdl run did not ask (no terminal, or --quiet)
    for bad in ("", "0", "-1", "nan", "inf", "soon"):
        assert _writer(tmp_path, FDL_PROGRESS=bad) is None, bad
    writer = _writer(tmp_path, FDL_PROGRESS="0.25")
    assert writer is not None and writer.interval_s == 0.25
    assert writer.path == tmp_path / "progress.json"
    assert ProgressFile.from_env(tmp_path, rank=1, epochs=4, epoch_size=1000, world_size=2,
                                 env={"FDL_PROGRESS": "0.25"}) is None
    assert ProgressFile.from_env(None, rank=0, epochs=4, epoch_size=1000, world_size=2,
                                 env={"FDL_PROGRESS": "0.25"}) is None
    tiny = _writer(tmp_path, FDL_PROGRESS="0.000001")
    assert tiny is not None and tiny.interval_s >= 0.05  # never a write per step


def test_snapshot_rate_eta_and_epoch_position(tmp_path: Path) -> None:
    writer = _writer(tmp_path, FDL_PROGRESS="0.25")
    assert writer is not None
    first = writer.snapshot(now=100.0, samples=1200, epoch=1, shares=[0.7, 0.3], anchor=8,
                            sync_s=0.0, busy_s=0.0)
    assert first["samples_per_s"] is None and first["eta_s"] is None  # one point: no rate yet
    assert first["sync_overhead"] is None
    snap = writer.snapshot(now=102.0, samples=2200, epoch=2, shares=[0.7, 0.3], anchor=8,
                           sync_s=0.5, busy_s=10.0, data_s=1.5)
    assert snap["samples_per_s"] == pytest.approx(500.0)
    assert snap["eta_s"] == pytest.approx((4000 - 2200) / 500)
    assert (snap["epoch"], snap["epochs"]) == (3, 4)  # 1-based, as the epoch lines count
    assert snap["epoch_fraction"] == pytest.approx(0.2)
    assert snap["sync_overhead"] == pytest.approx(0.05)
    assert snap["data_wait"] == pytest.approx(0.15) and first["data_wait"] is None
    assert snap["total_samples"] == 4000 and snap["shares"] == [0.7, 0.3]


def test_the_first_step_s_snapshot_says_so_and_leaves_the_rate_alone(tmp_path: Path) -> None:
    """Written before the process's first step (a compilation: half a minute): it says so, has
    no rate, leaves the next snapshot due (the first step's end replaces it at once), and the
    rate after it counts from the first snapshot of training, not from it."""
    writer = _writer(tmp_path, FDL_PROGRESS="0.25")
    assert writer is not None and not writer.written
    writer.write(samples=0, epoch=0, shares=[0.5, 0.5], anchor=4, sync_s=0, busy_s=0,
                 first_step=True)
    assert writer.written and writer.due()
    first = json.loads(writer.path.read_text())
    assert first["first_step"] is True and first["samples_per_s"] is None
    assert first["epoch"] == 1 and first["epoch_fraction"] == 0
    writer.snapshot(now=130.0, samples=100, epoch=0, shares=[0.5, 0.5], anchor=4, sync_s=0,
                    busy_s=1)
    snap = writer.snapshot(now=131.0, samples=600, epoch=0, shares=[0.5, 0.5], anchor=4,
                           sync_s=0, busy_s=1)
    assert snap["samples_per_s"] == pytest.approx(500.0) and "first_step" not in snap


def test_the_rate_forgets_the_distant_past(tmp_path: Path) -> None:
    writer = _writer(tmp_path, FDL_PROGRESS="0.25")
    assert writer is not None
    writer.snapshot(now=0.0, samples=0, epoch=0, shares=[1.0], anchor=1, sync_s=0, busy_s=1)
    writer.snapshot(now=1.0, samples=10, epoch=0, shares=[1.0], anchor=1, sync_s=0, busy_s=1)
    later = WINDOW_S + 5
    writer.snapshot(now=later, samples=500, epoch=0, shares=[1.0], anchor=1, sync_s=0, busy_s=1)
    snap = writer.snapshot(now=later + 1, samples=600, epoch=0, shares=[1.0], anchor=1,
                           sync_s=0, busy_s=1)
    assert snap["samples_per_s"] == pytest.approx(100.0)  # the slow start is out of the window


def test_write_is_due_once_per_interval_and_survives_an_unwritable_directory(
        tmp_path: Path) -> None:
    writer = _writer(tmp_path, FDL_PROGRESS="1000")
    assert writer is not None and writer.due()
    writer.loss = 0.5
    writer.write(samples=10, epoch=0, shares=[0.5, 0.5], anchor=4, sync_s=0, busy_s=1)
    assert not writer.due()
    document = json.loads(writer.path.read_text())
    assert document["loss"] == 0.5 and document["samples"] == 10
    gone = ProgressFile(tmp_path / "missing" / "progress.json", 0.25, 1, 10, 1)
    gone.write(samples=1, epoch=0, shares=[1.0], anchor=1, sync_s=0, busy_s=1)  # no raise
    assert not (tmp_path / "missing").exists()


def test_each_ranks_precision_rides_every_snapshot_once_given(tmp_path: Path) -> None:
    writer = _writer(tmp_path, FDL_PROGRESS="0.25")
    assert writer is not None
    before = writer.snapshot(now=0.0, samples=0, epoch=0, shares=[0.5, 0.5], anchor=1,
                             sync_s=0, busy_s=1)
    assert "precisions" not in before  # none given yet: the snapshot's older shape
    writer.write(samples=10, epoch=0, shares=[0.5, 0.5], anchor=1, sync_s=0, busy_s=1,
                 precisions=["bf16", "fp32"])
    assert json.loads(writer.path.read_text())["precisions"] == ["bf16", "fp32"]
    writer.write(samples=20, epoch=0, shares=[0.5, 0.5], anchor=1, sync_s=0, busy_s=1)
    assert json.loads(writer.path.read_text())["precisions"] == ["bf16", "fp32"]


def test_precisions_set_once_on_the_writer(tmp_path: Path) -> None:
    writer = _writer(tmp_path, FDL_PROGRESS="0.25")
    assert writer is not None
    writer.precisions = ["fp16", "fp16"]
    snap = writer.snapshot(now=0.0, samples=0, epoch=0, shares=[0.5, 0.5], anchor=1,
                           sync_s=0, busy_s=1)
    assert snap["precisions"] == ["fp16", "fp16"]
