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

What is read back is checked, not trusted. ``summary.json`` and ``config.json`` that do not hold
what fdl writes are a UsageError naming the file, the field, its value and what is allowed.
Timelines are tolerated as far as they go: only each rank's last attempt counts (after its last
``start`` event: ``summary.json`` covers the attempt that finished), records with missing or
mistyped fields are left out, and a rank whose timeline is missing, unreadable, damaged or
records other than the samples ``summary.json`` counts for it is listed under ``incomplete``
with what its figures then cover.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fdl.errors import UsageError
from fdl.files import scan_jsonl

SCHEMA = 1
_HINT = "summary.json and config.json are written by fdl run; restore them or re-run"


@dataclass
class RankTimeline:
    """One rank's timeline as the report reads it: the usable events of its last attempt, and
    what is wrong with the file (empty when nothing is)."""

    rank: int
    events: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def load_run(run_dir: Path) -> tuple[dict[str, Any], list[RankTimeline], dict[str, Any]]:
    """summary.json (checked), every rank's timeline and config.json (empty if absent)."""
    summary, config = load_summary_and_config(run_dir)
    timelines = [read_rank_timeline(run_dir / "timeline" / f"rank{rank}.jsonl", rank=rank)
                 for rank in range(summary["world_size"])]
    return summary, timelines, config


def load_summary_and_config(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """summary.json (checked) and config.json (empty if absent), without the timelines."""
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        raise UsageError(f"{run_dir} has no summary.json (not a finished fdl run)",
                         hint="pass a run directory, e.g. runs/<time>-train-async")
    summary = _read_json(summary_path)
    _check_summary(summary, summary_path)
    config_path = run_dir / "config.json"
    config = _read_json(config_path) if config_path.exists() else {}
    if not isinstance(config, dict):
        raise UsageError(f"{config_path} holds {_show(config)}, not a JSON object", hint=_HINT)
    return summary, config


def report_batch_size(config: dict[str, Any], *, path: Path) -> int:
    """The run's batch size from config.json (``path``)'s engine section; 1 when it has none."""
    engine = config.get("engine", {})
    if not isinstance(engine, dict):
        raise UsageError(f"{path}: engine is {_show(engine)}, expected an object", hint=_HINT)
    entry = engine.get("batch_size")
    value = entry.get("value") if isinstance(entry, dict) else entry
    if value is None:
        return 1
    if not _is_int(value) or value < 1:
        raise UsageError(f"{path}: engine.batch_size is {_show(value)}, expected a positive "
                         "integer", hint=_HINT)
    return value


def read_rank_timeline(path: Path, *, rank: int) -> RankTimeline:
    """Rank ``rank``'s events from its last ``start`` on, with what is wrong with the file."""
    found = scan_jsonl(path)
    timeline = RankTimeline(rank)
    if found.error is not None or not (found.records or found.bad_lines):
        timeline.problems.append(f"{path.name} is {found.error or 'empty'}")
        return timeline
    starts = [i for i, record in enumerate(found.records) if record.get("kind") == "start"]
    first = starts[-1] if starts else 0
    first_line = found.line_numbers[first] if starts else 0
    bad = [n for n in found.bad_lines if n > first_line]
    if bad:
        timeline.problems.append(f"{len(bad)} line(s) that are not JSON records "
                                 f"(first: line {bad[0]})")
    malformed = []
    for record, line in zip(found.records[first:], found.line_numbers[first:], strict=True):
        problem = _record_problem(record)
        if problem is None:
            timeline.events.append(record)
        else:
            malformed.append(f"line {line}: {problem}")
    if malformed:
        timeline.problems.append(f"{len(malformed)} malformed record(s) left out "
                                 f"(first: {malformed[0]})")
    if timeline.events and not any(e["kind"] == "final" for e in timeline.events):
        timeline.problems.append("no final event (cut off before the run ended)")
    return timeline


def build_report(summary: dict[str, Any], timelines: list[RankTimeline],
                 *, batch_size: int) -> dict[str, Any]:
    wall = float(summary["wall_s"])
    ranks = [_rank(t.events, wall=wall, batch_size=batch_size) for t in timelines]
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
        "incomplete": _incomplete(summary, timelines, ranks),
    }


