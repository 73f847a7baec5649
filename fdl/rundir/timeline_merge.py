"""One timeline for a whole run: every rank's events and every node's utilisation samples merged
into ``timeline/timeline.json`` and ``timeline/timeline.csv``, plus ``timeline/timeline.html``
(:mod:`fdl.rundir.timeline_html`), ``timeline/trace.json`` for Perfetto and chrome://tracing
(:mod:`fdl.rundir.timeline_trace`) and ``timeline/curves.png`` (:mod:`fdl.rundir.timeline_plot`).

    from fdl.rundir.timeline_merge import write_timeline
    write_timeline(Path("runs/20260101T120000Z-train-async"))   # -> the paths it wrote

Inputs (each optional, so a crashed run still gets a timeline): ``timeline/rank<r>.jsonl``
(:mod:`fdl.rundir.timeline`; a restarted worker appends to its file, so one file may hold several
attempts, each opening with a ``start`` event), ``timeline/samples-node<n>.jsonl`` (utilisation
every 100 ms), ``metrics.jsonl`` (one line per epoch) and ``summary.json``. A line that does not
parse — typically the last one of a file whose writer was killed mid-line — is skipped, and so
is a record without a finite ``t``, or a file that cannot be read; a duration field that is not
a finite number counts as 0.

The document (``schema`` 1). Times are seconds relative to ``t0``, rounded to microseconds;
``t0`` is absolute (seconds since the epoch), the earliest instant anything in the document
covers (an event, a sample or the start of a span), or null when nothing was recorded:

* ``ranks`` — the ranks that have a timeline file, ascending.
* ``spans`` — ``{"rank", "kind", "start", "end", "round"}`` sorted by rank then start. A
  ``round`` event (written when the rank's step loop ends) covers ``[t - compute_s, t]``,
  split from its start in the order a step runs: its ``data_s`` (batch fetching) as a ``data``
  span, then ``compute`` (its timed steps, ``busy_s``, less data and sleep), then its
  ``comm_s`` (sync: DDP's gradient all-reduce and the wait for the peers in it) as a ``sync``
  span, then its ``sleep_s`` (the emulated slowdown) as an ``emulated`` span; each is 0 when
  absent, and what the loop spent outside its timed steps (a wait for a peer) is left idle at
  its end. A round written before ``busy_s`` counts its whole loop less ``comm_s``. The loop
  interleaves them step by step and only their totals are recorded, so the split shows the
  shares, not the moments. A ``sync`` event gives
  ``sync`` over ``[t - wait_s, t]``. ``idle`` spans (``round`` null) fill every gap on a rank
  between its first and its last event: Python between rounds, epoch boundaries, evaluation,
  checkpoints, a restart.
* ``events`` — every other event (``start``, ``anchor``, ``guard``, ``epoch``, ``checkpoint``,
  ``final`` and kinds this module does not know) with all its fields, ``t`` made relative,
  sorted by time.
* ``samples`` — every utilisation sample with ``t`` made relative, sorted by time.
* ``epochs`` — the lines of ``metrics.jsonl``; ``summary`` — ``summary.json`` or null;
  ``duration`` — the end of the last thing recorded.

``timeline.csv`` has one row per span, then per event, then per sample, with the columns
:data:`CSV_COLUMNS`: ``record`` (span, event or sample), ``kind`` (``sample`` for samples),
``rank``, ``node``, ``round``, ``t`` (span start, event or sample time), ``end`` and
``duration_s`` (spans only), ``cpu_percent``, ``ram_used_bytes``, ``ram_total_bytes`` (samples
only) and ``detail``: the remaining fields as JSON (an event's fields; a sample's host and gpus).
Empty cells are fields a record does not have.

Every file is written to a temporary file beside its target and renamed into place, so a reader
never sees half a file.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any

from fdl.files import scan_jsonl, write_atomic
from fdl.rundir.metrics import read_epochs
from fdl.rundir.summary import read_summary
from fdl.rundir.timeline import RANK_FILE, SAMPLES_FILE, directory, numbered_files
from fdl.rundir.timeline_html import render_html, strict_json
from fdl.rundir.timeline_trace import build_trace, trace_path, write_trace

SCHEMA = 1
CSV_COLUMNS = ("record", "kind", "rank", "node", "round", "t", "end", "duration_s",
               "cpu_percent", "ram_used_bytes", "ram_total_bytes", "detail")
HTML_FILE = "timeline.html"
_SPAN_KINDS = ("round", "sync")


def merge_timeline(run_dir: Path) -> dict[str, Any]:
    """The merged timeline document of ``run_dir`` (see the module docstring)."""
    by_rank = {rank: found.records for rank, path in numbered_files(run_dir, RANK_FILE)
               if (found := scan_jsonl(path)).error is None}
    samples = [s for _, path in numbered_files(run_dir, SAMPLES_FILE)
               for s in scan_jsonl(path).records]
    by_rank = {rank: [e for e in events if _has_time(e)] for rank, events in by_rank.items()}
    samples = [s for s in samples if _has_time(s)]
    t0 = _earliest(by_rank, samples)
    spans: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    for rank in sorted(by_rank):
        rank_events = [{**e, "t": _rel(e["t"], t0)} for e in by_rank[rank]]
        rank_spans = sorted(_busy_spans(rank_events, rank=rank),
                            key=lambda s: (s["start"], s["end"]))
        spans += _with_idle(rank_spans, rank_events, rank=rank)
        events += [{**e, "rank": e.get("rank", rank)} for e in rank_events
                   if e.get("kind") not in _SPAN_KINDS]
    events.sort(key=lambda e: e["t"])
    samples = sorted(({**s, "t": _rel(s["t"], t0)} for s in samples), key=lambda s: s["t"])
    ends = [s["end"] for s in spans] + [e["t"] for e in events] + [s["t"] for s in samples]
    return {
        "schema": SCHEMA, "t0": t0, "duration": max(ends, default=0.0),
        "ranks": sorted(by_rank), "spans": spans, "events": events, "samples": samples,
        "epochs": read_epochs(run_dir),
        "summary": read_summary(run_dir),
    }


def write_timeline(run_dir: Path) -> list[Path]:
    """Write ``timeline.json``, ``timeline.csv``, ``timeline.html``, ``trace.json`` and (when
    matplotlib is installed and an epoch has a number to plot) ``curves.png`` under
    ``run_dir/timeline``; returns the paths written, in that order. A missing ``curves.png``
    where :func:`fdl.rundir.timeline_plot.plottable` holds means no matplotlib:
    ``pip install 'fdl[report]'``."""
    from fdl.rundir.timeline_plot import write_curves_png

    doc = merge_timeline(run_dir)
    folder = directory(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    written = [folder / "timeline.json", folder / "timeline.csv", html_path(run_dir),
               trace_path(run_dir)]
    write_atomic(written[0], strict_json(doc) + "\n")
    write_atomic(written[1], timeline_csv(doc))
    write_atomic(written[2], render_html(doc, title=f"fdl timeline — {run_dir.name}"))
    write_trace(written[3], build_trace(doc, run_name=run_dir.name))
    png = write_curves_png(run_dir, doc["epochs"]) if doc["epochs"] else None
    return [*written, png] if png is not None else written


def html_path(run_dir: Path) -> Path:
    return directory(run_dir) / HTML_FILE


def timeline_csv(doc: dict[str, Any]) -> str:
    """The CSV form of a merged document: :data:`CSV_COLUMNS`, one row per span/event/sample."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    writer.writerows(
        ("span", s["kind"], s["rank"], None, s["round"], s["start"], s["end"],
         round(s["end"] - s["start"], 6), None, None, None, None)
        for s in doc["spans"])
    writer.writerows(
        ("event", e.get("kind"), e["rank"], None, e.get("round"), e["t"], None, None, None,
         None, None, _detail(e, ("t", "rank", "kind", "round")))
        for e in doc["events"])
    writer.writerows(
        ("sample", "sample", None, s.get("node"), None, s["t"], None, None,
         s.get("cpu_percent"), s.get("ram_used_bytes"), s.get("ram_total_bytes"),
         _detail(s, ("t", "node", "cpu_percent", "ram_used_bytes", "ram_total_bytes")))
        for s in doc["samples"])
    return out.getvalue()


