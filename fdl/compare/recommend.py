"""Which policy ``fdl compare`` recommends, and why: a pure rule over the policies' rows.

The quality guard: a policy's final eval metric (the first accuracy-like one, else the first
loss-like one; the final train loss when the script evaluates nothing) must not be worse than
the reference's by more than the noise — the wider of the two seed ranges, or 0.5 % of the
reference's value, whichever is larger (:func:`fdl.compare.figures.is_close`).

* **sync finished**: of sync and the policies that pass the guard, the one that got to sync's
  quality in the fewest training seconds (medians over seeds). A policy that reached sync's
  final train loss (give or take its noise, :class:`fdl.compare.figures.SyncTarget`) in at
  least half of its seeds counts the time it took; one that did not, but whose final eval
  metric passes the guard, counts its whole training time (the same samples, trained sooner,
  to an eval metric as good: what people train for; without an eval metric it does not
  qualify). sync's own time is the time it took to reach its own final loss.
* **no sync** (not asked for, or every sync run failed): of the policies within the noise of
  the best final metric, the one with the most samples/s.

A policy whose figures are impossible (``measurement_error``: an efficiency above 1, a speedup
over sync above the most any policy can gain; :mod:`fdl.compare.figures`) is left out, and the
evidence is thin; when sync's own are, nothing is recommended: every comparison rests on them.

The evidence is called thin when the winner or the reference finished fewer than two seeds
(run-to-run noise not measured), when the winner's range over seeds overlaps the runner-up's or
its median is within 10 % of it (timings on a shared machine move that much), or when some of
the winner's seeds did not reach sync's loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fdl.compare.figures import (
    REFERENCE,
    TIMING_TOLERANCE,
    PolicyRow,
    Spread,
    format_seconds,
    is_close,
    metric_direction,
    primary_metric,
    tolerance,
)


@dataclass(frozen=True)
class Recommendation:
    policy: str | None
    basis: str  # "time to sync's final loss" | "samples/s" | "nothing finished" |
    # "measurement error"
    text: str
    thin: bool
    notes: tuple[str, ...] = ()  # why each other policy lost

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "basis": self.basis, "text": self.text,
                "thin_evidence": self.thin, "notes": list(self.notes)}


@dataclass(frozen=True)
class Quality:
    """The figure the guard compares: its name, values over seeds, and which way is better."""

    name: str
    values: Spread | None
    higher: bool

    @staticmethod
    def of(row: PolicyRow, *, metric: str | None) -> Quality:
        if metric is None:
            return Quality("train loss", row.final_loss, higher=False)
        return Quality(metric, row.eval.get(metric), metric_direction(metric) == "higher")

    def worse_than(self, other: Quality) -> bool:
        """Worse than ``other`` by more than the noise."""
        if self.values is None or other.values is None:
            return False
        mine, theirs = self.values.median, other.values.median
        if is_close(mine, reference=theirs, spreads=(self.values, other.values)):
            return False
        return mine < theirs if self.higher else mine > theirs


def recommend(rows: Sequence[PolicyRow], *, epochs: int | None) -> Recommendation:
    """The recommended policy and the sentence that says why (see the module docstring)."""
    finished = [row for row in rows if row.num_runs]
    if not finished:
        return Recommendation(None, "nothing finished",
                              "no recommendation: no run finished", thin=True)
    metric = primary_metric([name for row in finished for name in row.eval])
    errors = tuple(f"{row.policy}: left out: {row.measurement_error}" for row in finished
                   if row.measurement_error)
    reference = next((row for row in finished if row.policy == REFERENCE), None)
    if reference is not None and reference.measurement_error:
        return Recommendation(None, "measurement error", "no recommendation: sync's own "
                              "figures, which every comparison rests on, are a measurement "
                              "error; re-run", thin=True, notes=errors)
    finished = [row for row in finished if not row.measurement_error]
    if not finished:
        return Recommendation(None, "measurement error", "no recommendation: every policy's "
                              "figures are a measurement error; re-run", thin=True,
                              notes=errors)
    if reference is not None and reference.time_to_sync_loss_s is not None:
        advice = _by_time(finished, reference=reference, metric=metric, epochs=epochs)
    else:
        advice = _by_throughput(finished, metric=metric, epochs=epochs)
    if errors:
        left = ", ".join(note.split(":")[0] for note in errors)
        advice = replace(advice, thin=True, text=f"{advice.text}. Left out as measurement "
                         f"errors: {left} (their figures are impossible; re-run)")
    failed = tuple(f"{row.policy}: every run failed" for row in rows if not row.num_runs)
    return replace(advice, notes=errors + advice.notes + failed)


def _by_time(rows: Sequence[PolicyRow], *, reference: PolicyRow, metric: str | None,
             epochs: int | None) -> Recommendation:
    guard = Quality.of(reference, metric=metric)
    notes, candidates = [], [reference]
    for row in (row for row in rows if row is not reference):
        quality = Quality.of(row, metric=metric)
        if quality.worse_than(guard):
            notes.append(f"{row.policy}: {_judged(quality, other=guard)}")
        elif _reached(row) or (metric is not None and row.wall_s is not None):
            candidates.append(row)
        else:
            notes.append(f"{row.policy}: did not reach sync's final loss in half its seeds "
                         f"({row.num_reached}/{row.num_runs})")
    ranked = sorted(candidates, key=_time)
    best, runner_up = ranked[0], (ranked[1] if len(ranked) > 1 else None)
    notes += [_ranked_note(row, reference=reference) for row in ranked[1:]]
    if best is reference:
        text = ("sync: no other policy reached sync's final loss, or its final "
                f"{guard.name}, sooner without a worse final {guard.name}")
    elif not _reached(best):  # as good at its end as sync at its end, in less time
        ratio = _median(reference.time_to_sync_loss_s) / _median(best.wall_s)
        text = (f"{best.policy}: finished {ratio:.1f}x sooner "
                f"({format_seconds(_median(best.wall_s))} vs {_seconds(reference)}) with a "
                f"final {guard.name} no worse than sync's, though its train loss stayed above "
                f"sync's ({_spread(best.final_loss)} vs {_spread(reference.final_loss)}); "
                f"{_judged(Quality.of(best, metric=metric), other=guard)}")
    else:
        ratio = _median(reference.time_to_sync_loss_s) / _median(best.time_to_sync_loss_s)
        text = (f"{best.policy}: reached sync's final loss {ratio:.1f}x sooner "
                f"({_seconds(best)}{_partly(best)} vs {_seconds(reference)}); "
                f"{_judged(Quality.of(best, metric=metric), other=guard)}")
    partly = [f"{best.policy} reached sync's final loss in {best.num_reached} of "
              f"{best.num_runs} seeds"] if _reached(best) and best.num_reached < best.num_runs \
        else []
    close = _thin(best, other=runner_up, spans=_time_spread)
    thin = "; ".join(reason for reason in [*partly, close] if reason)
    return _finish(best.policy, basis="time to sync's final loss", text=text, thin=thin,
                   notes=notes, rows=rows, epochs=epochs)


def _by_throughput(rows: Sequence[PolicyRow], *, metric: str | None,
                   epochs: int | None) -> Recommendation:
    qualities = {row.policy: Quality.of(row, metric=metric) for row in rows}
    known = [q for q in qualities.values() if q.values is not None]
    top = max(known, key=lambda q: _median(q.values) * (1 if q.higher else -1), default=None)
    notes, candidates = [], []
    for row in rows:
        if top is not None and qualities[row.policy].worse_than(top):
            notes.append(f"{row.policy}: {_judged(qualities[row.policy], other=top, label='the best')}")
        elif row.samples_per_s is not None:
            candidates.append(row)
    ranked = sorted(candidates, key=lambda row: -_median(row.samples_per_s))
    if not ranked:
        return _finish(None, basis="nothing finished", text="no recommendation: no run "
                       "measured its samples/s", thin="", notes=notes, rows=rows, epochs=epochs)
    best, runner_up = ranked[0], (ranked[1] if len(ranked) > 1 else None)
    notes += [f"{row.policy}: {_median(row.samples_per_s):,.0f} samples/s" for row in ranked[1:]]
    text = (f"{best.policy}: the most samples/s ({_median(best.samples_per_s):,.0f}) of the "
            f"policies whose final {qualities[best.policy].name} is within the noise of the "
            "best (without sync, time to its final loss is not known)")
    thin = _thin(best, other=runner_up, spans=lambda row: row.samples_per_s)
    return _finish(best.policy, basis="samples/s", text=text, thin=thin, notes=notes, rows=rows,
                   epochs=epochs)


def _finish(policy: str | None, *, basis: str, text: str, thin: str, notes: list[str],
            rows: Sequence[PolicyRow], epochs: int | None) -> Recommendation:
    seeds = max((row.num_runs for row in rows), default=0)
    scope = f"{_count(epochs, 'epoch')} x " if epochs is not None else ""
    text += f"; based on {scope}{_count(seeds, 'seed')} on this machine"
    if thin:
        text += f". Thin evidence: {thin}"
    return Recommendation(policy, basis, text, thin=bool(thin), notes=tuple(notes))


def _thin(best: PolicyRow, *, other: PolicyRow | None,
          spans: Callable[[PolicyRow], Spread | None]) -> str:
    """Why the evidence is thin ("" when it is not): one seed, or the winner's figure too close
    to the runner-up's to tell them apart (their ranges over seeds overlap, or their medians
    are within TIMING_TOLERANCE of each other)."""
    reasons = []
    if best.num_runs < 2 or (other is not None and other.num_runs < 2):
        reasons.append("one seed, so run-to-run noise was not measured (--seeds 3 measures it)")
    mine, theirs = spans(best), spans(other) if other is not None else None
    if other is not None and mine is not None and theirs is not None:
        if mine.low <= theirs.high and theirs.low <= mine.high:
            reasons.append(f"{best.policy}'s and {other.policy}'s ranges over seeds overlap")
        elif abs(mine.median - theirs.median) < TIMING_TOLERANCE * max(mine.median,
                                                                        theirs.median):
            reasons.append(f"{best.policy} and {other.policy} are within "
                           f"{TIMING_TOLERANCE:.0%} of each other")
    return "; ".join(reasons)


def _judged(quality: Quality, *, other: Quality, label: str = "sync") -> str:
    """``final accuracy 0.912 vs sync 0.91 (within the noise, 0.005)`` and the like."""
    text = f"final {quality.name} {_spread(quality.values)} vs {label} {_spread(other.values)}"
    if quality.values is None or other.values is None:
        return text
    noise = tolerance(other.values.median, spreads=(quality.values, other.values))
    if quality.worse_than(other):
        return f"{text}, worse by more than the noise ({noise:.2g})"
    if is_close(quality.values.median, reference=other.values.median,
                spreads=(quality.values, other.values)):
        return f"{text} (within the noise, {noise:.2g})"
    return f"{text} (better)"


def _reached(row: PolicyRow) -> bool:
    """Whether ``row`` reached sync's final loss in at least half its seeds."""
    return row.time_to_sync_loss_s is not None and 2 * row.num_reached >= row.num_runs


