"""The rules ``timeline/trace.json`` keeps: the Chrome Trace Event Format's (JSON Object form)
and fdl's own mapping from the merged timeline to it (fdl.rundir.timeline_trace). Used on a
hand-made timeline (tests/launch/test_timeline_trace.py) and on a real run with a restart
(tests/engine/test_recovery_runs.py). No viewer runs here: Perfetto's trace processor is a
binary its Python package downloads at first use, and the tests are offline."""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from datetime import datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

PHASES = {"X", "i", "C", "M"}
METADATA_ARG = {"process_name": "name", "thread_name": "name", "process_labels": "labels",
                "process_sort_index": "sort_index", "thread_sort_index": "sort_index"}
INSTANT_OF_KIND = {"anchor": "anchor", "checkpoint": "checkpoint", "epoch": "epoch end",
                   "final": "final"}


def load_strict(path: Path) -> dict[str, Any]:
    """``path`` parsed as strict JSON: NaN or Infinity fail the test."""
    def reject(constant: str) -> None:
        raise AssertionError(f"{constant} in {path}")

    return json.loads(path.read_text(encoding="utf-8"), parse_constant=reject)


def is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def check_format(trace: dict[str, Any]) -> None:
    """The format's rules, on every event."""
    json.dumps(trace, allow_nan=False)
    assert isinstance(trace["traceEvents"], list) and trace["displayTimeUnit"] == "ms"
    for event in trace["traceEvents"]:
        assert isinstance(event["name"], str) and event["name"], event
        assert event["ph"] in PHASES, event
        # pid/tid 0 are the kernel's idle task to Perfetto (google/perfetto#394): never used
        assert all(isinstance(event[k], int) and event[k] > 0 for k in ("pid", "tid")), event
        if event["ph"] == "M":
            assert set(event["args"]) == {METADATA_ARG[event["name"]]}, event
            continue
        assert is_number(event["ts"]) and event["ts"] >= 0, event
        if event["ph"] == "X":
            assert is_number(event["dur"]) and event["dur"] >= 0, event
        if event["ph"] == "C":
            assert event["args"] and all(is_number(v) for v in event["args"].values()), event
        if event["ph"] == "i":
            assert event["s"] in ("p", "g"), event
    named = {e["pid"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert {e["pid"] for e in trace["traceEvents"]} <= named
    check_no_overlap(trace)


def check_no_overlap(trace: dict[str, Any]) -> None:
    """Complete events on one (pid, tid) follow each other: a viewer stacks a partial overlap."""
    lanes: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for event in trace["traceEvents"]:
        if event["ph"] == "X":
            lanes[(event["pid"], event["tid"])].append(event)
    for lane, spans in lanes.items():
        spans.sort(key=lambda e: e["ts"])
        for before, after in pairwise(spans):
            assert after["ts"] >= before["ts"] + before["dur"], (lane, before, after)


def check_against(trace: dict[str, Any], merged: dict[str, Any]) -> None:
    """What the trace must show of the merged timeline it was made from."""
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    for rank in merged["ranks"]:
        assert names[rank + 1].split(":")[0] == f"rank {rank}", names
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] - 1 for e in spans} == {s["rank"] for s in merged["spans"]}
    assert Counter((e["pid"] - 1, e["name"]) for e in spans) == Counter(
        (s["rank"], s["kind"]) for s in merged["spans"])
    ends = {(e["pid"] - 1, e["name"], e["ts"] + e["dur"]) for e in spans}
    assert ends == {(s["rank"], s["kind"], round(s["end"] * 1e6)) for s in merged["spans"]}
    _check_instants(events, merged["events"])
    cpu = {(e["pid"], e["ts"]) for e in events if e["ph"] == "C" and e["name"] == "cpu"}
    for sample in merged["samples"]:
        if is_number(sample.get("cpu_percent")):
            node_pid = next(p for p, n in names.items() if n == f"node {sample['node']} "
                            "utilisation")
            assert (node_pid, round(sample["t"] * 1e6)) in cpu, sample
    t0 = trace["otherData"]["t0"]
    if merged["t0"] is not None:
        assert abs(datetime.fromisoformat(t0).timestamp() - merged["t0"]) <= 1e-6


def _check_instants(events: list[dict[str, Any]], merged_events: list[dict[str, Any]]) -> None:
    instants = {(e["pid"] - 1, e["ts"], e["name"]): e["args"] for e in events if e["ph"] == "i"}
    for source in merged_events:
        kind, key = source["kind"], (source["rank"], round(source["t"] * 1e6))
        if kind == "start":
            name = "restart" if source["attempt"] > 0 else "start"
            assert instants[(*key, name)]["attempt"] == source["attempt"]
        elif kind in INSTANT_OF_KIND:
            args = instants[(*key, INSTANT_OF_KIND[kind])]
            fields = {"anchor": ("previous", "anchor", "reason"),
                      "checkpoint": ("name", "epoch", "bytes")}.get(kind, ())
            assert all(args[f] == source[f] for f in fields), (args, source)
