"""The files of an ``fdl bench`` sweep, written and read back here only: ``results.jsonl`` (one
line per finished cell, built from the run's summary.json, metrics.jsonl and timelines),
``failures.jsonl`` (one line per failed cell) and ``sweep.json`` (machine facts, arguments,
each session); and the set of cells already done that a resumed sweep skips.

``results.jsonl`` is a contract for tools (docs/bench.md lists its fields); each line is
flushed and fsynced before the next cell starts, so a killed sweep loses at most the cell it
was running, and a torn last line counts as not done.

Reading back (:func:`load_results`), the files may have been edited, torn by a killed sweep or
replaced by something else entirely: a torn last line is a cell cut off mid-write and is
skipped; anything else that is not what fdl bench writes is one :class:`~fdl.errors.FdlError`
naming the file, the line and the field, rather than a failure deep inside the report's
aggregation (lines parsed by fdl.files).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fdl import readback
from fdl.errors import FdlError
from fdl.files import append_jsonl, parse_jsonl, read_jsonl, write_json_atomic
from fdl.launch.child import log_tail
from fdl.rundir.fields import MOST_METRIC, MOST_RATE, is_figure, is_metric

if TYPE_CHECKING:
    from fdl.bench.cells import Cell

SCHEMA = 1


def build_record(cell: Cell, *, run_dir: Path, out_dir: Path) -> dict[str, Any]:
    """The results.jsonl line of a finished cell, from its summary.json, metrics.jsonl and the
    per-rank timelines (``fdl.rundir.report.build_report``: the ideal and idle time)."""
    from fdl.bench.models import get_model  # imports torch: not for fdl bench report's sake
    from fdl.rundir.metrics import read_epochs
    from fdl.rundir.report import build_report, load_run

    model = get_model(cell.model)
    summary, timelines, _ = load_run(run_dir)
    report = build_report(summary, timelines, batch_size=model.batch_size)
    solo = cell.policy == "solo"
    idle = [r["idle_fraction"] for r in report["ranks"] if r["idle_fraction"] is not None]
    reference = model.references.get(cell.dataset)
    history = [{"epoch": row["epoch"], "train_loss": row["train_loss"],
                "eval": row["eval"].get(model.metric)}
               for row in read_epochs(run_dir)]
    return {
        "model": cell.model, "dataset": cell.dataset, "mode": cell.mode,
        "policy": cell.policy, "backend": cell.backend, "seed": cell.seed,
        "world_size": summary["world_size"],
        "slowdown": list(cell.slowdown) if cell.slowdown is not None else None,
        "metric": model.metric, "higher_is_better": model.higher_is_better,
        "eval": summary["eval"].get(model.metric),
        "reference": reference[0] if reference else None,
        "reference_source": reference[1] if reference else None,
        "wall_s": summary["wall_s"], "samples": summary["samples"],
        "samples_per_s": summary["throughput"]["samples_per_s"],
        "syncs": None if solo else summary["sync"]["rounds"],
        "sync_overhead": None if solo else summary["sync"]["overhead"],
        "idle_fraction": None if solo or not idle else sum(idle) / len(idle),
        "ideal_samples_per_s": None if solo else report["ideal_samples_per_s"],
        "history": history, "emulated": cell.emulated,
        "run_dir": run_dir.relative_to(out_dir).as_posix(),
    }


def failure_record(cell: Cell, *, exit_code: int, started: float, log: Path,
                   out_dir: Path) -> dict[str, Any]:
    """The failures.jsonl line of a failed cell: its key and fields, the exit code, when it
    started and how long it took, its log (relative to ``out_dir``) and the log's last lines."""
    return {"key": cell.key, **asdict(cell), "exit_code": exit_code, "started": started,
            "wall_s": time.time() - started, "log": str(log.relative_to(out_dir)),
            "log_tail": log_tail(log)}


def append_record(path: Path, record: dict[str, Any]) -> None:
    """One JSON line, on a line of its own and fsynced before returning: the line is the
    cell's commit."""
    append_jsonl(path, record, durable=True)


def done_keys(out_dir: Path) -> set[str]:
    """Keys of the cells recorded in results.jsonl (a record's run_dir ends with its key). A
    torn last line — the sweep killed while writing it — counts as not done."""
    return {Path(row["run_dir"]).name for row in read_jsonl(out_dir / "results.jsonl")
            if isinstance(row.get("run_dir"), str)}


def write_sweep_json(out_dir: Path, *, machine: dict[str, Any], args: dict[str, Any],
                     num_cells: int, num_skipped: int) -> None:
    """sweep.json: the machine, the arguments and when this sweep (and each resume) started."""
    path = out_dir / "sweep.json"
    try:
        previous = readback.read_json(path)
    except (OSError, ValueError):  # absent, not UTF-8, not JSON, not a file: start anew
        previous = {}
    if not isinstance(previous, dict) or not isinstance(previous.get("sessions", []), list):
        previous = {}
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    sessions = [*previous.get("sessions", []),
                {"started": now, "cells": num_cells, "skipped": num_skipped}]
    write_json_atomic(path, {"schema": SCHEMA, "started": previous.get("started", now),
                             "machine": machine, "args": args, "sessions": sessions})


