"""timeline/trace.json: a merged timeline in the Chrome Trace Event Format, checked against the
format's rules and against the document it came from (tests/trace_checks.py; a real run's trace
is checked in tests/engine/test_recovery_runs.py), then the hostile cases: non-finite numbers,
overlapping spans, markup in strings, ranks that are not ranks."""

from __future__ import annotations

import json
import math
from pathlib import Path

from trace_checks import check_against, check_format, load_strict

from fdl.rundir.timeline_merge import merge_timeline, write_timeline
from fdl.rundir.timeline_trace import SPAN_THREADS, build_trace, trace_note
from fdl.version import __version__

T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z
# A merged document as fdl.rundir.timeline_merge writes it: two ranks on cuda:0/cuda:1, rank 1
# restarted from a checkpoint; one node sampled twice (the second time NVML could not read).
SPANS = [
    (0, "idle", 0.0, 0.25, None), (0, "data", 0.25, 0.5, 0), (0, "compute", 0.5, 1.0, 0),
    (0, "sync", 1.0, 1.25, 0), (0, "idle", 1.25, 2.5, None), (0, "compute", 2.5, 3.0, 1),
    (1, "compute", 0.5, 1.0, 0), (1, "sync", 1.0, 1.25, 0), (1, "idle", 1.25, 4.5, None),
    (1, "data", 4.5, 4.625, 2), (1, "compute", 4.625, 5.0, 2),
]
EVENTS = [
    {"t": 0.0, "rank": 0, "kind": "start", "attempt": 0, "world_size": 2, "resumed_from": None},
    {"t": 0.5, "rank": 1, "kind": "start", "attempt": 0, "world_size": 2, "resumed_from": None},
    {"t": 1.25, "rank": 0, "kind": "guard", "round": 0, "distance": 0.1, "level": 1.0,
     "streak": 0, "halve": False, "released": False},
    {"t": 1.5, "rank": 0, "kind": "anchor", "round": 0, "anchor": 6, "previous": 4,
     "reason": "overhead 0.2 > 0.05"},
    {"t": 2.0, "rank": 0, "kind": "epoch", "epoch": 1, "train_loss": float("nan"),
     "eval": {"accuracy": 0.75, "loss": float("inf")}},
    {"t": 2.25, "rank": 1, "kind": "checkpoint", "round": 1, "epoch": 1, "name": "ckpt-r1",
     "bytes": 4096, "write_s": 0.01},
    {"t": 3.0, "rank": 0, "kind": "guard", "round": 1, "distance": 9.0, "level": 9.0,
     "streak": 3, "halve": True, "released": False},
    {"t": 4.0, "rank": 1, "kind": "start", "attempt": 1, "world_size": 2,
     "resumed_from": "ckpt-r1"},
    {"t": 5.0, "rank": 1, "kind": "profiler", "note": "a kind fdl does not know"},
    {"t": 5.25, "rank": 0, "kind": "final", "checksum": "ab12", "anchor": 6},
]
SAMPLES = [
    {"t": 0.25, "node": 0, "host": "box", "cpu_percent": 50.0, "ram_used_bytes": 2 * 1024 ** 3,
     "ram_total_bytes": 16 * 1024 ** 3,
     "gpus": [{"cuda_index": 0, "util_percent": 90.0, "mem_used_bytes": 1024 ** 3,
               "mem_total_bytes": 8 * 1024 ** 3}]},
    {"t": 0.5, "node": 0, "host": "box", "cpu_percent": float("nan"),
     "ram_used_bytes": 3 * 1024 ** 3, "ram_total_bytes": 16 * 1024 ** 3,
     "gpus": [{"cuda_index": 0, "util_percent": None, "mem_used_bytes": None,
               "mem_total_bytes": None}]},
]


def merged_doc() -> dict:
    return {"schema": 1, "t0": T0, "duration": 5.25, "ranks": [0, 1],
            "spans": [{"rank": r, "kind": k, "start": s, "end": e, "round": n}
                      for r, k, s, e, n in SPANS],
            "events": [dict(e) for e in EVENTS], "samples": [dict(s) for s in SAMPLES],
            "epochs": [], "summary": {"policy": "cadence", "backend": "nccl", "world_size": 2,
                                      "devices": ["cuda:0", "cuda:1"]}}


