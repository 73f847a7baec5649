"""What one ``fdl compare`` cell left behind, read back and checked: a :class:`RunResult` from its
run directory's ``summary.json`` (checked as ``fdl report`` checks it), ``metrics.jsonl`` (the
loss and eval curves), ``config.json`` (which must match the cell's plan) and the per-rank
timelines (the run's ideal, as ``fdl report`` computes it: None when a timeline is incomplete).

A run directory that cannot be used — no summary.json (the run failed or was interrupted), a
file that is not what fdl writes, a figure that is not a finite number (a diverged run's NaN
loss included), a config.json from another plan — raises :class:`RunUnusable` naming the file
and what is wrong; ``fdl compare`` counts that cell as failed and reruns it next time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fdl.errors import FdlError, UsageError
from fdl.rundir.config import FILE as CONFIG_FILE
from fdl.rundir.config import matches_launch
from fdl.rundir.metrics import CurvePoint, finite, finite_metrics, read_curve
from fdl.rundir.report import build_report, load_run, report_batch_size
from fdl.rundir.summary import FILE as SUMMARY_FILE


class RunUnusable(FdlError):
    """A cell's run directory holds no result fdl compare can use."""

    def __init__(self, message: str):
        super().__init__(message, hint="fdl compare reruns this cell when run again with the "
                                       "same --out")


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
    curve: tuple[CurvePoint, ...]
    emulated_slowdown: tuple[float, ...] | None = None  # --simulate-slowdown's factors
    ideal_samples_per_s: float | None = None  # the ranks' solo-equivalent rates, summed

    @property
    def efficiency(self) -> float | None:
        """samples/s over the run's own ideal (fdl report's efficiency)."""
        return self.samples_per_s / self.ideal_samples_per_s if self.ideal_samples_per_s \
            else None

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
    its config.json is not the run of the launch ``expected`` describes
    (fdl.rundir.config.launch_identity)."""
    try:
        summary, timelines, config = load_run(run_dir)
        curve = read_curve(run_dir)
        if expected is not None and not matches_launch(config, identity=dict(expected)):
            raise UsageError(f"{run_dir / CONFIG_FILE} does not match this cell's plan (the "
                             "script, its arguments or a setting changed)")
        report = build_report(summary, timelines,
                              batch_size=report_batch_size(config, run_dir=run_dir))
        ideal = None if report["incomplete"] else report["ideal_samples_per_s"]
        return _result(summary, curve=curve, path=run_dir / SUMMARY_FILE, ideal=ideal)
    except UsageError as exc:
        raise RunUnusable(exc.message) from exc


def _result(summary: dict[str, Any], *, curve: tuple[CurvePoint, ...], path: Path,
            ideal: float | None) -> RunResult:
    rate = finite(summary["throughput"]["samples_per_s"], f"{path}: throughput.samples_per_s")
    idle = [value for value in summary.get("idle_fraction") or []
            if isinstance(value, (int, float)) and math.isfinite(value)]
    overhead = summary["sync"]["overhead"]
    samples = summary.get("samples")
    return RunResult(
        world_size=summary["world_size"],
        samples=samples if isinstance(samples, int) and not isinstance(samples, bool)
        else curve[-1].samples,
        wall_s=float(summary["wall_s"]), samples_per_s=rate,
        idle_fraction=sum(idle) / len(idle) if idle else None,
        sync_overhead=None if overhead is None else finite(overhead, f"{path}: sync.overhead"),
        eval=finite_metrics(summary.get("eval"), str(path)), curve=curve,
        emulated_slowdown=tuple(summary["emulated_slowdown"]) if summary["emulated_slowdown"]
        else None, ideal_samples_per_s=ideal)