# --- reading back -----------------------------------------------------------------------

def load_results(directory: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The cell records of ``results.jsonl`` and the sweep's ``sweep.json`` ({} if absent).

    A last line that does not parse is a cell cut off mid-write and is skipped; a bad line
    anywhere else, a record whose fields have the wrong types (:func:`check_record`), a file
    that is not UTF-8 and a ``sweep.json`` that is not a JSON object are errors of one line
    naming the file, the line and the field."""
    path = Path(directory) / "results.jsonl"
    if not path.exists() and not path.is_symlink():
        raise FdlError(f"no benchmark results: {path} does not exist",
                       hint="run `fdl bench` first, or point at the directory it wrote")
    text = _read_text(path)
    found = parse_jsonl(text)
    last = max((n for n, line in enumerate(text.splitlines(), start=1) if line.strip()),
               default=0)
    torn = [number for number in found.bad_lines if number != last]  # a cut-off last cell is not
    if torn:
        raise FdlError(f"{path}:{torn[0]}: not a JSON record",
                       hint="fdl bench writes these lines; remove or fix the edited one")
    records = []
    for number, record in zip(found.line_numbers, found.records, strict=True):
        problem = check_record(record)
        if problem:
            raise FdlError(f"{path}:{number}: {problem}",
                           hint="fdl bench writes these lines; remove or fix the edited one")
        records.append(record)
    sweep_path = Path(directory) / "sweep.json"
    meta = _load_sweep_meta(sweep_path) if os.path.lexists(sweep_path) else {}
    return records, meta


def _read_text(path: Path, *, limit: int = readback.JSONL_BYTES) -> str:
    try:
        return readback.read_text(path, limit=limit)
    except readback.ReadBackError as exc:
        raise FdlError(str(exc), hint="it is not a file fdl bench wrote") from None
    except OSError as exc:
        raise FdlError(f"cannot read {path}: {exc.strerror or exc}") from exc


def _load_sweep_meta(path: Path) -> dict[str, Any]:
    try:
        meta = readback.parse_json(_read_text(path, limit=readback.SMALL_BYTES))
    except ValueError as exc:
        raise FdlError(f"{path}: not JSON fdl can use ({exc})",
                       hint="delete it: the next `fdl bench` in this directory rewrites it") from exc
    if not isinstance(meta, dict) or not isinstance(meta.get("machine", {}), dict) \
            or not isinstance(meta.get("args", {}), dict):
        raise FdlError(f"{path}: expected an object with 'machine' and 'args' objects",
                       hint="delete it: the next `fdl bench` in this directory rewrites it")
    return meta


_METRIC_FIELDS = ("eval", "reference")  # NaN or infinite when a run diverged
_FIGURE_FIELDS = ("wall_s", "samples_per_s", "syncs", "sync_overhead", "idle_fraction")


def check_record(record: Any) -> str | None:
    """What is wrong with one results.jsonl record (None: nothing): the fields the report reads
    must have the types docs/bench.md gives them, so a hand-edited or foreign line is reported
    instead of failing deep inside the aggregation."""
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    for key in ("model", "mode"):
        if not isinstance(record.get(key), str) or not record[key]:
            return f"field {key!r} must be a non-empty string, got {record.get(key)!r:.40}"
    for key in ("policy", "backend"):
        if record.get(key) is not None and not isinstance(record[key], str):
            return f"field {key!r} must be a string or null, got {record[key]!r:.40}"
    for key in _METRIC_FIELDS:
        if not _is_number_or_none(record.get(key)):
            return (f"field {key!r} must be a number at most {MOST_METRIC:g} in size or null, "
                    f"got {record[key]!r:.40}")
    for key in _FIGURE_FIELDS:
        if record.get(key) is not None and not is_figure(record[key], most=MOST_RATE):
            return f"field {key!r} must be a number in [0, {MOST_RATE:g}] or null, " \
                   f"got {record[key]!r:.40}"
    world = record.get("world_size")
    if world is not None and (not isinstance(world, int) or isinstance(world, bool)
                              or not 1 <= world <= 4096):
        return f"field 'world_size' must be an integer 1..4096 or null, got {world!r:.40}"
    slowdown = record.get("slowdown")
    if slowdown is not None and (not isinstance(slowdown, list) or not slowdown
                                 or not all(is_figure(f, most=MOST_RATE) and f > 0
                                            for f in slowdown)):
        return f"field 'slowdown' must be a list of numbers in (0, {MOST_RATE:g}] or null, " \
               f"got {slowdown!r:.40}"
    return _check_history(record.get("history"))


def _check_history(history: Any) -> str | None:
    if history is None:
        return None
    if not isinstance(history, list):
        return f"field 'history' must be a list, got {history!r:.40}"
    for entry in history:
        if not isinstance(entry, dict) or not isinstance(entry.get("epoch"), int) \
                or not _is_number_or_none(entry.get("train_loss")):
            return ("field 'history' must hold {\"epoch\": integer, \"train_loss\": number}, "
                    f"got {entry!r:.60}")
    return None


def _is_number_or_none(value: Any) -> bool:
    """None, or a number at most MOST_METRIC in size (NaN and infinity included: a diverged
    run's loss is a result too), not a bool."""
    return value is None or is_metric(value)