def of(trace: dict, **match) -> list[dict]:
    return [e for e in trace["traceEvents"] if all(e.get(k) == v for k, v in match.items())]


def test_a_merged_timeline_becomes_a_trace_that_keeps_the_format_and_the_facts():
    doc = merged_doc()
    trace = build_trace(doc, run_name="20260101T000000Z-train-cadence")
    check_format(trace)
    check_against(trace, doc)
    assert trace["otherData"] == {
        "fdl_version": __version__, "run": "20260101T000000Z-train-cadence",
        "t0": "2026-01-01T00:00:00.000000+00:00", "t0_unix_s": T0, "duration_s": 5.25,
        "policy": "cadence", "backend": "nccl", "world_size": 2}


def test_ranks_are_processes_with_one_named_thread_per_span_kind():
    trace = build_trace(merged_doc())
    assert [(e["pid"], e["args"]["name"]) for e in of(trace, name="process_name")] == [
        (1, "rank 0: cuda:0"), (2, "rank 1: cuda:1"), (1000, "node 0 utilisation")]
    assert {(e["pid"], e["tid"], e["args"]["name"]) for e in of(trace, name="thread_name")} == {
        (pid, tid, kind) for pid in (1, 2) for kind, tid in SPAN_THREADS.items()}
    data = of(trace, ph="X", name="data", pid=1)
    assert data == [{"name": "data", "cat": "fdl.span", "ph": "X", "ts": 250_000,
                     "dur": 250_000, "pid": 1, "tid": SPAN_THREADS["data"],
                     "cname": "thread_state_iowait", "args": {"round": 0}}]
    assert {e["tid"] for e in of(trace, ph="X", name="compute")} == {SPAN_THREADS["compute"]}


def test_instants_mark_starts_restarts_anchor_changes_checkpoints_epochs_and_the_end():
    trace = build_trace(merged_doc())
    instants = [(e["pid"], e["ts"], e["name"]) for e in of(trace, ph="i")]
    assert instants == [(1, 0, "start"), (2, 500_000, "start"), (1, 1_500_000, "anchor"),
                        (1, 2_000_000, "epoch end"), (2, 2_250_000, "checkpoint"),
                        (1, 3_000_000, "guard"), (2, 4_000_000, "restart"),
                        (2, 5_000_000, "event"), (1, 5_250_000, "final")]
    assert all(e["s"] == "p" and e["cat"] == "fdl.event" for e in of(trace, ph="i"))
    assert of(trace, name="anchor")[0]["args"] == {"round": 0, "anchor": 6, "previous": 4,
                                                   "reason": "overhead 0.2 > 0.05"}
    assert of(trace, name="restart")[0]["args"]["resumed_from"] == "ckpt-r1"
    assert of(trace, name="event")[0]["args"] == {"kind": "profiler",
                                                  "note": "a kind fdl does not know"}
    # a diverged loss and an infinite metric are null, not NaN
    assert of(trace, name="epoch end")[0]["args"] == {
        "epoch": 1, "train_loss": None, "eval": {"accuracy": 0.75, "loss": None}}


def test_utilisation_is_counters_on_the_nodes_process_without_the_values_not_read():
    trace = build_trace(merged_doc())
    counters = [(e["ts"], e["name"], e["args"]) for e in of(trace, ph="C")]
    assert counters == [
        (250_000, "cpu", {"percent": 50.0}), (250_000, "ram", {"used GiB": 2.0}),
        (250_000, "gpu 0 util", {"percent": 90.0}), (250_000, "gpu 0 memory", {"used GiB": 1.0}),
        (500_000, "ram", {"used GiB": 3.0})]
    assert {e["pid"] for e in of(trace, ph="C")} == {1000}
    assert of(trace, name="process_labels")[0]["args"] == {"labels": "box"}


