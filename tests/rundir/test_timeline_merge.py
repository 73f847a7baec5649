"""The merged run timeline: spans, idle gaps and event times from a hand-written run directory
(two ranks, a restart, a truncated samples line), its CSV, and the files written for it."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from helpers import without_module

from fdl.rundir.timeline_merge import CSV_COLUMNS, merge_timeline, timeline_csv, write_timeline

T0 = 1000.0
# All times are binary fractions, so relative times come out exact.
RANK0 = [
    {"t": 1000.0, "kind": "start", "attempt": 0, "world_size": 2, "resumed_from": None},
    {"t": 1001.0, "kind": "round", "round": 0, "epoch": 0, "steps": 4, "samples": 64,
     "compute_s": 0.75, "data_s": 0.25, "step_ms": 187.5, "sleep_s": 0.0, "anchor": 4},
    {"t": 1001.5, "kind": "sync", "round": 0, "wait_s": 0.25, "bytes": 800, "blocking": True,
     "start": 17.0, "end": 17.25},
    {"t": 1001.5, "kind": "anchor", "round": 0, "anchor": 6, "previous": 4,
     "reason": "overhead 0.2 > 0.05"},
    {"t": 1002.0, "kind": "epoch", "epoch": 1, "train_loss": 0.5, "eval": {"accuracy": 0.75}},
    # no data_s: a file written before the field existed; 0.125 s in DDP's all-reduce
    {"t": 1003.0, "kind": "round", "round": 1, "epoch": 1, "steps": 6, "samples": 96,
     "compute_s": 0.5, "step_ms": 83.3, "sleep_s": 0.0, "comm_s": 0.125, "anchor": 6},
    {"t": 1003.25, "kind": "sync", "round": 1, "wait_s": 0.25, "bytes": 800, "blocking": True,
     "start": 19.0, "end": 19.25},
]
RANK1 = [
    {"t": 1000.5, "kind": "start", "attempt": 0, "world_size": 2, "resumed_from": None},
    {"t": 1001.25, "kind": "round", "round": 0, "epoch": 0, "steps": 2, "samples": 32,
     "compute_s": 0.5, "data_s": 0.0, "step_ms": 250.0, "sleep_s": 0.25, "anchor": 4},
    {"t": 1001.5, "kind": "sync", "round": 0, "wait_s": 0.25, "bytes": 800, "blocking": True,
     "start": 5.0, "end": 5.25},
    # the worker died here and came back from a checkpoint
    {"t": 1004.0, "kind": "start", "attempt": 1, "world_size": 2, "resumed_from": "round-0"},
    {"t": 1005.0, "kind": "round", "round": 2, "epoch": 1, "steps": 2, "samples": 32,
     "compute_s": 0.5, "data_s": 0.125, "step_ms": 250.0, "sleep_s": 0.0, "anchor": 6},
    {"t": 1005.25, "kind": "profiler", "note": "a kind this tool does not know"},
    {"t": 1005.5, "kind": "checkpoint", "round": 2, "epoch": 1, "name": "round-2",
     "bytes": 4096, "write_s": 0.01},
]
SAMPLES = [
    {"t": 1000.25, "node": 0, "host": "box", "cpu_percent": 50.0, "ram_used_bytes": 4,
     "ram_total_bytes": 16, "gpus": [{"cuda_index": 0, "util_percent": 90.0,
                                      "mem_used_bytes": 1, "mem_total_bytes": 2}]},
    {"t": 1000.5, "node": 0, "host": "box", "cpu_percent": 75.0, "ram_used_bytes": 8,
     "ram_total_bytes": 16, "gpus": [{"cuda_index": 0, "util_percent": None,
                                      "mem_used_bytes": None, "mem_total_bytes": None}]},
]
SUMMARY = {"policy": "cadence", "backend": "cpu", "world_size": 2, "wall_s": 5.5}
EPOCH = {"epoch": 1, "samples": 192, "train_loss": 0.5, "eval": {"accuracy": 0.75},
         "samples_per_s": 40.0}

EXPECTED_SPANS = [
    (0, "idle", 0.0, 0.25, None), (0, "data", 0.25, 0.5, 0), (0, "compute", 0.5, 1.0, 0),
    (0, "idle", 1.0, 1.25, None), (0, "sync", 1.25, 1.5, 0), (0, "idle", 1.5, 2.5, None),
    (0, "compute", 2.5, 2.875, 1), (0, "sync", 2.875, 3.0, 1), (0, "sync", 3.0, 3.25, 1),
    (1, "idle", 0.5, 0.75, None), (1, "compute", 0.75, 1.0, 0), (1, "emulated", 1.0, 1.25, 0),
    (1, "sync", 1.25, 1.5, 0),
    (1, "idle", 1.5, 4.5, None), (1, "data", 4.5, 4.625, 2), (1, "compute", 4.625, 5.0, 2),
    (1, "idle", 5.0, 5.5, None),
]
EXPECTED_EVENTS = [(0.0, 0, "start"), (0.5, 1, "start"), (1.5, 0, "anchor"), (2.0, 0, "epoch"),
                   (4.0, 1, "start"), (5.25, 1, "profiler"), (5.5, 1, "checkpoint")]


def write_lines(path: Path, records: list[dict], *, tail: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail, encoding="utf-8")


def make_run(tmp_path: Path, *, finished: bool = True) -> Path:
    run = tmp_path / "run"
    (run / "timeline").mkdir(parents=True)
    for rank, events in enumerate([RANK0, RANK1]):
        write_lines(run / "timeline" / f"rank{rank}.jsonl",
                    [{**e, "rank": rank} for e in events])
    if finished:
        write_lines(run / "timeline" / "samples-node0.jsonl", SAMPLES,
                    tail='{"t": 1000.75, "node": 0, "cpu_perc')  # sampler killed mid-line
        (run / "summary.json").write_text(json.dumps(SUMMARY))
        write_lines(run / "metrics.jsonl", [EPOCH])
    return run


def test_spans_are_compute_data_sync_with_idle_filling_each_ranks_gaps(tmp_path):
    """A round's loop is split as a step runs: data, compute, DDP's all-reduce (sync), the
    emulated slowdown's sleep (emulated), which is never drawn as compute."""
    doc = merge_timeline(make_run(tmp_path))
    assert doc["schema"] == 1 and doc["t0"] == T0 and doc["ranks"] == [0, 1]
    spans = [(s["rank"], s["kind"], s["start"], s["end"], s["round"]) for s in doc["spans"]]
    assert spans == EXPECTED_SPANS
    assert doc["duration"] == 5.5


