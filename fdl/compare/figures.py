"""The figures of ``fdl compare`` and the document of ``compare.json`` (:func:`build_document`):
pure functions of the cells' results (:class:`CellOutcome`).

Per policy, over its seeds (median, and min-max when there are several):

* **samples/s** (summary.json ``throughput.samples_per_s``; evaluation time excluded) and the
  **speedup over sync** (the medians' ratio), when sync is among the policies;
* **time to sync's loss**: the training seconds a run took to reach sync's final train loss
  (the median over sync's seeds) give or take its noise — the range of sync's final losses over
  seeds, or 1 % of it, whichever is larger: train loss is an epoch average, and a policy that
  ends a hair above sync has reached it as far as anyone can tell (:class:`SyncTarget`) —
  interpolated linearly between the epochs of metrics.jsonl (:func:`time_to_loss`); "not
  reached" when it never did. The median is over the seeds that reached it, and the row says
  how many did;
* **final train loss** (the last epoch's), **every eval metric** (summary.json ``eval``),
  **idle fraction** (mean over ranks) and **sync overhead** (sync time over compute time);
* **efficiency**: samples/s over the run's own ideal (``fdl report``'s: the ranks'
  solo-equivalent rates summed, communication excluded).

Impossible figures are **measurement errors**, flagged on their row (``measurement_error``,
one line saying why) and never shown as results; the recommendation leaves them out:

* an efficiency above 1 (a run faster than its ranks alone, summed);
* a speedup over sync above the most any policy can gain (:func:`gain_bound`) by more than
  TIMING_TOLERANCE: every rank busy at its own pace over sync's pace. With ranks ``f_r`` times
  slower (``--simulate-slowdown``), free communication and sync computing as fast as the
  others, that is ``sum(1 / f_r) / (world / max f_r)`` (1.75x at 1,2.5). Neither holds on
  every host: sync's all-reduce takes time, and sync's steps can compute slower than the
  others' (every step blocks in its all-reduce), so a policy can gain more (docs/cli.md
  "fdl compare" has such a run; docs/elche.md "Simulator" a profile where cadence gains more
  than the gap). So when the runs measured their ideals (their ranks' solo-equivalent rates),
  the bound is the largest of them over sync's samples/s, if that is larger: a speedup beyond
  it would have some run faster than any run's ranks could go.

The recommendation (:func:`fdl.compare.recommend.recommend`) is a rule over those rows, spelled
out in its text.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fdl.compare.results import CellOutcome, RunResult
from fdl.rundir.metrics import CurvePoint

SCHEMA = 1
REFERENCE = "sync"
# Differences below this share of sync's value (or below the seeds' spread) are noise: for the
# final eval metric, and for the train loss the others must reach (an epoch-averaged figure).
RELATIVE_TOLERANCE = 0.005
LOSS_TOLERANCE = 0.01
# Timings closer than this share are not told apart: on a shared machine a run's speed moves
# by about this much from one run to the next (docs/bench.md).
TIMING_TOLERANCE = 0.1
_LOWER_IS_BETTER = re.compile(r"loss|mse|mae|rmse|err|perplexity|ppl|nll|wer|cer|^ce$|_ce$")
_HIGHER_IS_BETTER = re.compile(r"acc|f1|auc|precision|recall|score|bleu|iou|map|top")


@dataclass(frozen=True)
class Spread:
    """A figure over seeds: its median and range."""

    median: float
    low: float
    high: float
    count: int

    @property
    def width(self) -> float:
        return self.high - self.low

    def to_dict(self) -> dict[str, Any]:
        return {"median": self.median, "min": self.low, "max": self.high, "runs": self.count}


def spread(values: Sequence[float | None]) -> Spread | None:
    numbers = [float(v) for v in values if v is not None]
    if not numbers:
        return None
    return Spread(statistics.median(numbers), min(numbers), max(numbers), len(numbers))


def time_to_loss(curve: Sequence[CurvePoint], *, target: float) -> float | None:
    """The training seconds at which the train loss first reached ``target``, interpolated
    linearly between the two epochs around it; the first epoch's time when that epoch already
    did (nothing is known before it); None when no epoch did."""
    for index, point in enumerate(curve):
        if point.train_loss > target:
            continue
        if index == 0:
            return point.elapsed_s
        before = curve[index - 1]
        share = (before.train_loss - target) / (before.train_loss - point.train_loss)
        return before.elapsed_s + share * (point.elapsed_s - before.elapsed_s)
    return None


def metric_direction(name: str) -> str | None:
    """"higher" or "lower" is better, from an eval metric's name; None when it does not say."""
    lowered = name.lower()
    if _LOWER_IS_BETTER.search(lowered):
        return "lower"
    return "higher" if _HIGHER_IS_BETTER.search(lowered) else None


def primary_metric(names: Sequence[str]) -> str | None:
    """The eval metric a recommendation guards: the first whose name says higher is better
    (accuracy, ...), else the first that says lower is better (an eval loss, ...)."""
    for direction in ("higher", "lower"):
        for name in names:
            if metric_direction(name) == direction:
                return name
    return None


