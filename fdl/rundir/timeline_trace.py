"""``timeline/trace.json``: a run's merged timeline (:mod:`fdl.rundir.timeline_merge`) in the
Chrome Trace Event Format, JSON Object form, for https://ui.perfetto.dev (Open trace file) or
chrome://tracing (Load)::

    from fdl.rundir.timeline_trace import build_trace, write_trace
    trace = build_trace(merge_timeline(run_dir), run_name=run_dir.name)  # pure: a dict
    write_trace(run_dir / "timeline" / "trace.json", trace)

What it holds (``ts``/``dur`` in integer microseconds from the merged document's ``t0``, so
every rank and node shares one time axis; ``displayTimeUnit`` is ``"ms"``):

* One process per rank, ``pid = rank + 1`` (Perfetto treats pid 0 as the kernel's idle task,
  google/perfetto#394), named ``rank R: DEVICE`` (``rank 0: cuda:0``) and sorted by rank. Its
  spans are complete events (``"ph": "X"``, category ``fdl.span``, ``args.round``, a
  chrome://tracing colour in ``cname``), one named thread per kind: :data:`SPAN_THREADS`.
  ``data`` and ``emulated`` (the slowdown emulation's sleep) have threads of their own: the
  merge cuts them from the step loop because only the loop's totals are recorded, so they show
  how much, not when; on the compute thread they would read as moments. A round's share of
  DDP's all-reduce (sync) is on the ``sync`` thread with the averages. Spans of one kind never
  overlap on their thread: one that starts before the previous one ended (clock skew, a
  hand-edited file) starts where that one ends, or is dropped when nothing is left of it.
* Instant events (``"ph": "i"``, ``"s": "p"``, category ``fdl.event``) on the rank's process:
  ``start`` (the first attempt), ``restart`` (``attempt`` > 0), ``anchor`` (``previous``,
  ``anchor``, ``reason``), ``guard`` (only the verdicts that halved the anchor or lifted its
  ceiling), ``epoch end`` (``train_loss``, ``eval``), ``checkpoint`` (``name``, ``epoch``,
  ``bytes``), ``final`` and ``event`` for kinds this module does not know; ``args`` are the
  event's own fields.
* One process per node, ``pid = NODE_PID_BASE + node`` (a larger power of ten when there are
  more ranks), named ``node N utilisation``, with counter events (``"ph": "C"``): ``cpu``
  (``percent``), ``ram`` (``used GiB``) and per GPU ``gpu I util`` (``percent``) and
  ``gpu I memory`` (``used GiB``); a value the sampler could not read is left out.
* ``otherData``: the fdl version, the run's name, ``t0`` as ISO 8601 (UTC) and in seconds since
  the epoch, policy, backend and world size from ``summary.json`` when the run finished.

Nothing from the run's files is interpreted: strings are copied into ``args`` as data, and every
number that is not finite (a diverged loss) becomes null, so the file is strict JSON.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fdl.files import write_atomic
from fdl.rundir.timeline import directory
from fdl.version import __version__

TRACE_FILE = "trace.json"
VIEWERS = "https://ui.perfetto.dev or chrome://tracing"
SPAN_THREADS = {"compute": 1, "data": 2, "sync": 3, "idle": 4, "emulated": 5}
NODE_PID_BASE = 1000
_PROCESS_TID = 1  # process-wide records (names, instants, counters) sit on the first thread
_COLOURS = {"compute": "thread_state_running", "data": "thread_state_iowait",
            "sync": "thread_state_uninterruptible", "idle": "thread_state_sleeping",
            "emulated": "thread_state_runnable"}
_INSTANT_NAMES = {"anchor": "anchor", "guard": "guard", "epoch": "epoch end", "policy": "policy",
                  "checkpoint": "checkpoint", "final": "final"}
_GIB = 1024 ** 3
_MAX_ID = 2 ** 20  # ranks and nodes beyond it are not a run's (a stray rank<N>.jsonl): left out


def trace_path(run_dir: Path) -> Path:
    return directory(run_dir) / TRACE_FILE


def trace_note(path: Path) -> str:
    """``PATH (open in …)``: the one wording of where a trace is and how to view it."""
    return f"{path} (open in {VIEWERS})"


def write_trace(path: Path, trace: dict[str, Any]) -> Path:
    """Write ``trace`` (from :func:`build_trace`) as compact strict JSON, atomically."""
    return write_atomic(path, json.dumps(trace, separators=(",", ":"), allow_nan=False) + "\n")


def build_trace(doc: dict[str, Any], *, run_name: str | None = None) -> dict[str, Any]:
    """The Trace Event Format document of a merged timeline (see the module docstring)."""
    ranks = [r for r in doc.get("ranks", []) if _is_int(r) and 0 <= r < _MAX_ID]
    node_base = _node_pid_base(ranks)
    events = _rank_metadata(doc, ranks)
    timed = _spans(doc.get("spans", []), set(ranks)) + _instants(doc.get("events", []),
                                                                 set(ranks))
    nodes: set[int] = set()
    for sample in doc.get("samples", []):
        node = sample.get("node")
        if _is_int(node) and 0 <= node < _MAX_ID and _is_number(sample.get("t")):
            nodes.add(node)
            timed += _counters(sample, pid=node_base + node)
    events += _node_metadata(doc.get("samples", []), sorted(nodes), node_base=node_base)
    timed.sort(key=lambda e: (e["ts"], e["pid"], e["tid"]))
    return {"traceEvents": events + timed, "displayTimeUnit": "ms",
            "otherData": _other_data(doc, run_name=run_name)}


def _node_pid_base(ranks: list[int]) -> int:
    base = NODE_PID_BASE
    while ranks and base <= max(ranks) + 1:
        base *= 10
    return base


def _rank_metadata(doc: dict[str, Any], ranks: list[int]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for rank in ranks:
        device = _device(doc, rank)
        name = f"rank {rank}: {device}" if device else f"rank {rank}"
        found += [_meta("process_name", rank + 1, {"name": name}),
                  _meta("process_sort_index", rank + 1, {"sort_index": rank})]
        for kind, tid in SPAN_THREADS.items():
            found += [_meta("thread_name", rank + 1, {"name": kind}, tid=tid),
                      _meta("thread_sort_index", rank + 1, {"sort_index": tid}, tid=tid)]
    return found


def _device(doc: dict[str, Any], rank: int) -> str | None:
    """The rank's device: its last ``start`` event's ``device``, else summary.json's list."""
    starts = [e for e in doc.get("events", []) if e.get("kind") == "start"
              and e.get("rank") == rank and isinstance(e.get("device"), str)]
    if starts:
        return starts[-1]["device"]
    devices = (doc.get("summary") or {}).get("devices")
    if isinstance(devices, list) and rank < len(devices) and isinstance(devices[rank], str):
        return devices[rank]
    return None


