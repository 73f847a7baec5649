"""fdl run's live progress display and its TensorBoard scalars, on real runs: 2 gloo workers
training with fdl.Trainer, the launcher on a real pseudo-terminal (what a user's terminal is to
it), TensorBoard's own reader on the event files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers import GUARD_S, clean_env, end_process_tree, run_fdl, wait_until

from fdl.launch.live import FIRST_STEP

# the live figures are the workers' measured speed:
# these tests run with no other test beside them (tests/conftest.py)
pytestmark = pytest.mark.alone

SCRIPT = Path(__file__).parent / "scripts" / "watched_train.py"
STATUS = "samples/s  loss"  # the live display's second line; the epoch lines have one space


class Terminal:
    """``python -m fdl ARGS`` with stdout and stderr on a pseudo-terminal, read as it comes. A
    context manager: on the way out, passed or failed, the launcher and its workers are ended
    (a test that fails before it releases the workers would otherwise leave them waiting)."""

    def __init__(self, *args: str, cwd: Path) -> None:
        self._argv, self._cwd, self._data = [sys.executable, "-m", "fdl", *args], cwd, bytearray()

    def __enter__(self) -> Terminal:
        master, slave = os.openpty()
        env = clean_env({"TERM": "xterm", "COLUMNS": "120"})
        try:
            self.proc = subprocess.Popen(self._argv, cwd=self._cwd, env=env,
                                         stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                                         start_new_session=True)
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(slave)
        self._master = master
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            end_process_tree(self.proc)
        finally:
            self._reader.join(timeout=GUARD_S)
            os.close(self._master)

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self._master, 65536)
            except OSError:  # the terminal's other side closed
                return
            if not chunk:
                return
            self._data.extend(chunk)

    @property
    def text(self) -> str:
        return bytes(self._data).decode("utf-8", "replace")

    def finish(self) -> tuple[int, str]:
        """The launcher's exit code once it ends by itself, and all it wrote."""
        code = self.proc.wait(timeout=GUARD_S)
        self._reader.join(timeout=GUARD_S)
        return code, self.text


def test_live_progress_on_a_terminal_and_tensorboard_scalars_match_metrics(tmp_path: Path) -> None:
    run_dir, release, first = tmp_path / "run", tmp_path / "release", tmp_path / "first"
    with Terminal("run", "--run-dir", str(run_dir), "--nproc-per-node", "2",
                  "--simulate-slowdown", "1,2", str(SCRIPT), str(release), str(first),
                  "--tensorboard", cwd=tmp_path) as terminal:
        # The first step holds (as a compilation does) until the display says it is taken,
        wait_until(lambda: FIRST_STEP in terminal.text, "the first step's line",
                   proc=terminal.proc)
        assert STATUS not in terminal.text
        first.touch()
        # and training at its third step until the display has shown rank 0's progress.
        wait_until(lambda: STATUS in terminal.text, "the live progress line", proc=terminal.proc)
        release.touch()
        code, text = terminal.finish()
    assert code == 0, text
    status = next(line for line in text.replace("\r", "\n").splitlines() if STATUS in line)
    assert "ranks " in status and "anchor " in status, status
    assert "epoch 1/3 " in text and "left" in text  # the first line: epoch, bar, time left
    for epoch in (1, 2, 3):  # the per-epoch lines stay
        assert f"epoch {epoch}/3  loss " in text
    # Planned into the spec, so config.json records what made rank 0 write its snapshots.
    assert json.loads((run_dir / "config.json").read_text())["env"]["FDL_PROGRESS"] == "0.25"
    snapshot = json.loads((run_dir / "progress.json").read_text())
    assert snapshot["schema"] == 1 and snapshot["world_size"] == 2
    assert snapshot["total_samples"] == 3 * 512 and 0 < snapshot["samples"] <= 3 * 512
    assert len(snapshot["shares"]) == 2 and sum(snapshot["shares"]) == pytest.approx(1, abs=1e-3)
    _assert_tensorboard_matches(run_dir / "tensorboard", _records(run_dir))


def _records(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2, 3]
    elapsed = [r["elapsed_s"] for r in records]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0
    for record in records:
        assert len(record["per_rank_samples_per_s"]) == len(record["idle_fraction"]) == 2
        assert all(0 <= idle <= 1 for idle in record["idle_fraction"])
        assert sum(record["per_rank_samples_per_s"]) == pytest.approx(
            record["epoch_samples_per_s"], rel=1e-6)
        assert record["anchor"] >= 1
    return records


def _assert_tensorboard_matches(log_dir: Path, records: list[dict]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    expected = {
        "train/loss": [r["train_loss"] for r in records],
        "eval/accuracy": [r["eval"]["accuracy"] for r in records],
        "throughput/samples_per_s": [r["epoch_samples_per_s"] for r in records],
        "throughput/rank0": [r["per_rank_samples_per_s"][0] for r in records],
        "throughput/rank1": [r["per_rank_samples_per_s"][1] for r in records],
        "idle/rank0": [r["idle_fraction"][0] for r in records],
        "idle/rank1": [r["idle_fraction"][1] for r in records],
        "elche/anchor": [r["anchor"] for r in records],
    }
    with_sync = [r for r in records if r["sync_overhead"] is not None]
    assert with_sync, "two workers averaged: every epoch has a sync overhead"
    # and each round's mean of what the step logged (the Trainer logs its loss)
    assert set(events.Tags()["scalars"]) == {*expected, "sync/overhead", "step/loss"}
    step_loss = events.Scalars("step/loss")
    assert step_loss and all(0 < p.value < 10 for p in step_loss)
    assert [p.step for p in step_loss] == sorted(p.step for p in step_loss)
    for tag, values in expected.items():
        points = events.Scalars(tag)
        assert [p.step for p in points] == [r["samples"] for r in records], tag
        assert [p.value for p in points] == pytest.approx(values, rel=1e-6), tag
    overhead = events.Scalars("sync/overhead")
    assert [p.step for p in overhead] == [r["samples"] for r in with_sync]
    assert [p.value for p in overhead] == pytest.approx([r["sync_overhead"] for r in with_sync],
                                                        rel=1e-6)


def test_quiet_on_a_terminal_shows_plain_lines_only(tmp_path: Path) -> None:
    run_dir, release = tmp_path / "run", tmp_path / "release"
    release.touch()
    with Terminal("run", "--quiet", "--run-dir", str(run_dir), "--nproc-per-node", "2",
                  str(SCRIPT), str(release), cwd=tmp_path) as terminal:
        code, text = terminal.finish()
    assert code == 0, text
    assert STATUS not in text and " left" not in text
    assert "epoch 3/3  loss " in text
    assert not (run_dir / "progress.json").exists()  # rank 0 was not asked for snapshots
    assert not (run_dir / "tensorboard").exists()


def test_off_a_terminal_no_snapshots_are_written(tmp_path: Path) -> None:
    run_dir, release = tmp_path / "run", tmp_path / "release"
    release.touch()
    proc = run_fdl("run", "--run-dir", str(run_dir), "--nproc-per-node", "1", str(SCRIPT),
                   str(release), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert STATUS not in proc.stdout + proc.stderr
    assert "epoch 3/3  loss " in proc.stdout + proc.stderr
    assert not (run_dir / "progress.json").exists()