def _detail(record: dict[str, Any], shown: tuple[str, ...]) -> str | None:
    """The fields of ``record`` that have no column of their own, as JSON."""
    rest = {k: v for k, v in record.items() if k not in shown}
    return json.dumps(rest, separators=(",", ":"), default=str) if rest else None


def _has_time(record: dict[str, Any]) -> bool:
    return _is_finite(record.get("t"))


def _is_finite(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):  # JSON allows any integer; beyond 64 bits no clock holds it
        return abs(value) < 2 ** 63
    return isinstance(value, float) and math.isfinite(value)


def _earliest(by_rank: dict[int, list[dict[str, Any]]],
              samples: list[dict[str, Any]]) -> float | None:
    # A span can start before any event: the first round of a file without a `start` event.
    times = [s["t"] for s in samples]
    for events in by_rank.values():
        for event in events:
            times += [event["t"], event["t"] - _duration(event)]
    return min(times, default=None)


def _duration(event: dict[str, Any]) -> float:
    field = {"round": "compute_s", "sync": "wait_s"}.get(event.get("kind"))
    return _seconds(event.get(field)) if field else 0.0


def _rel(t: float, t0: float | None) -> float:
    return round(t - (t0 or 0.0), 6)


def _busy_spans(events: list[dict[str, Any]], *, rank: int) -> list[dict[str, Any]]:
    spans = []
    for event in events:
        kind, end, number = event.get("kind"), event["t"], event.get("round")
        if kind not in _SPAN_KINDS:
            continue
        start = round(end - _duration(event), 6)
        if kind == "sync":
            spans.append(_span(rank, "sync", start, end, number))
            continue
        spans += _round_spans(event, rank=rank, start=start, end=end)
    return spans