def _node_metadata(samples: list[dict[str, Any]], nodes: list[int],
                   *, node_base: int) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for node in nodes:
        pid = node_base + node
        found += [_meta("process_name", pid, {"name": f"node {node} utilisation"}),
                  _meta("process_sort_index", pid, {"sort_index": pid})]
        hosts = {s.get("host") for s in samples if s.get("node") == node}
        labels = sorted(h for h in hosts if isinstance(h, str) and h)
        if labels:
            found.append(_meta("process_labels", pid, {"labels": ",".join(labels)}))
    return found


def _meta(name: str, pid: int, args: dict[str, Any], *, tid: int = _PROCESS_TID) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _spans(spans: list[dict[str, Any]], ranks: set[int]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    ends: dict[tuple[int, int], int] = {}
    for span in sorted(spans, key=lambda s: (s["rank"], s["start"], s["end"])):
        tid = SPAN_THREADS.get(span["kind"])
        if tid is None or span["rank"] not in ranks:
            continue
        pid = span["rank"] + 1
        start = max(_us(span["start"]), ends.get((pid, tid), 0))
        end = _us(span["end"])
        if end < start:
            continue  # wholly inside the previous span of its kind
        ends[(pid, tid)] = end
        args = {"round": span["round"]} if _is_int(span.get("round")) else {}
        found.append({"name": span["kind"], "cat": "fdl.span", "ph": "X", "ts": start,
                      "dur": end - start, "pid": pid, "tid": tid,
                      "cname": _COLOURS[span["kind"]], "args": args})
    return found


def _instants(events: list[dict[str, Any]], ranks: set[int]) -> list[dict[str, Any]]:
    found = []
    for event in events:
        rank, kind = event.get("rank"), event.get("kind")
        if not (_is_int(rank) and rank in ranks and _is_number(event.get("t"))):
            continue
        if kind == "guard" and not (event.get("halve") or event.get("released")):
            continue  # a quiet verdict at every average: the anchor events carry the actions
        if kind == "start":
            attempt = event.get("attempt")
            name = "restart" if _is_int(attempt) and attempt > 0 else "start"
        else:
            name = _INSTANT_NAMES.get(kind, "event") if isinstance(kind, str) else "event"
        args = {key: value for key, value in event.items() if key not in ("t", "rank")
                and (key != "kind" or name == "event")}
        found.append({"name": name, "cat": "fdl.event", "ph": "i", "s": "p",
                      "ts": _us(event["t"]), "pid": rank + 1, "tid": _PROCESS_TID,
                      "args": _json_safe(args)})
    return found


def _counters(sample: dict[str, Any], *, pid: int) -> list[dict[str, Any]]:
    values: list[tuple[str, str, Any]] = [
        ("cpu", "percent", sample.get("cpu_percent")),
        ("ram", "used GiB", _gib(sample.get("ram_used_bytes")))]
    gpus = sample.get("gpus")
    for gpu in gpus if isinstance(gpus, list) else []:
        index = gpu.get("cuda_index") if isinstance(gpu, dict) else None
        if _is_int(index):
            values += [(f"gpu {index} util", "percent", gpu.get("util_percent")),
                       (f"gpu {index} memory", "used GiB", _gib(gpu.get("mem_used_bytes")))]
    ts = _us(sample["t"])
    return [{"name": name, "cat": "fdl.sample", "ph": "C", "ts": ts, "pid": pid,
             "tid": _PROCESS_TID, "args": {key: value}}
            for name, key, value in values if _is_number(value)]


def _other_data(doc: dict[str, Any], *, run_name: str | None) -> dict[str, Any]:
    summary = doc.get("summary") or {}
    t0 = doc.get("t0")
    data = {"fdl_version": __version__, "run": run_name, "t0": _iso(t0),
            "t0_unix_s": t0 if _is_number(t0) else None,
            "duration_s": doc.get("duration")}
    data.update({key: summary.get(key) for key in ("policy", "backend", "world_size")})
    return _json_safe(data)


def _iso(t0: Any) -> str | None:
    if not _is_number(t0):
        return None
    try:
        return datetime.fromtimestamp(t0, tz=timezone.utc).isoformat(timespec="microseconds")
    except (OverflowError, OSError, ValueError):  # a clock far outside what datetime holds
        return None


def _us(seconds: float) -> int:
    return round(seconds * 1_000_000)


def _gib(value: Any) -> float | None:
    return round(value / _GIB, 4) if _is_number(value) else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """A finite int or float (not a bool); an int beyond 64 bits, which JSON allows and no
    counter or clock holds, is not one."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return abs(value) < 2 ** 63
    return isinstance(value, float) and math.isfinite(value)


def _json_safe(value: Any) -> Any:
    """``value`` with every non-finite float made null (what strict JSON parsers accept)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value
