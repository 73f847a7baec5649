"""The three policies (and auto, which picks one) as objects: what each one does at a round
boundary, in one place.

The name from the settings (``--policy async``) is looked up once, where the engine's config is
made (:func:`policy_named`); from there the policy travels as this object, and the round loop
(:mod:`fdl.engine.rounds`), the planner (:mod:`fdl.engine.plan`), recovery and the simulator
(:mod:`fdl.engine.simulator`) ask it instead of comparing its name::

    policy = policy_named("async")
    policy.local_steps            # ranks run planned counts of local steps between averages
    policy.blocking(plan, checkpoint_due=False, ends_run=False)  # wait for the average here?

* ``sync``: one gradient all-reduce per step (``syncs_gradients``: DDP's in fdl.Trainer, the
  hook reducer in a loop script); every round is one step per rank; buffers (BatchNorm
  statistics) are averaged at epoch ends.
* ``cadence``: planned local steps, then a blocking average of parameters and buffers; its
  rounds (and async's) are elastic: the fastest rank runs until the slowest is done.
* ``async``: the average of round k runs in the background while round k+1 computes; at the
  next boundary the rank applies ``theta += avg_k - snapshot_k``. It runs through epoch ends:
  the epoch's evaluation and record wait for its average to land and see that consensus
  (fdl.engine.rounds). It blocks only where one model on every rank is needed at once: the
  calibration round (its cost tunes the anchor), the run's last round (the final model) and a
  round after which a checkpoint is due.
* ``auto``: cadence until it has judged the link (fdl.engine.plan.auto_choice), then the policy
  :func:`choose_policy` picks from what was measured (every rank holds the same figures, so
  every rank picks alike): sync for equal speeds and a cheap all-reduce, async when an average
  costs more than the overhead target even at the largest anchor, cadence otherwise.

Pure: no torch, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from fdl.settings import POLICIES, POLICY_CHOICES


class _Round(Protocol):
    round_index: int
    last_in_epoch: bool
    calibration: bool


@dataclass(frozen=True)
class Policy:
    name: str
    local_steps: bool  # False: one gradient-synced step per rank per round (sync)
    background: bool  # the average runs while the next round computes (async)
    # The fastest rank runs until the slowest has finished its share (fdl.engine.plan): speed
    # noise does not become waiting.
    elastic: bool = True

    def __str__(self) -> str:
        return self.name

    @property
    def decides(self) -> bool:
        """auto: runs as cadence until :func:`choose_policy` has picked the run's policy."""
        return self.name == "auto"

    @property
    def syncs_gradients(self) -> bool:
        """Every step's gradients are all-reduced (fdl.engine.grad_sync): sync."""
        return not self.local_steps

    @property
    def averages_params(self) -> bool:
        """sync keeps parameters identical through DDP: re-averaging them could change their
        last bits, so only buffers are averaged."""
        return self.local_steps

    def averages_at(self, plan: _Round) -> bool:
        """Whether the boundary after ``plan`` averages at all (sync: only at epoch ends)."""
        return self.local_steps or plan.last_in_epoch

    def blocking(self, plan: _Round, *, checkpoint_due: bool, ends_run: bool) -> bool:
        """Whether the average after ``plan`` completes before the next round starts
        (``ends_run``: ``plan`` is the run's last round)."""
        if not self.background:
            return True
        return plan.calibration or ends_run or checkpoint_due


SYNC = Policy("sync", local_steps=False, background=False, elastic=False)
CADENCE = Policy("cadence", local_steps=True, background=False)
ASYNC = Policy("async", local_steps=True, background=True)
AUTO = Policy("auto", local_steps=True, background=False)  # cadence's rounds until it chooses
_BY_NAME = {policy.name: policy for policy in (SYNC, CADENCE, ASYNC, AUTO)}
assert tuple(_BY_NAME) == POLICY_CHOICES and POLICY_CHOICES[:3] == POLICIES