def test_a_wait_in_the_step_loop_is_drawn_idle_not_compute(tmp_path):
    """A round whose loop took 1 s but whose timed steps (busy_s) took 0.5 s, 0.25 s of it the
    emulated sleep: data, compute and emulated from the loop's start, the wait left idle."""
    run = tmp_path / "run"
    (run / "timeline").mkdir(parents=True)
    write_lines(run / "timeline" / "rank0.jsonl", [
        {"t": 1000.0, "kind": "start", "rank": 0},
        {"t": 1001.0, "kind": "round", "rank": 0, "round": 0, "compute_s": 1.0, "busy_s": 0.5,
         "data_s": 0.125, "sleep_s": 0.25, "comm_s": 0.0}])
    spans = [(s["kind"], s["start"], s["end"]) for s in merge_timeline(run)["spans"]]
    assert spans == [("data", 0.0, 0.125), ("compute", 0.125, 0.25), ("emulated", 0.25, 0.5),
                     ("idle", 0.5, 1.0)]


def test_events_keep_their_fields_with_relative_times_and_restarts_visible(tmp_path):
    doc = merge_timeline(make_run(tmp_path))
    assert [(e["t"], e["rank"], e["kind"]) for e in doc["events"]] == EXPECTED_EVENTS
    anchor = doc["events"][2]
    assert anchor == {"t": 1.5, "rank": 0, "kind": "anchor", "round": 0, "anchor": 6,
                      "previous": 4, "reason": "overhead 0.2 > 0.05"}
    restart = doc["events"][4]
    assert restart["attempt"] == 1 and restart["resumed_from"] == "round-0"


def test_samples_skip_the_truncated_line_and_epochs_summary_come_along(tmp_path):
    doc = merge_timeline(make_run(tmp_path))
    assert [s["t"] for s in doc["samples"]] == [0.25, 0.5]
    assert doc["samples"][1]["gpus"][0]["util_percent"] is None
    assert doc["epochs"] == [EPOCH]
    assert doc["summary"] == SUMMARY


def test_a_span_before_the_first_event_moves_t0_back(tmp_path):
    run = tmp_path / "run"
    (run / "timeline").mkdir(parents=True)
    write_lines(run / "timeline" / "rank0.jsonl",
                [{"t": 2000.5, "rank": 0, "kind": "round", "round": 0, "compute_s": 0.5}])
    doc = merge_timeline(run)
    assert doc["t0"] == 2000.0
    assert [(s["kind"], s["start"], s["end"]) for s in doc["spans"]] == [("compute", 0.0, 0.5)]