def _round_spans(event: dict[str, Any], *, rank: int, start: float,
                 end: float) -> list[dict[str, Any]]:
    """A round's step loop as data, compute, sync (DDP's all-reduce), emulated (sleep), from
    its start; what the loop spent outside its timed steps is left to the idle span after."""
    data_s, comm_s, sleep_s = (_seconds(event.get(key)) for key in ("data_s", "comm_s",
                                                                      "sleep_s"))
    busy = event.get("busy_s")
    steps_s = _seconds(busy) if _is_finite(busy) else end - start - comm_s
    parts = (("data", data_s), ("compute", max(0.0, steps_s - data_s - sleep_s)),
             ("sync", comm_s), ("emulated", sleep_s))
    spans, cursor = [], start
    for kind, seconds in parts:
        stop = round(min(end, cursor + seconds), 6)
        if stop > cursor or kind == "compute":
            spans.append(_span(rank, kind, cursor, stop, event.get("round")))
        cursor = stop
    return spans


def _seconds(value: Any) -> float:
    """A duration field as seconds: 0 when it is absent, not a finite number or negative."""
    return max(0.0, float(value)) if _is_finite(value) else 0.0


def _with_idle(spans: list[dict[str, Any]], events: list[dict[str, Any]],
               *, rank: int) -> list[dict[str, Any]]:
    """``spans`` (sorted by start) with ``idle`` spans in every gap between the rank's first
    and last event."""
    if not events:
        return spans
    cursor = min([e["t"] for e in events] + [s["start"] for s in spans[:1]])
    last = max([e["t"] for e in events] + [s["end"] for s in spans])
    result = []
    for span in spans:
        if span["start"] > cursor:
            result.append(_span(rank, "idle", cursor, span["start"], None))
        result.append(span)
        cursor = max(cursor, span["end"])
    if last > cursor:
        result.append(_span(rank, "idle", cursor, last, None))
    return result


def _span(rank: int, kind: str, start: float, end: float, number: Any) -> dict[str, Any]:
    return {"rank": rank, "kind": kind, "start": start, "end": end, "round": number}
