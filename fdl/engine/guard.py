"""The divergence guard: when the replicas drift apart far more than training normally makes
them, fewer local steps per round (a halved anchor) pull them back together.

At each average every rank reports ``||snapshot_r - average|| / ||average||``. Normal local
training makes that distance grow with the learning rate and the steps between averages, so the
guard judges ``x = distance / (lr_scale * steps)`` (``lr_scale`` the schedule's multiplier,
``steps`` the slowest rank's batches in the round) against the run's own usual level: the mean
of ``x`` over its first :data:`BASELINE_ROUNDS` measured averages, then following every calm
round (at most half the threshold) with weight :data:`BASELINE_ALPHA`, except while a halving is
held (then it stays the level from before the drift, so a lasting divergence is never learnt as
usual). A round with ``x`` above ``threshold`` times that level (or a NaN / infinite distance: a
replica blew up) extends a streak; the third in a row halves the anchor and sets the plan's
ceiling to it, so the anchor tuner cannot grow it back (a tuner left free undoes a halving
within a round; and a fixed threshold on the raw distance is far from what real runs reach,
hence ``x`` and the run's own level). The ceiling is lifted after :data:`RELEASE_ROUNDS`
averages in a row below ``threshold / 2`` times the level.

Why the level follows normal rounds, and why the default threshold is 16: the drift per step is
not a constant of a run. It rises several-fold within a round when a model leaves a plateau and
starts learning, and stays there; a guard that judged against the first rounds with a low
threshold then halved the anchor down to 1 and held it there (drift is sublinear in steps, so
every halving raised ``x``), averaging several times as often and ending no more accurate than
the fast device alone. A blow-up is another order again (tests/engine/test_divergence_run.py
scales the loss to make one). The GPU run and the test's readings that set these are in
docs/elche.md "Divergence guard".

Every rank sees the same reports, so every rank decides alike. Pure: the state is a
:class:`~fdl.engine.state.GuardState` that checkpoints carry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fdl.engine.plan import PlanState, halve_anchor, with_ceiling
from fdl.engine.state import GuardState

BASELINE_ROUNDS = 5
BASELINE_ALPHA = 0.2  # how much a normal round moves the usual level once it is learnt
STREAK = 3
RELEASE_ROUNDS = 20


@dataclass(frozen=True)
class Verdict:
    level: float  # x / baseline (NaN while the baseline is being learnt)
    streak: int
    halved: bool = False
    released: bool = False


def observe(guard: GuardState, state: PlanState, *, distance: float, lr_scale: float,
            steps: int, threshold: float) -> tuple[PlanState, Verdict]:
    """Fold one average's largest replica ``distance`` into ``guard`` (updated in place) and
    return the plan state with the guard's action applied, and what it saw."""
    diverged = not math.isfinite(distance)
    x = distance / max(lr_scale * steps, 1e-12) if not diverged else math.inf
    if guard.baseline_rounds < BASELINE_ROUNDS and not diverged:
        guard.baseline_sum += x
        guard.baseline_rounds += 1
        return state, Verdict(math.nan, 0)
    baseline = guard.baseline_sum / max(guard.baseline_rounds, 1)
    level = x / baseline if baseline > 0 else (math.inf if x > 0 else 0.0)
    guard.streak = guard.streak + 1 if level > threshold else 0
    if level <= threshold / 2 and state.ceiling is None:
        # A calm round while nothing is held down: the usual level follows it (the sum stays
        # BASELINE_ROUNDS times the level, so checkpoints keep the same two numbers). While
        # the guard holds a halved anchor, the level stays what it was before the drift.
        guard.baseline_sum += BASELINE_ALPHA * (x - baseline) * guard.baseline_rounds
    if guard.streak >= STREAK:
        guard.streak, guard.calm = 0, 0
        reason = f"divergence guard: replica drift {level:.3g}x its usual level for {STREAK} rounds"
        return halve_anchor(state, reason=reason), Verdict(level, STREAK, halved=True)
    guard.calm = guard.calm + 1 if level < threshold / 2 else 0
    if state.ceiling is not None and guard.calm >= RELEASE_ROUNDS:
        guard.calm = 0
        return with_ceiling(state, None), Verdict(level, guard.streak, released=True)
    return state, Verdict(level, guard.streak)