@dataclass(frozen=True)
class PolicyRow:
    """One policy's figures over its finished seeds."""

    policy: str
    num_runs: int
    num_failed: int
    samples_per_s: Spread | None = None
    speedup_vs_sync: float | None = None
    time_to_sync_loss_s: Spread | None = None
    num_reached: int = 0
    final_loss: Spread | None = None
    eval: Mapping[str, Spread] = field(default_factory=dict)
    idle_fraction: Spread | None = None
    sync_overhead: Spread | None = None
    wall_s: Spread | None = None
    efficiency: Spread | None = None
    measurement_error: str | None = None  # why a figure of this row is impossible

    def to_dict(self) -> dict[str, Any]:
        def show(value: Spread | None) -> dict[str, Any] | None:
            return None if value is None else value.to_dict()

        return {"policy": self.policy, "runs": self.num_runs, "failed": self.num_failed,
                "samples_per_s": show(self.samples_per_s),
                "speedup_vs_sync": self.speedup_vs_sync,
                "time_to_sync_loss_s": show(self.time_to_sync_loss_s),
                "reached_sync_loss": self.num_reached, "final_loss": show(self.final_loss),
                "eval": {name: value.to_dict() for name, value in self.eval.items()},
                "idle_fraction": show(self.idle_fraction),
                "sync_overhead": show(self.sync_overhead), "wall_s": show(self.wall_s),
                "efficiency": show(self.efficiency),
                "measurement_error": self.measurement_error}


@dataclass(frozen=True)
class SyncTarget:
    """The train loss the other policies race to: sync's final loss (median over its seeds)
    and its noise (the range over seeds, or LOSS_TOLERANCE of the loss, whichever is larger)."""

    loss: float
    noise: float

    @property
    def threshold(self) -> float:
        return self.loss + self.noise

    def to_dict(self) -> dict[str, Any]:
        return {"final_loss": self.loss, "noise": self.noise, "threshold": self.threshold}


def sync_target(outcomes: Sequence[CellOutcome]) -> SyncTarget | None:
    """sync's final train loss and its noise; None without a finished sync run."""
    finals = spread([o.result.final_loss for o in outcomes
                     if o.policy == REFERENCE and o.result is not None])
    if finals is None:
        return None
    return SyncTarget(finals.median, max(finals.width, LOSS_TOLERANCE * abs(finals.median)))


def build_rows(outcomes: Sequence[CellOutcome], *, policies: Sequence[str]) -> list[PolicyRow]:
    """One row per policy, in the order given, impossible figures flagged."""
    target = sync_target(outcomes)
    rows = [_row(policy, cells=[o for o in outcomes if o.policy == policy], target=target)
            for policy in policies]
    sync = next((r for r in rows if r.policy == REFERENCE and r.samples_per_s), None)
    if sync is not None and sync.samples_per_s is not None:
        base = sync.samples_per_s.median
        rows = [_with_speedup(row, base=base) for row in rows]
    bound = gain_bound(outcomes)
    return [_with_error(row, bound=bound) for row in rows]


def _with_speedup(row: PolicyRow, *, base: float) -> PolicyRow:
    if row.samples_per_s is None or base <= 0:
        return row
    return replace(row, speedup_vs_sync=row.samples_per_s.median / base)


@dataclass(frozen=True)
class GainBound:
    """The most any policy's samples/s can be over sync's, and where that comes from."""

    value: float
    reason: str


def lockstep_gain(factors: Sequence[float]) -> float:
    """Every rank busy at its own pace over sync's lock step, for ranks ``f_r`` times slower
    than some device, communication free: ``sum(1 / f_r) / (world / max f_r)``."""
    return max(factors) * sum(1 / f for f in factors) / len(factors)


def gain_bound(outcomes: Sequence[CellOutcome]) -> GainBound | None:
    """The most a policy can gain over sync in these runs (the module docstring): the lock
    step's bound at sync's emulated factors, or the largest ideal any policy's runs measured
    (median over its seeds) over sync's samples/s (median), whichever is larger; None when
    neither is known."""
    sync = [o.result for o in outcomes if o.policy == REFERENCE and o.result is not None]
    rate = spread([r.samples_per_s for r in sync])
    bounds = []
    factors = next((r.emulated_slowdown for r in sync if r.emulated_slowdown), None)
    if factors:
        shown = ",".join(f"{f:g}" for f in factors)
        bounds.append(GainBound(lockstep_gain(factors), f"at factors {shown}, every rank "
                                "busy at its own pace over sync's lock step"))
    ideals = {policy: spread([o.result.ideal_samples_per_s for o in outcomes
                              if o.policy == policy and o.result is not None])
              for policy in dict.fromkeys(o.policy for o in outcomes)}
    known = {policy: ideal.median for policy, ideal in ideals.items() if ideal is not None}
    if known and rate is not None and rate.median > 0:
        best = max(known, key=known.__getitem__)
        bounds.append(GainBound(known[best] / rate.median, f"{best}'s ideal, the largest "
                                "measured (its ranks' solo-equivalent rates), over sync's "
                                "samples/s"))
    return max(bounds, key=lambda bound: bound.value, default=None)


