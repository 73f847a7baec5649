"""``fdl report RUN_DIR``: where the time of a run went, from its ``summary.json`` and the
per-rank timelines (``timeline/rank<r>.jsonl``). Pure functions over those files' contents;
torch is not needed.

Per rank: samples, share of the work, samples/s, mean step time, and the wall time split into
compute (steps, including emulated slowdown), waiting at sync (the averaging boundaries),
epoch boundaries (loss reduction, checkpoints and bookkeeping between the last round of an
epoch and the next one; evaluation itself is excluded from the run's wall time), data loading
(fetching and collating batches between steps: the rounds' ``data_s``) and unexplained (what
remains: Python and scheduling).

Efficiency: the measured throughput over the ideal, the sum of every rank's solo-equivalent
rate (``batch_size / step time``, from the measured step times) — what the ranks would deliver
if none of them ever waited.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fdl.errors import UsageError
from fdl.files import read_jsonl

SCHEMA = 1


def load_run(run_dir: Path) -> tuple[dict[str, Any], list[list[dict[str, Any]]], dict[str, Any]]:
    """summary.json, every rank's timeline events and config.json (empty if absent)."""
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        raise UsageError(f"{run_dir} has no summary.json (not a finished fdl run)",
                         hint="pass a run directory, e.g. runs/<time>-train-async")
    summary = json.loads(summary_path.read_text(encoding="utf-8"))
    timelines = []
    for rank in range(int(summary.get("world_size", 1))):
        timelines.append(read_jsonl(run_dir / "timeline" / f"rank{rank}.jsonl"))
    config_path = run_dir / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    return summary, timelines, config


def build_report(summary: dict[str, Any], timelines: list[list[dict[str, Any]]],
                 *, batch_size: int) -> dict[str, Any]:
    wall = float(summary["wall_s"])
    ranks = [_rank(events, wall=wall, batch_size=batch_size) for events in timelines]
    total = sum(r["samples"] for r in ranks) or 1
    for row in ranks:
        row["share"] = row["samples"] / total
    ideal = sum(r["solo_samples_per_s"] for r in ranks if r["solo_samples_per_s"])
    measured = summary["throughput"]["samples_per_s"]
    return {
        "schema": SCHEMA, "policy": summary["policy"], "backend": summary["backend"],
        "world_size": summary["world_size"], "emulated_slowdown": summary["emulated_slowdown"],
        "wall_s": wall, "samples_per_s": measured,
        "ideal_samples_per_s": ideal or None,
        "efficiency": measured / ideal if ideal and measured else None,
        "ranks": ranks, "sync": summary["sync"],
        "anchor_history": summary.get("anchor_history", []),
        "eval": summary.get("eval", {}), "final_loss": summary.get("final_loss"),
    }


def _rank(events: list[dict[str, Any]], *, wall: float, batch_size: int) -> dict[str, Any]:
    rounds = [e for e in events if e["kind"] == "round"]
    syncs = [e for e in events if e["kind"] == "sync"]
    steps = sum(e["steps"] for e in rounds)
    data = sum(e.get("data_s", 0.0) for e in rounds)
    compute = sum(e["compute_s"] for e in rounds) - data
    waiting = sum(e["wait_s"] for e in syncs)
    boundary = _epoch_boundaries(events)
    step_s = compute / steps if steps else None
    samples = sum(e["samples"] for e in rounds)
    return {
        "samples": samples, "steps": steps,
        "samples_per_s": samples / wall if wall > 0 else None,
        "step_ms": step_s * 1000 if step_s else None,
        "solo_samples_per_s": batch_size / step_s if step_s else None,
        "time_s": {"compute": compute, "sync_wait": waiting, "epoch_boundary": boundary,
                   "data_loading": data,
                   "unexplained": max(0.0, wall - compute - waiting - boundary - data)},
        "idle_fraction": max(0.0, 1 - compute / wall) if wall > 0 else None,
    }


def _epoch_boundaries(events: list[dict[str, Any]]) -> float:
    """Time from each epoch's end event to the next round's start (its end minus compute)."""
    total, pending = 0.0, None
    for event in events:
        if event["kind"] == "epoch":
            pending = event["t"]
        elif event["kind"] == "round" and pending is not None:
            total += max(0.0, (event["t"] - event["compute_s"]) - pending)
            pending = None
    return total