def _incomplete(summary: dict[str, Any], timelines: list[RankTimeline],
                ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ranks whose figures do not cover their whole run, each with a one-line message."""
    wall, rates = summary["wall_s"], summary["throughput"]["per_rank_samples_per_s"]
    found = []
    for timeline, row in zip(timelines, ranks, strict=True):
        expected = round(rates[timeline.rank] * wall) if rates[timeline.rank] is not None \
            else None
        problems = list(timeline.problems)
        if expected is not None and row["samples"] != expected:
            problems.append(f"it records {row['samples']} of the {expected} samples "
                            "summary.json counts for it")
        if not problems:
            continue
        found.append({"rank": timeline.rank, "problems": problems,
                      "recorded_samples": row["samples"], "summary_samples": expected,
                      "message": f"rank {timeline.rank}'s timeline is incomplete: "
                                 f"{'; '.join(problems)}. Its figures (samples/s, share, "
                                 f"ms/step, time split, and so the ideal) cover only the "
                                 f"{row['samples']} samples it records"})
    return found


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


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not UTF-8 text (a JSON document was expected)",
                         hint=_HINT) from None
    except ValueError as exc:
        raise UsageError(f"{path} is not valid JSON ({exc})", hint=_HINT) from None
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}", hint=_HINT) from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value: Any) -> bool:
    return _is_number(value) and math.isfinite(value) and value >= 0


def _show(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (str, int, float, type(None))) else \
        type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


_NUMBER_OR_NULL = (lambda v: v is None or _is_number(v), "a number or null")
_SUMMARY_FIELDS: dict[str, tuple[Any, str]] = {
    "policy": (lambda v: isinstance(v, str), "a string"),
    "backend": (lambda v: isinstance(v, str), "a string"),
    "world_size": (lambda v: _is_int(v) and v >= 1, "a positive integer"),
    "wall_s": (_finite, "a number >= 0"),
    "throughput": (lambda v: isinstance(v, dict), "an object"),
    "throughput.samples_per_s": _NUMBER_OR_NULL,
    "throughput.per_rank_samples_per_s": (
        lambda v: isinstance(v, list) and all(x is None or _finite(x) for x in v),
        "a list of numbers >= 0 or nulls, one per rank"),
    "sync": (lambda v: isinstance(v, dict), "an object"),
    "sync.rounds": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "sync.mean_ms": _NUMBER_OR_NULL,
    "sync.overhead": _NUMBER_OR_NULL,
    "emulated_slowdown": (lambda v: v is None or (isinstance(v, list)
                                                  and all(_is_number(x) for x in v)),
                          "a list of numbers or null"),
}
_OPTIONAL_SUMMARY_FIELDS: dict[str, tuple[Any, str]] = {
    "anchor_history": (lambda v: isinstance(v, list) and all(
        isinstance(x, list) and len(x) == 3 for x in v), "a list of [round, anchor, reason]"),
    "eval": (lambda v: isinstance(v, dict) and all(_is_number(x) for x in v.values()),
             "an object of numbers"),
    "final_loss": _NUMBER_OR_NULL,
}


def _check_summary(summary: Any, path: Path) -> None:
    """A UsageError naming the first field of ``summary`` the report cannot use."""
    if not isinstance(summary, dict):
        raise UsageError(f"{path} holds {_show(summary)}, not a JSON object", hint=_HINT)
    fields = {**_SUMMARY_FIELDS, **{k: v for k, v in _OPTIONAL_SUMMARY_FIELDS.items()
                                    if k in summary}}
    for name, (valid, allowed) in fields.items():
        parent, _, key = name.rpartition(".")
        holder = summary[parent] if parent else summary
        if key not in holder:
            raise UsageError(f"{path} has no {name}", hint=_HINT)
        if not valid(holder[key]):
            raise UsageError(f"{path}: {name} is {_show(holder[key])}, expected {allowed}",
                             hint=_HINT)
    rates = summary["throughput"]["per_rank_samples_per_s"]
    if len(rates) != summary["world_size"]:
        raise UsageError(f"{path}: world_size is {summary['world_size']} but "
                         f"throughput.per_rank_samples_per_s has {len(rates)} entries",
                         hint=_HINT)


# The fields the report uses, per event kind (fdl.engine.timeline writes them).
_RECORD_FIELDS: dict[str, dict[str, tuple[Any, str]]] = {
    "round": {"t": (_finite, "a number >= 0"), "steps": (lambda v: _is_int(v) and v >= 0,
                                                         "an integer >= 0"),
              "samples": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
              "compute_s": (_finite, "a number >= 0"), "data_s": (_finite, "a number >= 0")},
    "sync": {"t": (_finite, "a number >= 0"), "wait_s": (_finite, "a number >= 0")},
    "epoch": {"t": (_finite, "a number >= 0")},
}
_OPTIONAL_RECORD_FIELDS = {"data_s"}  # rounds written before the field existed


def _record_problem(record: dict[str, Any]) -> str | None:
    kind = record.get("kind")
    if not isinstance(kind, str):
        return f"'kind' is {_show(kind)}, expected a string"
    for key, (valid, allowed) in _RECORD_FIELDS.get(kind, {}).items():
        if key not in record:
            if key in _OPTIONAL_RECORD_FIELDS:
                continue
            return f"a {kind} record has no {key!r}"
        if not valid(record[key]):
            return f"a {kind} record's {key!r} is {_show(record[key])}, expected {allowed}"
    return None