def _time_spread(row: PolicyRow) -> Spread | None:
    """What a candidate is ranked by: its time to sync's final loss, or, when its train loss
    stayed above sync's but its final eval metric is no worse, its whole training time."""
    return row.time_to_sync_loss_s if _reached(row) else row.wall_s


def _time(row: PolicyRow) -> float:
    return _median(_time_spread(row))


def _ranked_note(row: PolicyRow, *, reference: PolicyRow) -> str:
    if row is reference:
        return f"sync: {_seconds(row)} to its own final loss"
    if _reached(row):
        return f"{row.policy}: reached sync's final loss in {_seconds(row)}{_partly(row)}"
    return (f"{row.policy}: finished in {format_seconds(_time(row))} with a final metric no "
            "worse than sync's, its train loss above sync's")


def _spread(value: Spread | None) -> str:
    return "-" if value is None else f"{value.median:.4g}"


def _median(value: Spread | None) -> float:
    return math.inf if value is None else value.median


def _partly(row: PolicyRow) -> str:
    """`` in 1 of 2 seeds`` when not every seed of ``row`` reached sync's loss."""
    return f" in {row.num_reached} of {row.num_runs} seeds" if row.num_reached < row.num_runs \
        else ""


def _seconds(row: PolicyRow) -> str:
    value = row.time_to_sync_loss_s
    return "-" if value is None else format_seconds(value.median)


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"