def _with_error(row: PolicyRow, *, bound: GainBound | None) -> PolicyRow:
    """``row`` with its measurement error, if a figure of it is impossible."""
    error = None
    if row.efficiency is not None and row.efficiency.high > 1:
        error = (f"efficiency {row.efficiency.high:.0%}: samples/s above the run's own ideal "
                 "(its ranks' solo-equivalent rates summed) is impossible")
    elif bound is not None and row.speedup_vs_sync is not None and \
            row.speedup_vs_sync > bound.value * (1 + TIMING_TOLERANCE):
        error = (f"{row.speedup_vs_sync:.2f}x sync's samples/s is above {bound.value:.2f}x, the "
                 f"most any policy can gain here ({bound.reason}), by more than the "
                 f"{TIMING_TOLERANCE:.0%} a timing moves")
    return row if error is None else replace(row, measurement_error=error + ": a measurement "
                                             "error, not a result; re-run")


def _row(policy: str, *, cells: Sequence[CellOutcome], target: SyncTarget | None) -> PolicyRow:
    results: list[RunResult] = [o.result for o in cells if o.result is not None]
    times = [] if target is None else [time_to_loss(r.curve, target=target.threshold) for r in results]
    names = list(dict.fromkeys(name for result in results for name in result.eval))
    evals = {name: spread([r.eval.get(name) for r in results]) for name in names}
    return PolicyRow(
        policy, num_runs=len(results), num_failed=len(cells) - len(results),
        samples_per_s=spread([r.samples_per_s for r in results]),
        time_to_sync_loss_s=spread(times), num_reached=sum(t is not None for t in times),
        final_loss=spread([r.final_loss for r in results]),
        eval={name: value for name, value in evals.items() if value is not None},
        idle_fraction=spread([r.idle_fraction for r in results]),
        sync_overhead=spread([r.sync_overhead for r in results]),
        wall_s=spread([r.wall_s for r in results]),
        efficiency=spread([r.efficiency for r in results]))


def format_seconds(value: float) -> str:
    """``0.034 s``, ``4.12 s``, ``123.4 s``: three significant figures or a tenth of a second."""
    return f"{value:.{3 if value < 1 else 2 if value < 10 else 1}f} s"


def epochs_of(outcomes: Sequence[CellOutcome]) -> int | None:
    """The epochs every finished run trained (None when they differ or none finished)."""
    found = {len(o.result.curve) for o in outcomes if o.result is not None}
    return found.pop() if len(found) == 1 else None


def is_close(value: float, *, reference: float, spreads: Sequence[Spread | None]) -> bool:
    """Whether two figures differ by no more than the noise: the widest seed range of the two,
    or RELATIVE_TOLERANCE of the reference, whichever is larger."""
    return abs(value - reference) <= tolerance(reference, spreads=spreads)


def tolerance(reference: float, *, spreads: Sequence[Spread | None]) -> float:
    widths = [s.width for s in spreads if s is not None]
    return max([RELATIVE_TOLERANCE * abs(reference), *widths])


def build_document(outcomes: Sequence[CellOutcome], *, rows: Sequence[PolicyRow],
                   plan: Mapping[str, Any], recommendation: Mapping[str, Any],
                   machine: Mapping[str, Any]) -> dict[str, Any]:
    """compare.json: the plan (script, arguments, options, cells), the machine, one row per
    policy, every cell with its figures and curve, and the recommendation."""
    target = sync_target(outcomes)
    return {
        "schema": SCHEMA, **plan, "machine": dict(machine),
        "policies": [row.policy for row in rows],
        "seeds": list(dict.fromkeys(o.seed for o in outcomes)),
        "epochs": epochs_of(outcomes),
        "metric": primary_metric([name for row in rows for name in row.eval]),
        "rows": [row.to_dict() for row in rows],
        "sync_loss_target": None if target is None else target.to_dict(),
        "cells": [_cell(o, target=target) for o in outcomes],
        "recommendation": dict(recommendation),
    }


def _cell(outcome: CellOutcome, *, target: SyncTarget | None) -> dict[str, Any]:
    cell: dict[str, Any] = {"name": outcome.name, "policy": outcome.policy, "seed": outcome.seed,
                            "run_dir": outcome.run_dir, "reused": outcome.skipped,
                            "status": "failed" if outcome.result is None else "finished",
                            "failure": outcome.failure}
    result = outcome.result
    if result is None:
        return cell
    return {**cell, "world_size": result.world_size, "samples": result.samples,
            "wall_s": result.wall_s, "samples_per_s": result.samples_per_s,
            "idle_fraction": result.idle_fraction, "sync_overhead": result.sync_overhead,
            "efficiency": result.efficiency, "final_loss": result.final_loss,
            "eval": dict(result.eval),
            "time_to_sync_loss_s": None if target is None
            else time_to_loss(result.curve, target=target.threshold),
            "epochs": [{"epoch": p.epoch, "samples": p.samples, "elapsed_s": p.elapsed_s,
                        "train_loss": p.train_loss, "eval": dict(p.eval)} for p in result.curve]}