def test_overlapping_spans_of_one_kind_are_cut_and_spans_inside_another_dropped():
    doc = merged_doc()
    doc["spans"] = [{"rank": 0, "kind": "compute", "start": s, "end": e, "round": n}
                    for s, e, n in [(0.0, 1.0, 0), (0.9999995, 2.0, 1), (1.5, 1.75, 2),
                                    (2.0, 2.0, 3)]]
    trace = build_trace(doc)
    check_format(trace)
    spans = [(e["ts"], e["dur"], e["args"]["round"]) for e in of(trace, ph="X")]
    assert spans == [(0, 1_000_000, 0), (1_000_000, 1_000_000, 1), (2_000_000, 0, 3)]


def test_strings_from_the_run_are_data_and_odd_records_are_left_out():
    doc = merged_doc()
    hostile = '</script><b>"\u2028\x00{{x}}[bold]'
    doc["events"] = [
        {"t": 1.0, "rank": 0, "kind": "checkpoint", "name": hostile, "epoch": 1, "bytes": 1},
        {"t": 1.0, "rank": "0", "kind": "final"}, {"t": 1.0, "rank": 7, "kind": "final"},
        {"t": 1.0, "rank": True, "kind": "final"}, {"t": 1.0, "rank": 0, "kind": ["x"]}]
    doc["samples"] = [{"t": 1.0, "node": "0", "cpu_percent": 1.0},
                      {"t": 1.0, "node": 0, "cpu_percent": True, "ram_used_bytes": 10 ** 400,
                       "host": hostile, "gpus": [{"cuda_index": "0", "util_percent": 1.0}, 7]}]
    doc["summary"] = {"devices": [hostile]}
    trace = build_trace(doc)
    check_format(trace)
    text = json.dumps(trace, allow_nan=False)
    assert json.loads(text) == trace
    assert of(trace, ph="i", name="checkpoint")[0]["args"]["name"] == hostile
    assert [e["name"] for e in of(trace, ph="i")] == ["checkpoint", "event"]
    assert of(trace, ph="C") == []
    assert of(trace, name="process_name", pid=1)[0]["args"]["name"] == f"rank 0: {hostile}"


def test_node_processes_stay_clear_of_rank_processes_in_a_large_world():
    doc = merged_doc()
    doc["ranks"] = [0, 999, 1000, 2 ** 40]  # the last one: a stray rank<N>.jsonl, left out
    trace = build_trace(doc)
    names = {e["pid"]: e["args"]["name"] for e in of(trace, name="process_name")}
    assert names == {1: "rank 0: cuda:0", 1000: "rank 999", 1001: "rank 1000",
                     10_000: "node 0 utilisation"}


def test_a_run_that_recorded_nothing_gets_an_empty_valid_trace():
    doc = {"schema": 1, "t0": None, "duration": 0.0, "ranks": [], "spans": [], "events": [],
           "samples": [], "epochs": [], "summary": None}
    trace = build_trace(doc)
    check_format(trace)
    assert trace["traceEvents"] == [] and trace["otherData"]["t0"] is None


def test_write_timeline_writes_trace_json_from_the_merged_files(tmp_path):
    run = tmp_path / "run"
    (run / "timeline").mkdir(parents=True)
    records = [{"t": T0, "kind": "start", "attempt": 0},
               {"t": T0 + 1.0, "kind": "round", "round": 0, "compute_s": 0.5, "data_s": 0.125},
               {"t": T0 + 1.25, "kind": "sync", "round": 0, "wait_s": 0.25},
               {"t": T0 + 1.5, "kind": "epoch", "epoch": 1, "train_loss": math.nan}]
    (run / "timeline" / "rank0.jsonl").write_text(
        "".join(json.dumps({**r, "rank": 0}) + "\n" for r in records) + '{"t": 1', "utf-8")
    written = write_timeline(run)
    assert [p.name for p in written] == ["timeline.json", "timeline.csv", "timeline.html",
                                         "trace.json"]
    trace = load_strict(run / "timeline" / "trace.json")
    assert trace == build_trace(merge_timeline(run), run_name="run")
    check_format(trace)
    check_against(trace, merge_timeline(run))


def test_the_note_says_where_the_trace_is_and_what_opens_it():
    assert trace_note(Path("runs/x/timeline/trace.json")) == (
        "runs/x/timeline/trace.json (open in https://ui.perfetto.dev or chrome://tracing)")
