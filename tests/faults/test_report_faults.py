"""Faults in what ``fdl report`` and the timeline merge read back from a run directory, and in
the JSON-lines files fdl appends to: hand-made run directories, no training.

* a rank's timeline truncated, missing, binary or with malformed records: the report still
  comes out, and says which rank is incomplete and what its figures cover (exit 0);
* a summary.json / config.json fdl cannot use: one ``error:`` line and a ``hint:``, exit 2, no
  traceback, and no hang (a world_size of 1e9);
* a torn last line (a writer killed mid-line): every appender starts on a fresh line, so the
  next record (a resumed run's first event) is not glued onto the fragment and lost."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import assert_one_error, run_fdl

from fdl.bench.results import append_record
from fdl.engine.utilisation import UtilisationSampler
from fdl.errors import UsageError
from fdl.files import read_jsonl
from fdl.rundir.config import merge_engine
from fdl.rundir.metrics import EpochRecord, append_epoch, read_epochs
from fdl.rundir.report import build_report, load_run, run_report
from fdl.rundir.timeline import Timeline, read_events
from fdl.rundir.timeline_merge import merge_timeline

SUMMARY = {"policy": "cadence", "backend": "cpu", "world_size": 2, "devices": ["cpu", "cpu"],
           "emulated_slowdown": None, "epochs": 2, "samples": 400, "wall_s": 10.0,
           "throughput": {"samples_per_s": 40.0, "per_rank_samples_per_s": [30.0, 10.0]},
           "sync": {"rounds": 4, "mean_ms": 100.0, "overhead": 0.02}, "idle_fraction": [0, 0],
           "eval": {"accuracy": 0.9}, "final_loss": 0.25, "anchor_history": []}


def rank_events(samples_per_round: int) -> list[dict]:
    """Four rounds of one rank (4 x samples_per_round samples), then the final event."""
    events = [{"t": 100.0, "kind": "start", "attempt": 0}]
    for index in range(4):
        t = 101.0 + 2 * index
        events += [{"t": t, "kind": "round", "round": index, "steps": samples_per_round // 10,
                    "samples": samples_per_round, "compute_s": 1.0, "data_s": 0.1},
                   {"t": t + 0.5, "kind": "sync", "round": index, "wait_s": 0.25}]
    return [*events, {"t": 109.0, "kind": "final"}]


def make_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "timeline").mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps(SUMMARY))
    (run / "config.json").write_text(json.dumps({"engine": {"batch_size": {"value": 10}}}))
    for rank, per_round in ((0, 75), (1, 25)):
        lines = "".join(json.dumps(e) + "\n" for e in rank_events(per_round))
        (run / "timeline" / f"rank{rank}.jsonl").write_text(lines)
    return run


def cut_rank1_after(run: Path, num_lines: int) -> None:
    path = run / "timeline" / "rank1.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:num_lines]) + lines[num_lines][:17])  # and a torn line


# --- a rank's timeline incomplete: the report says so and what it covers ----------------------

@pytest.mark.parametrize(("damage", "problem", "recorded"), [
    (lambda run: cut_rank1_after(run, 5), "line(s) that are not JSON records", 50),
    (lambda run: (run / "timeline" / "rank1.jsonl").unlink(), "rank1.jsonl is missing", 0),
    (lambda run: (run / "timeline" / "rank1.jsonl").write_bytes(bytes(range(256)) * 40),
     "line(s) that are not JSON records", 0),
    (lambda run: (run / "timeline" / "rank1.jsonl").write_text(""), "rank1.jsonl is empty", 0),
], ids=["truncated", "missing", "binary", "empty"])
def test_an_incomplete_rank_timeline_is_named_with_what_its_figures_cover(tmp_path, damage,
                                                                        problem, recorded):
    run = make_run(tmp_path)
    damage(run)
    doc = run_report(run)
    assert doc["ranks"][0]["samples"] == 300 and doc["ranks"][1]["samples"] == recorded
    [item] = doc["incomplete"]
    assert item["rank"] == 1 and item["recorded_samples"] == recorded
    assert item["summary_samples"] == 100
    assert problem in item["message"]
    assert f"it records {recorded} of the 100 samples summary.json counts for it" in \
        item["message"]
    assert item["message"].startswith("rank 1's timeline is incomplete: ")
    # a rank with no step recorded has no rate: the ideal and the efficiency are unknown, not
    # rank 0's alone against both ranks' throughput
    assert (doc["ideal_samples_per_s"] is None) == (recorded == 0)
    assert (doc["efficiency"] is None) == (recorded == 0)


def test_cli_report_warns_about_the_incomplete_rank_and_still_reports(tmp_path):
    run = make_run(tmp_path)
    cut_rank1_after(run, 5)
    result = run_fdl("report", str(run))
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    [warning] = result.stderr.strip().splitlines()
    assert warning.startswith("warning: rank 1's timeline is incomplete: ")
    assert "records 50 of the 100 samples" in warning and "cover only the 50 samples" in warning
    assert "efficiency" in result.stdout


@pytest.mark.parametrize(("record", "why"), [
    ({"t": 102.0, "kind": "round", "samples": 25, "compute_s": 1.0}, "has no 'steps'"),
    ({"t": 102.0, "kind": "round", "steps": 2, "samples": "25", "compute_s": 1.0},
     "'samples' is \"25\", expected an integer in [0, "),
    ({"t": 102.0, "kind": "sync", "wait_s": None}, "'wait_s' is null"),
    ({"t": "noon", "kind": "epoch"}, "'t' is \"noon\""),
    ({"t": 102.0, "kind": 7}, "'kind' is 7"),
])
def test_a_malformed_timeline_record_is_left_out_and_named(tmp_path, record, why):
    run = make_run(tmp_path)
    with (run / "timeline" / "rank0.jsonl").open("a") as handle:
        handle.write(json.dumps(record) + "\n")
    doc = run_report(run)
    [item] = doc["incomplete"]
    assert item["rank"] == 0 and "malformed record(s) left out (first: line 11: " in \
        item["message"]
    assert why in item["message"]
    assert doc["ranks"][0]["samples"] == 300  # the good records still count


def test_a_torn_line_of_an_earlier_attempt_is_no_damage_and_only_the_last_attempt_counts(
        tmp_path):
    # moved from tests/launch/test_run_report.py (the torn last line a killed worker leaves);
    # the restarted worker appended its attempt, which is the one summary.json describes
    run = make_run(tmp_path)
    path = run / "timeline" / "rank1.jsonl"
    last_attempt = path.read_text()
    path.write_text('{"t": 90.0, "kind": "start", "attempt": 0}\n'
                    '{"t": 91.0, "kind": "round", "steps": 9, "samples": 90, "compute_s": 1.0}\n'
                    '{"t": 92.0, "kind": "rou\n' + last_attempt)
    summary, timelines, _ = load_run(run)
    assert timelines[1].events == rank_events(25) and timelines[1].problems == []
    doc = build_report(summary, timelines, batch_size=10)
    assert doc["ranks"][1]["samples"] == 100 and doc["incomplete"] == []


# --- summary.json and config.json fdl cannot use: one error line, exit 2 ----------------------

def with_summary(**changes) -> dict:
    summary = json.loads(json.dumps(SUMMARY))
    for dotted, value in changes.items():
        *parents, key = dotted.split("__")
        holder = summary
        for parent in parents:
            holder = holder[parent]
        holder[key] = value
    return summary


@pytest.mark.parametrize(("content", "message"), [
    (b"{not json", r"summary\.json is not valid JSON \(Expecting property name"),
    (b"\xff\xfe\x00binary", r"summary\.json is not UTF-8 text"),
    (json.dumps([1, 2]).encode(), r"summary\.json holds list, not a JSON object"),
    (json.dumps(with_summary(world_size="2")).encode(),
     r"world_size is \"2\", expected a positive integer"),
    (json.dumps(with_summary(world_size=10**9)).encode(),
     r"world_size is 1000000000 but throughput\.per_rank_samples_per_s has 2 entries"),
    (json.dumps({k: v for k, v in SUMMARY.items() if k != "wall_s"}).encode(),
     r"summary\.json has no wall_s"),
    (json.dumps(with_summary(throughput=[40.0])).encode(), r"throughput is list, expected an "),
    (json.dumps(with_summary(sync__rounds="4")).encode(), r"sync\.rounds is \"4\""),
    (json.dumps(with_summary(eval={"accuracy": "high"})).encode(), r"eval.accuracy is \"high\", expected a number at most "),
    (json.dumps(with_summary(anchor_history=[[1, 8]])).encode(), r"anchor_history is list"),
], ids=["not-json", "binary", "list", "world-size-str", "world-size-huge", "no-wall",
        "throughput-list", "rounds-str", "eval-str", "anchor-pair"])
def test_a_summary_fdl_cannot_use_is_a_usage_error(tmp_path, content, message):
    run = make_run(tmp_path)
    (run / "summary.json").write_bytes(content)
    with pytest.raises(UsageError, match=message):
        run_report(run)


@pytest.mark.parametrize(("content", "message"), [
    (b"[engine", r"config\.json is not valid JSON"),
    (json.dumps({"engine": {"batch_size": {"value": "ten"}}}).encode(),
     r"engine\.batch_size is \"ten\", expected a positive integer"),
    (json.dumps({"engine": ["batch_size"]}).encode(), r"engine is list, expected an object"),
    (json.dumps("config").encode(), r"config\.json holds \"config\", not a JSON object"),
])
def test_a_config_fdl_cannot_use_is_a_usage_error(tmp_path, content, message):
    run = make_run(tmp_path)
    (run / "config.json").write_bytes(content)
    with pytest.raises(UsageError, match=message):
        run_report(run)


@pytest.mark.parametrize("content", [b"\xff\xfe binary", b"[1, 2]", b"{torn"])
def test_the_engine_adds_its_settings_to_a_damaged_config(tmp_path, content):
    path = tmp_path / "config.json"
    path.write_bytes(content)
    merge_engine(tmp_path, {"batch_size": {"value": 10, "source": "default"}})
    assert json.loads(path.read_text()) == {"engine": {"batch_size": {"value": 10,
                                                                     "source": "default"}}}


def test_cli_a_summary_with_a_huge_world_size_is_one_line_not_a_hang(tmp_path):
    run = make_run(tmp_path)
    text = json.dumps(SUMMARY).replace('"world_size": 2', '"world_size": 1e9')
    (run / "summary.json").write_text(text)
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    result = run_fdl("report", str(run), "--json", timeout=60)  # the guard: it used to hang
    assert_one_error(result, 2, "world_size is 1000000000.0, expected a positive integer")
    assert result.stdout == ""
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before  # nothing written


# --- the timeline merge reads damaged files without failing ---------------------------------

def test_the_merge_survives_mistyped_fields_and_an_unreadable_rank_file(tmp_path):
    run = make_run(tmp_path)
    with (run / "timeline" / "rank0.jsonl").open("a") as handle:
        handle.write(json.dumps({"t": 110.0, "kind": "round", "round": 9, "compute_s": 1.0,
                                 "data_s": "lots"}) + "\n")
        handle.write('{"t": NaN, "kind": "epoch"}\n{"t": Infinity, "kind": "epoch"}\n')
    (run / "timeline" / "rank2.jsonl").mkdir()  # not a file: skipped, not fatal
    doc = merge_timeline(run)
    assert doc["ranks"] == [0, 1]
    late = [s for s in doc["spans"] if s["round"] == 9]
    assert [s["kind"] for s in late] == ["compute"]  # no data span from a non-number
    assert doc["duration"] == pytest.approx(10.0)  # 110.0 - the first round's start, 100.0


# --- appenders start on a fresh line after a torn one ---------------------------------------

TORN = '{"t": 1.0, "kind": "rou'


def test_a_timeline_event_after_a_torn_line_survives(tmp_path):
    path = tmp_path / "timeline" / "rank0.jsonl"
    path.parent.mkdir()
    path.write_text(json.dumps({"t": 0.5, "kind": "round"}) + "\n" + TORN)
    timeline = Timeline(tmp_path, rank=0)
    timeline.event("start", attempt=1, resumed_from="ckpt-r00000002", world_size=2, epoch=1,
                   round=2, skipped=[])
    timeline.close()
    assert [e["kind"] for e in read_events(tmp_path, 0)] == ["round", "start"]


def test_a_metrics_record_after_a_torn_line_survives(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(TORN)
    record = EpochRecord(epoch=2, samples=400, train_loss=0.5, eval={}, samples_per_s=40.0,
                         elapsed_s=10.0, epoch_s=5.0, epoch_samples_per_s=40.0,
                         per_rank_samples_per_s=[30.0, 10.0], idle_fraction=[0.0, 0.5],
                         sync_overhead=None, anchor=4)
    append_epoch(tmp_path, record)
    assert read_epochs(tmp_path) == [record.to_dict()]


def test_a_bench_result_after_a_torn_line_survives(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text(TORN)
    append_record(path, {"run_dir": "runs/a"})
    assert read_jsonl(path) == [{"run_dir": "runs/a"}]


def test_a_utilisation_sample_after_a_torn_line_survives(tmp_path):
    path = tmp_path / "samples-node0.jsonl"
    path.write_text(TORN)
    sampler = UtilisationSampler(path, node=0, cuda_indices=[], interval_s=10.0)
    sampler.start()
    sampler.stop()  # writes one last sample
    records = read_jsonl(path)
    assert len(records) == 1 and records[0]["node"] == 0
