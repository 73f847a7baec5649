"""What one ``fdl compare`` cell left behind, read back and checked: a :class:`RunResult` from its
run directory's ``summary.json`` (checked as ``fdl report`` checks it), ``metrics.jsonl`` (the
loss and eval curves) and ``config.json`` (which must match the cell's plan).

A run directory that cannot be used — no summary.json (the run failed or was interrupted), a
file that is not what fdl writes, a figure that is not a finite number (a diverged run's NaN
loss included), a config.json from another plan — raises :class:`RunUnusable` naming the file
and what is wrong; ``fdl compare`` counts that cell as failed and reruns it next time.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fdl.errors import FdlError, UsageError
from fdl.files import scan_jsonl


class RunUnusable(FdlError):
    """A cell's run directory holds no result fdl compare can use."""

    def __init__(self, message: str):
        super().__init__(message, hint="fdl compare reruns this cell when run again with the "
                                       "same --out")


@dataclass(frozen=True)
class EpochPoint:
    """One line of metrics.jsonl: training seconds (evaluation excluded) and samples so far."""

    epoch: int
    samples: int
    elapsed_s: float
    train_loss: float
    eval: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RunResult:
    """The figures of one finished run that fdl compare shows (summary.json and metrics.jsonl)."""

    world_size: int
    samples: int
    wall_s: float
    samples_per_s: float
    idle_fraction: float | None  # mean over ranks
    sync_overhead: float | None
    eval: Mapping[str, float]
    curve: tuple[EpochPoint, ...]

    @property
    def final_loss(self) -> float:
        """The last epoch's train loss."""
        return self.curve[-1].train_loss


@dataclass(frozen=True)
class CellOutcome:
    """A cell after fdl compare ran it (or found it finished: ``skipped``)."""

    name: str
    policy: str
    seed: int
    run_dir: str
    result: RunResult | None = None
    failure: str | None = None
    skipped: bool = False


def load_run_result(run_dir: Path, *,
                    expected: Mapping[str, Any] | None = None) -> RunResult:
    """The result in ``run_dir``; RunUnusable when there is none fdl compare can use, or when
    its config.json does not hold ``expected`` (:func:`config_matches`)."""
    from fdl.launch.report import load_summary_and_config

    try:
        summary, config = load_summary_and_config(run_dir)
    except UsageError as exc:
        raise RunUnusable(exc.message) from exc
    if expected is not None and not config_matches(config, expected=expected):
        raise RunUnusable(f"{run_dir / 'config.json'} does not match this cell's plan "
                          "(the script, its arguments or a setting changed)")
    curve = read_curve(run_dir / "metrics.jsonl")
    return _result(summary, curve=curve, path=run_dir / "summary.json")


def expected_config(spec: Mapping[str, Any]) -> dict[str, Any]:
    """What a run's config.json must hold to be this cell's run, from the cell's planned launch
    spec (``LaunchSpec.to_dict()``): script, arguments, workers and every setting's value."""
    wanted = {"script": spec["script"], "args": spec["args"], "module": spec["module"],
              "nproc_per_node": spec["nproc_per_node"],
              "settings": {name: entry["value"] for name, entry in spec["settings"].items()}}
    return json.loads(json.dumps(wanted))  # as read back from JSON: tuples become lists


def config_matches(config: Mapping[str, Any], *, expected: Mapping[str, Any]) -> bool:
    settings = config.get("settings")
    if not isinstance(settings, dict):
        return False
    found = {key: config.get(key) for key in ("script", "args", "module", "nproc_per_node")}
    found["settings"] = {name: settings[name].get("value") if isinstance(settings.get(name), dict)
                         else None for name in expected["settings"]}
    return found == dict(expected)


def read_curve(path: Path) -> tuple[EpochPoint, ...]:
    """The epochs of metrics.jsonl; RunUnusable for a missing file, a bad line or field."""
    found = scan_jsonl(path)
    if found.error is not None:
        raise RunUnusable(f"{path}: {found.error} (the run finished no epoch)")
    if found.bad_lines:
        raise RunUnusable(f"{path}:{found.bad_lines[0]}: not a JSON record")
    points: list[EpochPoint] = []
    for number, record in zip(found.line_numbers, found.records, strict=True):
        point = _point(record, where=f"{path}:{number}")
        if points and point.epoch <= points[-1].epoch:
            raise RunUnusable(f"{path}:{number}: epoch {point.epoch} does not follow epoch "
                              f"{points[-1].epoch}")
        points.append(point)
    if not points:
        raise RunUnusable(f"{path}: no epoch recorded")
    return tuple(points)


def _point(record: dict[str, Any], *, where: str) -> EpochPoint:
    epoch, samples = record.get("epoch"), record.get("samples")
    if not _is_int(epoch) or epoch < 1 or not _is_int(samples) or samples < 1:
        raise RunUnusable(f"{where}: 'epoch' and 'samples' must be integers >= 1, got "
                          f"{epoch!r:.20} and {samples!r:.20}")
    loss = _finite(record.get("train_loss"), f"{where}: train_loss")
    if record.get("elapsed_s") is not None:
        elapsed = _finite(record["elapsed_s"], f"{where}: elapsed_s")
    else:  # written before elapsed_s existed: samples_per_s is the run's average so far
        rate = _finite(record.get("samples_per_s"), f"{where}: samples_per_s")
        if rate <= 0:
            raise RunUnusable(f"{where}: samples_per_s is {rate}, expected a number > 0")
        elapsed = samples / rate
    return EpochPoint(epoch, samples, elapsed, loss, _metrics(record.get("eval"), where))


def _metrics(values: Any, where: str) -> dict[str, float]:
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise RunUnusable(f"{where}: eval must be an object of numbers, got {values!r:.40}")
    return {str(name): _finite(value, f"{where}: eval.{name}") for name, value in values.items()}


def _result(summary: dict[str, Any], *, curve: tuple[EpochPoint, ...], path: Path) -> RunResult:
    rate = _finite(summary["throughput"]["samples_per_s"], f"{path}: throughput.samples_per_s")
    idle = [value for value in summary.get("idle_fraction") or []
            if isinstance(value, (int, float)) and math.isfinite(value)]
    overhead = summary["sync"]["overhead"]
    samples = summary.get("samples")
    return RunResult(
        world_size=summary["world_size"],
        samples=samples if _is_int(samples) else curve[-1].samples,
        wall_s=float(summary["wall_s"]), samples_per_s=rate,
        idle_fraction=sum(idle) / len(idle) if idle else None,
        sync_overhead=None if overhead is None else _finite(overhead, f"{path}: sync.overhead"),
        eval=_metrics(summary.get("eval"), str(path)), curve=curve)


def _finite(value: Any, what: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise RunUnusable(f"{what} is {value!r:.40}, expected a finite number")
    return float(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
