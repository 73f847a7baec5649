"""``summary.json``: what a finished run did, for people and tools (``fdl report``, ``fdl bench``,
``fdl compare``; docs/elche.md "Outputs" lists the fields). Rank 0 builds it at the end of a
run (:func:`build_summary`) and writes it atomically; :func:`load_summary` reads it back,
checked: a document that does not hold what fdl writes is a UsageError naming the file, the
field, its value and what is allowed. Fields added later (``precision``: each rank's ``fp32``,
``bf16`` or ``fp16``) are optional when read: an older run's summary stays readable, and its
readers show such a field as unknown.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fdl import readback
from fdl.errors import UsageError
from fdl.files import write_json_atomic
from fdl.rundir.fields import (
    MOST_METRIC,
    MOST_RATE,
    MOST_SECONDS,
    is_figure,
    is_int,
    is_metric,
    read_json,
    show,
)

FILE = "summary.json"
HINT = "summary.json and config.json are written by fdl run; restore them or re-run"


def build_summary(*, config: Any, world_size: int, devices: list[str], wall_s: float,
                  samples: list[int], busy_s: list[float], comm_ms: list[float], syncs: int,
                  eval_metrics: dict[str, float], final_loss: float | None,
                  extra: dict[str, Any],
                  step_comm_s: list[float] | None = None,
                  precisions: list[str] | None = None) -> dict[str, Any]:
    """``samples[r]`` and ``busy_s[r]``: rank r's samples and busy time over the run;
    ``comm_ms``: what each average cost, the communication proper (the least over ranks);
    ``step_comm_s[r]``: rank r's time in DDP's all-reduce inside its steps (sync), whose least
    over ranks is that communication proper and counts in the overhead with the averages;
    ``precisions[r]``: what rank r trained in (``fp32``, ``bf16``, ``fp16``), null if not
    given."""
    assert precisions is None or len(precisions) == world_size, (precisions, world_size)
    busy = busy_s
    compute_s = max(busy) if busy else 0.0
    sync_s = sum(comm_ms) / 1000 + (min(step_comm_s) if step_comm_s else 0.0)
    return {
        "policy": str(config.policy),
        "backend": config.backend,
        "world_size": world_size,
        "devices": devices,
        "precision": list(precisions) if precisions is not None else None,
        "emulated_slowdown": list(config.simulate_slowdown) if config.simulate_slowdown else None,
        "epochs": config.epochs,
        "samples": sum(samples),
        "wall_s": wall_s,
        "throughput": {
            "samples_per_s": sum(samples) / wall_s if wall_s > 0 else None,
            "per_rank_samples_per_s": [s / wall_s if wall_s > 0 else None for s in samples],
        },
        "sync": {
            "rounds": syncs,
            "mean_ms": sum(comm_ms) / len(comm_ms) if comm_ms else None,
            "overhead": sync_s / compute_s if (comm_ms or sync_s) and compute_s > 0 else None,
        },
        "idle_fraction": [max(0.0, 1 - b / wall_s) if wall_s > 0 else None for b in busy],
        "eval": eval_metrics,
        "final_loss": final_loss,
        **extra,
    }


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    return write_json_atomic(run_dir / FILE, summary)


def has_summary(run_dir: Path) -> bool:
    """Whether the run finished with a summary (the script trained with fdl's engine): there
    is an entry of that name, whatever it is (:func:`load_summary` says what is wrong with one
    that is not a summary fdl wrote)."""
    return os.path.lexists(run_dir / FILE)


def load_summary(run_dir: Path) -> dict[str, Any]:
    """summary.json, checked (see the module docstring)."""
    path = run_dir / FILE
    if not has_summary(run_dir):
        raise UsageError(f"{run_dir} has no {FILE} (not a finished fdl run)",
                         hint="pass a run directory, e.g. runs/<time>-train-async")
    summary = read_json(path, hint=HINT, limit=readback.DOCUMENT_BYTES)
    _check_summary(summary, path)
    return summary


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    """summary.json as an object, unchecked, or None when there is none that parses (the
    merged timeline shows what it has)."""
    try:
        summary = readback.read_json(run_dir / FILE, limit=readback.DOCUMENT_BYTES)
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def _figure(most: float, *, null: bool = True) -> tuple[Any, str]:
    """A finite figure in [0, most] (or null, a figure the run could not measure)."""
    return (lambda v: (null and v is None) or is_figure(v, most=most),
            f"a number in [0, {most:g}]" + (" or null" if null else ""))


_FIELDS: dict[str, tuple[Any, str]] = {
    "policy": (lambda v: isinstance(v, str), "a string"),
    "backend": (lambda v: isinstance(v, str), "a string"),
    "world_size": (lambda v: is_int(v) and v >= 1, "a positive integer"),
    "wall_s": _figure(MOST_SECONDS, null=False),
    "throughput": (lambda v: isinstance(v, dict), "an object"),
    "throughput.samples_per_s": _figure(MOST_RATE),
    "throughput.per_rank_samples_per_s": (
        lambda v: isinstance(v, list) and all(
            x is None or is_figure(x, most=MOST_RATE) for x in v),
        f"a list of numbers in [0, {MOST_RATE:g}] or nulls, one per rank"),
    "sync": (lambda v: isinstance(v, dict), "an object"),
    "sync.rounds": (lambda v: is_int(v) and v >= 0, "an integer >= 0"),
    "sync.mean_ms": _figure(MOST_RATE),
    "sync.overhead": _figure(MOST_RATE),
    "emulated_slowdown": (lambda v: v is None or (isinstance(v, list) and all(
        is_figure(x, most=MOST_RATE) for x in v)), "a list of numbers >= 0 or null"),
}
_OPTIONAL_FIELDS: dict[str, tuple[Any, str]] = {
    "anchor_history": (lambda v: isinstance(v, list) and all(is_anchor_change(x) for x in v),
                       "a list of [round, anchor, reason]: a round >= 0, an anchor in "
                       f"[0, {MOST_RATE:g}], a reason"),
    "eval": (lambda v: isinstance(v, dict), "an object of numbers"),
    "final_loss": (lambda v: v is None or is_metric(v),
                   f"a number at most {MOST_METRIC:g} in size, or null"),
    "devices": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
                "a list of strings, one per rank"),
    "precision": (lambda v: v is None or (isinstance(v, list)
                                          and all(isinstance(x, str) for x in v)),
                  "a list of strings, one per rank, or null"),
}


def is_anchor_change(entry: Any) -> bool:
    """One entry of ``anchor_history``: ``[round, anchor, reason]``."""
    return isinstance(entry, list) and len(entry) == 3 and is_int(entry[0]) and entry[0] >= 0 \
        and is_figure(entry[1], most=MOST_RATE) and isinstance(entry[2], str)


def _check_summary(summary: Any, path: Path) -> None:
    """A UsageError naming the first field of ``summary`` a reader cannot use."""
    if not isinstance(summary, dict):
        raise UsageError(f"{path} holds {show(summary)}, not a JSON object", hint=HINT)
    fields = {**_FIELDS, **{k: v for k, v in _OPTIONAL_FIELDS.items() if k in summary}}
    for name, (valid, allowed) in fields.items():
        parent, _, key = name.rpartition(".")
        holder = summary[parent] if parent else summary
        if key not in holder:
            raise UsageError(f"{path} has no {name}", hint=HINT)
        if not valid(holder[key]):
            raise UsageError(f"{path}: {name} is {show(holder[key])}, expected {allowed}",
                             hint=HINT)
    for key, value in summary.get("eval", {}).items():
        if not is_metric(value):
            raise UsageError(f"{path}: eval.{key} is {show(value)}, expected a number at most "
                             f"{MOST_METRIC:g} in size", hint=HINT)
    per_rank = [("throughput.per_rank_samples_per_s",
                 summary["throughput"]["per_rank_samples_per_s"]),
                ("devices", summary.get("devices")), ("precision", summary.get("precision"))]
    for name, values in per_rank:
        if values is not None and len(values) != summary["world_size"]:
            raise UsageError(f"{path}: world_size is {summary['world_size']} but {name} has "
                             f"{len(values)} entries", hint=HINT)
