"""`fdl bench` end to end with real `fdl run` cells (gloo workers on CPU): a sweep killed after
its first cell resumes the rest, a finished sweep reruns nothing and rebuilds its report, and a
failing cell is recorded while the sweep goes on."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import clean_env, run_fdl, wait_until

from fdl.bench.sweep import Cell, CellFailed, run_cell

# the sweep's cells measure the workers' speed:
# these tests run with no other test beside them (tests/conftest.py)
pytestmark = pytest.mark.alone

RECORD_FIELDS = {
    "model", "dataset", "mode", "policy", "backend", "seed", "world_size", "slowdown", "metric",
    "higher_is_better", "eval", "reference", "reference_source", "wall_s", "samples",
    "samples_per_s", "syncs", "sync_overhead", "idle_fraction", "ideal_samples_per_s",
    "history", "emulated", "run_dir"}


def bench_args(out: Path) -> list[str]:
    return ["bench", "--model", "logreg", "--mode", "solo@1x", "--mode", "cadence-cpu",
            "--epochs", "1", "--simulate-slowdown", "1,2", "--dataset", "synthetic",
            "--out", str(out)]


def read_results(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def kill_after_first_cell(out: Path) -> None:
    """Start the sweep in its own session and kill all of it once one cell is recorded."""
    proc = subprocess.Popen([sys.executable, "-m", "fdl", *bench_args(out)], env=clean_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    results = out / "results.jsonl"
    try:
        wait_until(lambda: results.is_file() and results.read_text().count("\n") >= 1,
                   "the first cell's record", proc=proc)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """The killed and resumed sweep, shared by the tests of this file, which only read it: a
    test that changes a sweep works on its own copy (:func:`copy_of`), so each passes alone and
    in any order."""
    out = tmp_path_factory.mktemp("bench") / "out"
    kill_after_first_cell(out)
    first = read_results(out)
    resumed = run_fdl(*bench_args(out), timeout=120)
    return out, first, resumed


def copy_of(out: Path, tmp_path: Path) -> Path:
    """A copy of the sweep directory ``out`` (its records name their runs relative to it)."""
    return Path(shutil.copytree(out, tmp_path / "out"))


def test_killed_sweep_resumes_the_remaining_cells(sweep):
    out, first, resumed = sweep
    assert [r["mode"] for r in first] == ["solo@1x"]
    assert resumed.returncode == 0, resumed.stderr
    assert "1 of 2 cell(s) already in" in resumed.stderr
    records = read_results(out)
    assert [r["mode"] for r in records] == ["solo@1x", "cadence-cpu"]
    assert not (out / "failures.jsonl").exists()


def test_records_have_the_contract_fields_and_real_figures(sweep):
    out, _, _ = sweep
    solo, cadence = read_results(out)
    for record in (solo, cadence):
        assert set(record) == RECORD_FIELDS
        assert record["dataset"] == "synthetic" and record["metric"] == "accuracy"
        assert record["samples"] == 16384 and record["samples_per_s"] > 0
        assert 0.1 < record["eval"] <= 1.0  # 10 classes: a trained model beats chance
        assert [h["epoch"] for h in record["history"]] == [1]
        assert record["history"][0]["eval"] == record["eval"]
        assert (out / record["run_dir"] / "summary.json").is_file()
    assert (solo["policy"], solo["world_size"], solo["slowdown"]) == ("solo", 1, [1.0])
    assert solo["syncs"] is None and solo["idle_fraction"] is None
    assert solo["ideal_samples_per_s"] is None and solo["emulated"] is False
    assert (cadence["policy"], cadence["backend"], cadence["world_size"]) == ("cadence", "cpu", 2)
    assert cadence["slowdown"] == [1.0, 2.0] and cadence["emulated"] is True
    assert cadence["syncs"] >= 1 and 0 <= cadence["idle_fraction"] <= 1
    assert cadence["ideal_samples_per_s"] > 0


def test_sweep_writes_machine_facts_and_report(sweep):
    out, _, resumed = sweep
    meta = json.loads((out / "sweep.json").read_text())
    assert meta["machine"]["logical_cores"] >= 1 and meta["machine"]["torch"]
    assert meta["args"]["models"] == ["logreg"] and len(meta["sessions"]) == 2
    report = json.loads((out / "report.json").read_text())
    assert report["schema"] == 1
    assert [row["mode"] for row in report["rows"]] == ["solo@1x", "cadence-cpu"]
    assert "## logreg" in (out / "report.md").read_text()
    assert str(out / "report.md") in resumed.stdout


def test_rerun_skips_every_cell_and_rebuilds_the_report(sweep, tmp_path):
    out = copy_of(sweep[0], tmp_path)
    (out / "report.md").unlink()
    rerun = run_fdl(*bench_args(out), timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    assert "2 of 2 cell(s) already in" in rerun.stderr
    assert len(read_results(out)) == 2
    assert len(json.loads((out / "sweep.json").read_text())["sessions"]) == 3
    assert (out / "report.md").is_file()
    assert "cadence-cpu" in rerun.stdout  # the summary table


def test_bench_report_regenerates_the_files(sweep, tmp_path):
    out = copy_of(sweep[0], tmp_path)
    (out / "report.json").unlink()
    proc = run_fdl("bench", "report", str(out))
    assert proc.returncode == 0, proc.stderr
    assert str(out / "report.json") in proc.stdout.splitlines()
    assert json.loads((out / "report.json").read_text())["schema"] == 1


def test_a_failing_cell_is_recorded_and_raises(tmp_path):
    cell = Cell("logreg", "mnist", "solo@1x", "solo", None, 0, 1, (1.0,), 1)
    with pytest.raises(CellFailed) as caught:  # mnist is not in the empty cache
        run_cell(cell, out_dir=tmp_path / "out", data_dir=tmp_path / "data")
    assert caught.value.returncode != 0
    failure = json.loads((tmp_path / "out" / "failures.jsonl").read_text())
    assert failure["key"] == cell.key and failure["exit_code"] == caught.value.returncode
    assert any("not in the cache" in line for line in failure["log_tail"])
    assert not (tmp_path / "out" / "results.jsonl").exists()


def test_bad_input_is_a_usage_error_and_starts_nothing(tmp_path):
    proc = run_fdl("bench", "--mode", "sync-nccl", "--out", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: unknown mode 'sync-nccl' (nccl needs 2 or more GPUs)")
    assert not (tmp_path / "out").exists()
