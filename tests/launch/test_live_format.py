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


@pytest.mark.parametrize(("wait", "shown"), [
    (0.093, "  data 9.3%"), (0.0099, ""), (0.0, ""), (None, ""), (-0.2, ""), ("x", ""),
    (float("nan"), ""), (7.0, "  data 100.0%"),
])
def test_the_data_wait_shows_from_one_percent(wait: object, shown: str) -> None:
    """A rank fed too slowly by its loader says so; below 1% (or junk) it says nothing."""
    second = format_status(SNAPSHOT | {"data_wait": wait}, width=200).split("\n")[1]
    assert second == f"7,120 samples/s  loss 0.4623  sync 1.8%{shown}  anchor 20  ranks 71% 29%"


@pytest.mark.parametrize("width", [20, 40, 79, 80, 200])
def test_lines_fit_the_width(width: int) -> None:
    for snapshot in (SNAPSHOT, SNAPSHOT | {"first_step": True}):
        for line in format_status(snapshot, width=width).split("\n"):
            assert len(line) <= width


def test_the_first_step_says_it_is_being_taken() -> None:
    """Before rank 0's first step ends (a compilation can take half a minute) there is no figure
    to show: the second line says what is going on. Only a true first_step does."""
    first, second = format_status(SNAPSHOT | {"first_step": True}, width=100).split("\n")
    assert first.startswith("epoch 2/5 ")
    assert second == "taking the first step (a torch.compile'd model compiles in it)"
    for junk in (False, 1, "yes", None):
        assert "first step" not in format_status(SNAPSHOT | {"first_step": junk}, width=100)


@pytest.mark.parametrize("junk", [None, "x", True, float("nan"), float("inf"), float("-inf"),
                                  -5, -0.5, [1], {"a": 1}])
def test_junk_values_show_as_unknown(junk: object) -> None:
    """Every field junk: each figure shows as unknown (``?``, ``-``, ``-:--``), never as the
    junk (a negative rate, epoch or anchor is not one rank 0 writes). The loss is the one
    figure that may be negative (a log-likelihood can be), so a finite -5 still shows."""
    snapshot = {key: junk for key in SNAPSHOT} | {"schema": 1}
    first, second = format_status(snapshot, width=80).split("\n")
    assert first.startswith("epoch ?/? ╺") and first.endswith("   0%  -:-- left"), first
    assert len(first) == 80
    loss = f"loss {junk:.4f}" if junk in (-5, -0.5) else "loss -"
    anchor = "" if junk is None else "  anchor ?"  # present but not a count: unknown
    assert second == f"- samples/s  {loss}{anchor}"


@pytest.mark.parametrize(("shares", "shown"), [
    ([0.71, 0.29], "ranks 71% 29%"),
    ([0.5, -0.1], "ranks 50% ?"),
    ([float("nan"), 1.5], "ranks ? ?"),
    (["x", None], "ranks ? ?"),
])
def test_each_rank_share_is_a_figure_or_unknown(shares: list, shown: str) -> None:
    second = format_status(SNAPSHOT | {"shares": shares}, width=100).split("\n")[1]
    assert second.endswith(f"anchor 20  {shown}"), second


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


@pytest.mark.parametrize(("precisions", "shown"), [
    (["bf16", "fp32"], "  precision bf16 fp32"),
    (["bf16", "bf16", "bf16"], "  precision bf16"),  # one word when every rank trains in it
    (["fp16"], "  precision fp16"),
    (["bf16", 16, None, "bf16\x1b[31m", "x" * 40], "  precision bf16 ? ? ? ?"),
    ([], ""), ("bf16", ""), (None, ""),  # not a list of ranks: left out
])
def test_each_ranks_precision_follows_the_shares(precisions: object, shown: str) -> None:
    second = format_status(SNAPSHOT | {"precisions": precisions}, width=200).split("\n")[1]
    assert second == f"7,120 samples/s  loss 0.4623  sync 1.8%  anchor 20  ranks 71% 29%{shown}"


def test_the_precisions_rank_0_writes_reach_the_display(tmp_path: Path) -> None:
    from fdl.rundir.progress import ProgressFile

    writer = ProgressFile(tmp_path / FILE, 0.25, 5, 4000, 2)
    writer.write(samples=10, epoch=0, shares=[0.6, 0.4], anchor=3, sync_s=0, busy_s=1,
                 precisions=["bf16", "fp32"])
    snapshot = read_snapshot(tmp_path)
    assert snapshot is not None
    assert format_status(snapshot, width=200).endswith("ranks 60% 40%  precision bf16 fp32")
