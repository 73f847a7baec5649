"""The live display's reading and formatting (fdl.launch.live): hostile files show nothing, lines
never exceed the terminal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fdl.launch.live import format_status
from fdl.rundir.progress import FILE, MAX_BYTES, read_snapshot

SNAPSHOT = {"schema": 1, "epoch": 2, "epochs": 5, "epoch_fraction": 0.5, "samples": 7000,
            "total_samples": 20000, "elapsed_s": 3.0, "samples_per_s": 7120.4, "eta_s": 62.0,
            "shares": [0.71, 0.29], "loss": 0.4623, "sync_overhead": 0.018, "anchor": 20,
            "world_size": 2}


def test_format_shows_every_figure() -> None:
    first, second = format_status(SNAPSHOT, width=100).split("\n")
    assert first.startswith("epoch 2/5 ") and first.endswith(" 50%  1:02 left")
    assert second == "7,120 samples/s  loss 0.4623  sync 1.8%  anchor 20  ranks 71% 29%"
    assert first.count("━") == (100 - len("epoch 2/5 ") - len("  50%  1:02 left")) // 2


@pytest.mark.parametrize("width", [20, 40, 79, 80, 200])
def test_lines_fit_the_width(width: int) -> None:
    for line in format_status(SNAPSHOT, width=width).split("\n"):
        assert len(line) <= width


@pytest.mark.parametrize("junk", [None, "x", True, float("nan"), float("inf"), -5, [1], {"a": 1}])
def test_junk_values_show_as_unknown(junk: object) -> None:
    snapshot = {key: junk for key in SNAPSHOT} | {"schema": 1}
    text = format_status(snapshot, width=80)
    assert text.startswith("epoch ") and "samples/s" in text


def test_read_refuses_what_rank_0_does_not_write(tmp_path: Path) -> None:
    path = tmp_path / FILE
    assert read_snapshot(tmp_path) is None  # not yet written
    for content in (b"", b'{"schema": 1, "epo', b"[1, 2]", b'{"schema": 2}', b"\xff\xfe",
                    b'{"schema": 1, "pad": "' + b"x" * MAX_BYTES + b'"}'):
        path.write_bytes(content)
        assert read_snapshot(tmp_path) is None, content[:40]
    path.write_text(json.dumps(SNAPSHOT))
    assert read_snapshot(tmp_path) == SNAPSHOT
    path.unlink()
    path.mkdir()
    assert read_snapshot(tmp_path) is None


def test_a_hostile_run_directory_never_stops_the_display(tmp_path: Path) -> None:
    from fdl.launch.live import live_progress

    (tmp_path / "progress.json").mkdir()  # not a file: cannot be removed or read as one
    with live_progress(tmp_path, enabled=True):
        pass
    assert (tmp_path / "progress.json").is_dir()
