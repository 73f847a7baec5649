"""What a finished ``fdl bench`` cell leaves behind: its line in ``results.jsonl`` (built from
the run's summary.json, metrics.jsonl and timelines), the sweep's ``sweep.json`` (machine facts,
arguments, each session), and the set of cells already done that a resumed sweep skips.

``results.jsonl`` is a contract for tools (docs/bench.md lists its fields); each line is
flushed and fsynced before the next cell starts, so a killed sweep loses at most the cell it
was running, and a torn last line counts as not done.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fdl.files import append_jsonl, read_jsonl, write_json_atomic

if TYPE_CHECKING:
    from fdl.bench.cells import Cell

SCHEMA = 1


def build_record(cell: Cell, *, run_dir: Path, out_dir: Path) -> dict[str, Any]:
    """The results.jsonl line of a finished cell, from its summary.json, metrics.jsonl and the
    per-rank timelines (``fdl.launch.report.build_report``: the ideal and idle time)."""
    from fdl.bench.models import get_model  # imports torch: not for machine_facts' sake
    from fdl.launch.report import build_report, load_run

    model = get_model(cell.model)
    summary, timelines, _ = load_run(run_dir)
    report = build_report(summary, timelines, batch_size=model.batch_size)
    solo = cell.policy == "solo"
    idle = [r["idle_fraction"] for r in report["ranks"] if r["idle_fraction"] is not None]
    reference = model.references.get(cell.dataset)
    history = [{"epoch": row["epoch"], "train_loss": row["train_loss"],
                "eval": row["eval"].get(model.metric)}
               for row in read_jsonl(run_dir / "metrics.jsonl")]
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
        previous = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # absent, not UTF-8 or not JSON: start the file anew
        previous = {}
    if not isinstance(previous, dict) or not isinstance(previous.get("sessions", []), list):
        previous = {}
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    sessions = [*previous.get("sessions", []),
                {"started": now, "cells": num_cells, "skipped": num_skipped}]
    write_json_atomic(path, {"schema": SCHEMA, "started": previous.get("started", now),
                             "machine": machine, "args": args, "sessions": sessions})