# auto's rule. Speeds within SAME_SPEED of each other are equal: nothing for cadence to
# balance. DDP overlaps its gradient all-reduce with the backward pass; DDP_EXPOSED of it is
# left on the step (the simulator's model of sync, fdl.engine.simulator).
SAME_SPEED = 0.05
DDP_EXPOSED = 0.3
_TOLERANCE = 1e-9  # float noise at a boundary (1.05 / 1.0 - 1 is 0.05000000000000004)


@dataclass(frozen=True)
class PolicyChoice:
    """What ``auto`` chose and from what: the ranks' speed spread (slowest / fastest - 1), the
    measured average (ms), what it would cost of a round at the largest anchor and of a step
    under sync (its exposed all-reduce), and the reason in words."""

    policy: Policy
    reason: str
    spread: float
    average_ms: float
    overhead_at_max_anchor: float
    sync_step_overhead: float

    def to_dict(self) -> dict[str, object]:
        return {"chosen": self.policy.name, "reason": self.reason,
                "speed_spread": round(self.spread, 6), "average_ms": round(self.average_ms, 6),
                "overhead_at_max_anchor": round(self.overhead_at_max_anchor, 6),
                "sync_step_overhead": round(self.sync_step_overhead, 6)}


def choose_policy(*, ms_per_sample: Sequence[float], average_ms: float, batch_size: int,
                  overhead_target: float, max_anchor: int) -> PolicyChoice:
    """``auto``'s choice from the calibrated speeds (ms per sample, one per rank) and the
    measured cost of one average (``average_ms``; a gradient all-reduce moves as many bytes):

    * an average costs more than ``overhead_target`` of a round even at ``max_anchor`` steps
      of the slowest rank (a slow link) -> ``async``, which overlaps it with the next round;
    * speeds within ``SAME_SPEED`` and sync's exposed all-reduce (``DDP_EXPOSED`` of an
      average per step) within ``overhead_target`` of a step -> ``sync``: plain DDP, nothing
      to balance and nothing to save;
    * otherwise ``cadence``: the fast ranks do more work between blocking averages.
    """
    if len(ms_per_sample) < 1 or not all(math.isfinite(m) and m > 0 for m in ms_per_sample) \
            or not (math.isfinite(average_ms) and average_ms >= 0):
        raise ValueError(f"choose_policy: speeds {list(ms_per_sample)} and average "
                         f"{average_ms} ms must be finite, speeds > 0")
    slow, fast = max(ms_per_sample), min(ms_per_sample)
    step_ms = batch_size * slow
    spread = slow / fast - 1
    at_max = average_ms / (max_anchor * step_ms)
    per_step = DDP_EXPOSED * average_ms / step_ms
    figures = (spread, average_ms, at_max, per_step)
    if at_max > overhead_target + _TOLERANCE:
        return PolicyChoice(ASYNC, f"an average takes {average_ms:.1f} ms, {at_max:.1%} of a "
                                   f"round even at {max_anchor} steps (target "
                                   f"{overhead_target:.0%}): async overlaps it with the next "
                                   "round", *figures)
    same = spread <= SAME_SPEED + _TOLERANCE
    if same and per_step <= overhead_target + _TOLERANCE:
        return PolicyChoice(SYNC, f"speeds within {spread:.1%} of each other and a gradient "
                                  f"all-reduce costs ~{per_step:.1%} of a step: sync, plain "
                                  "DDP, has nothing to balance", *figures)
    if same:
        return PolicyChoice(CADENCE, f"speeds within {spread:.1%} of each other, but a gradient "
                                     f"all-reduce would cost ~{per_step:.1%} of every step: "
                                     "cadence averages every few steps", *figures)
    return PolicyChoice(CADENCE, f"the slowest rank needs {spread + 1:.2f}x the fastest's time "
                                 "per sample: cadence gives the fast ones more work", *figures)


def policy_named(name: str | Policy) -> Policy:
    """The policy called ``name`` (one of fdl.settings.POLICY_CHOICES; a Policy is returned as
    it is); a ValueError naming the allowed ones otherwise."""
    if isinstance(name, Policy):
        return name
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown policy {name!r}; expected one of "
                         f"{', '.join(POLICY_CHOICES)}") \
            from None