def test_csv_has_fixed_columns_and_one_row_per_span_event_and_sample(tmp_path):
    doc = merge_timeline(make_run(tmp_path))
    rows = list(csv.DictReader(io.StringIO(timeline_csv(doc))))
    assert tuple(rows[0].keys()) == CSV_COLUMNS
    records = [row["record"] for row in rows]
    assert records == ["span"] * 17 + ["event"] * 7 + ["sample"] * 2
    data = rows[1]
    assert (data["kind"], data["rank"], data["round"], data["t"], data["end"],
            data["duration_s"], data["detail"]) == ("data", "0", "0", "0.25", "0.5", "0.25", "")
    checkpoint = rows[23]
    assert (checkpoint["kind"], checkpoint["rank"], checkpoint["round"], checkpoint["t"]) == (
        "checkpoint", "1", "2", "5.5")
    assert json.loads(checkpoint["detail"]) == {"epoch": 1, "name": "round-2", "bytes": 4096,
                                                "write_s": 0.01}
    sample = rows[24]
    assert (sample["node"], sample["t"], sample["cpu_percent"], sample["ram_used_bytes"],
            sample["ram_total_bytes"]) == ("0", "0.25", "50.0", "4", "16")
    assert json.loads(sample["detail"])["gpus"][0]["util_percent"] == 90.0


def test_write_timeline_writes_every_artifact_and_leaves_no_temporary_file(tmp_path):
    run = make_run(tmp_path)
    written = write_timeline(run)
    directory = run / "timeline"
    names = [p.name for p in written]
    assert names[:4] == ["timeline.json", "timeline.csv", "timeline.html", "trace.json"]
    assert all(p.parent == directory and p.stat().st_size > 0 for p in written)
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        ["rank0.jsonl", "rank1.jsonl", "samples-node0.jsonl", *names])
    assert json.loads((directory / "timeline.json").read_text()) == merge_timeline(run)
    assert (directory / "timeline.csv").read_text() == timeline_csv(merge_timeline(run))
    # a second run replaces the files in place
    assert write_timeline(run) == written


def test_a_crashed_run_still_gets_a_timeline(tmp_path):
    run = make_run(tmp_path, finished=False)
    with (run / "timeline" / "rank1.jsonl").open("a") as handle:
        handle.write('{"t": 1006.0, "rank": 1, "kind": "rou')  # killed mid-line
    doc = merge_timeline(run)
    assert doc["summary"] is None and doc["epochs"] == [] and doc["samples"] == []
    assert [(s["rank"], s["kind"], s["start"], s["end"], s["round"])
            for s in doc["spans"]] == EXPECTED_SPANS
    written = write_timeline(run)
    assert [p.name for p in written] == ["timeline.json", "timeline.csv", "timeline.html",
                                         "trace.json"]
    assert not (run / "timeline" / "curves.png").exists()


def test_a_run_that_recorded_nothing_gets_an_empty_document(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    doc = merge_timeline(run)
    assert (doc["t0"], doc["ranks"], doc["spans"], doc["events"]) == (None, [], [], [])
    assert [p.name for p in write_timeline(run)] == ["timeline.json", "timeline.csv",
                                                     "timeline.html", "trace.json"]
    assert (run / "timeline" / "timeline.csv").read_text().splitlines() == [",".join(CSV_COLUMNS)]


def test_timeline_json_is_strict_json_even_when_a_loss_diverged(tmp_path):
    run = make_run(tmp_path, finished=False)
    with (run / "timeline" / "rank0.jsonl").open("a") as handle:
        handle.write('{"t": 1004.0, "rank": 0, "kind": "epoch", "epoch": 2, "train_loss": NaN}\n')
    write_timeline(run)

    def reject(constant):
        raise AssertionError(f"{constant} in timeline.json")

    doc = json.loads((run / "timeline" / "timeline.json").read_text(), parse_constant=reject)
    diverged = [e for e in doc["events"] if e["kind"] == "epoch" and e["epoch"] == 2]
    assert diverged == [{"t": 4.0, "rank": 0, "kind": "epoch", "epoch": 2, "train_loss": None}]


def test_a_time_no_float_can_hold_is_skipped_like_a_missing_one(tmp_path):
    run = make_run(tmp_path, finished=False)
    with (run / "timeline" / "rank0.jsonl").open("a") as handle:
        handle.write('{"t": 1' + "0" * 400 + ', "rank": 0, "kind": "final"}\n')  # JSON allows it
    doc = merge_timeline(run)
    assert doc["t0"] == T0 and [e["kind"] for e in doc["events"]].count("final") == 0


def test_the_launcher_says_matplotlib_is_missing_only_where_there_was_a_curve(
        tmp_path, monkeypatch, capsys):
    """fdl run's end, without matplotlib: epochs with a loss get the install line; a loop's
    epochs with no number (it logged no loss, evaluated nothing) get none: the line said
    "matplotlib is not installed" on machines that had it."""
    from types import SimpleNamespace

    from fdl.cli.run import _write_timeline

    without_module(monkeypatch, "matplotlib")
    run = make_run(tmp_path)
    _write_timeline(SimpleNamespace(run_dir=run))
    assert "matplotlib is not installed (pip install 'fdl[report]')" in capsys.readouterr().err
    write_lines(run / "metrics.jsonl", [{"epoch": 1, "samples": 192, "train_loss": None}])
    _write_timeline(SimpleNamespace(run_dir=run))
    assert "matplotlib" not in capsys.readouterr().err
    assert not (run / "timeline" / "curves.png").exists()
