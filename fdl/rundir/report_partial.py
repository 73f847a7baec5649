"""``fdl report`` on a run that did not finish — interrupted, crashed, or still running: it has
no ``summary.json`` — from what it left: each rank's timeline (its last attempt), config.json's
engine section and the last record of ``metrics.jsonl``. :func:`load_partial_run` rebuilds the
figures ``summary.json`` would hold, so fdl.rundir.report computes the same report, and says
why it is incomplete and where the run stopped (fdl.rundir.stop_point).

How the rebuilt figures differ from a finished run's: the wall time runs from the attempt's
first event to the last event any rank recorded (a finished run's leaves evaluation out);
an average's time is its span in rank 0's timeline (start to end); ``eval`` and
``final_loss`` are the last finished epoch's. A run directory that holds an fdl run but no
timeline (its script never trained with fdl.init or fdl.Trainer) has nothing to report: a usage
error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fdl.errors import UsageError
from fdl.rundir import config as run_config
from fdl.rundir import metrics, timeline
from fdl.rundir.fields import MOST_RATE, is_figure, is_finite, is_int, is_number
from fdl.rundir.layout import logs_dir
from fdl.rundir.stop_point import stop_point
from fdl.rundir.summary import HINT, is_anchor_change

WHY = ("the run did not finish (no summary.json): it stopped {where}, interrupted, crashed or "
       "still running; the figures cover what its timelines hold")


def load_partial_run(run_dir: Path) -> tuple[dict[str, Any], list[timeline.RankTimeline],
                                              dict[str, Any], str]:
    """(the rebuilt summary, every rank's timeline, config.json, why it is incomplete)."""
    config = run_config.read_config(run_dir, hint=HINT)
    files = timeline.numbered_files(run_dir, timeline.RANK_FILE)
    if not files:
        raise UsageError(f"{run_dir} holds an fdl run with no summary.json and no timeline: "
                         "its script did not train with fdl (fdl.init or fdl.Trainer), or stopped before "
                         "training began", hint=f"its workers' output is in {logs_dir(run_dir)}")
    found = [timeline.read_rank_timeline(run_dir, rank=rank) for rank, _ in files]
    world_size = max([rank + 1 for rank, _ in files] +
                     [e["world_size"] for t in found for e in t.events
                      if e["kind"] == "start" and is_int(e.get("world_size"))])
    by_rank = {t.rank: t for t in found}
    timelines = [by_rank.get(rank) or timeline.read_rank_timeline(run_dir, rank=rank)
                 for rank in range(world_size)]
    for rank_timeline in timelines:  # every rank stopped early: the report says so once
        rank_timeline.problems = [p for p in rank_timeline.problems
                                  if p != timeline.NO_FINAL_EVENT]
    point = stop_point(run_dir)
    why = WHY.format(where=point.where() if point else "before its first round ended")
    return rebuilt_summary(config, timelines, run_dir=run_dir), timelines, config, why


def rebuilt_summary(config: dict[str, Any], timelines: list[timeline.RankTimeline],
                    *, run_dir: Path) -> dict[str, Any]:
    """The fields of summary.json that fdl.rundir.report reads, from the timelines."""
    events = [e for t in timelines for e in t.events]
    times = [e["t"] for e in events if is_finite(e.get("t"))]
    wall = max(times) - min(times) if times else 0.0
    samples = [sum(e["samples"] for e in t.events if e["kind"] == "round") for t in timelines]
    compute = max((sum(e["compute_s"] for e in t.events if e["kind"] == "round")
                   for t in timelines), default=0.0)
    spans = [e["end"] - e["start"] for e in (timelines[0].events if timelines else [])
             if e["kind"] == "sync" and is_number(e.get("start")) and is_number(e.get("end"))]
    epochs, left_out = _epochs(run_dir)
    last_epoch = (epochs or [{}])[-1]
    slowdown = _slowdown(config, left_out=left_out)
    return {
        "policy": str(_setting(config, "policy") or "unknown"),
        "backend": str(_setting(config, "resolved_backend") or _setting(config, "backend")
                       or "unknown"),
        "world_size": len(timelines), "wall_s": wall,
        "emulated_slowdown": slowdown,
        "throughput": {
            "samples_per_s": sum(samples) / wall if wall > 0 else None,
            "per_rank_samples_per_s": [s / wall if wall > 0 else None for s in samples]},
        "sync": {"rounds": len(spans),
                 "mean_ms": 1000 * sum(spans) / len(spans) if spans else None,
                 "overhead": sum(spans) / compute if spans and compute > 0 else None},
        "anchor_history": [change for e in (timelines[0].events if timelines else [])
                           if e["kind"] == "anchor" and is_anchor_change(
                               change := [e.get("round"), e.get("anchor"), e.get("reason")])],
        "eval": {k: v for k, v in (last_epoch.get("eval") or {}).items() if is_number(v)},
        "final_loss": last_epoch.get("train_loss") if is_number(
            last_epoch.get("train_loss")) else None,
        "left_out": left_out,
    }


def _epochs(run_dir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """metrics.jsonl's records, and what of it the report leaves out and why (a file fdl will
    not read, lines that are not records): the eval figures and final loss come from it."""
    found = metrics.scan_epochs(run_dir)
    if found.error is not None and found.error != "missing":
        return [], [f"{metrics.FILE} is {found.error}: the eval figures and final loss are "
                    "left out"]
    if found.bad_lines:
        return found.records, [f"{metrics.FILE} has {len(found.bad_lines)} line(s) that are "
                               f"not records (first: line {found.bad_lines[0]}), left out"]
    return found.records, []


def _slowdown(config: dict[str, Any], *, left_out: list[str]) -> list[float] | None:
    """The run's --simulate-slowdown factors (None: none given); config.json's value when it is
    not a list of factors fit to show (an older or edited file) is left out, and ``left_out``
    says so, rather than the report failing on it."""
    factors = _setting(config, "simulate_slowdown")
    if factors is None or (isinstance(factors, list) and factors and all(
            is_figure(f, most=MOST_RATE) for f in factors)):
        return factors
    left_out.append("config.json's simulate_slowdown is not a list of factors fdl can show: "
                    "the emulated slowdown is left out")
    return None


def _setting(config: dict[str, Any], name: str) -> Any:
    """The engine's value of ``name``, else the launcher's (None when neither says)."""
    engine = config.get("engine")
    if isinstance(engine, dict) and name in engine:
        entry = engine[name]
        return entry.get("value") if isinstance(entry, dict) else entry
    entry = run_config.launch_settings(config).get(name)
    return entry.get("value") if entry else None
