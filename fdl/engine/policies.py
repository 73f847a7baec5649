"""The three policies as objects: what each one does at a round boundary, in one place.

The name from the settings (``--policy async``) is looked up once, where the engine's config is
made (:func:`policy_named`); from there the policy travels as this object, and the round loop
(:mod:`fdl.engine.rounds`), the planner (:mod:`fdl.engine.plan`), recovery and the simulator
(:mod:`fdl.engine.simulator`) ask it instead of comparing its name::

    policy = policy_named("async")
    policy.local_steps            # ranks run planned counts of local steps between averages
    policy.blocking(plan, checkpoint_due=False)   # does this boundary wait for the average?

* ``sync``: one gradient all-reduce per step through DDP (``wraps_ddp``); every round is one
  step per rank; buffers (BatchNorm statistics) are averaged at epoch ends.
* ``cadence``: planned local steps, then a blocking average of parameters and buffers; its
  rounds (and async's) are elastic: the fastest rank runs until the slowest is done.
* ``async``: the average of round k runs in the background while round k+1 computes; at the
  next boundary the rank applies ``theta += avg_k - snapshot_k``. It blocks only where one
  model on every rank is needed: the calibration round (its cost tunes the anchor), the last
  round of an epoch (evaluation, the epoch's loss, the final model) and a round after which a
  checkpoint is due.

Pure: no torch, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from fdl.settings import POLICIES


class _Round(Protocol):
    round_index: int
    last_in_epoch: bool
    calibration: bool


@dataclass(frozen=True)
class Policy:
    name: str
    local_steps: bool  # False: one DDP step per rank per round (sync)
    background: bool  # the average runs while the next round computes (async)
    # The fastest rank runs until the slowest has finished its share (fdl.engine.plan): speed
    # noise no longer becomes waiting.
    elastic: bool = True

    def __str__(self) -> str:
        return self.name

    @property
    def wraps_ddp(self) -> bool:
        return not self.local_steps

    @property
    def averages_params(self) -> bool:
        """sync keeps parameters identical through DDP: re-averaging them could change their
        last bits, so only buffers are averaged."""
        return self.local_steps

    def averages_at(self, plan: _Round) -> bool:
        """Whether the boundary after ``plan`` averages at all (sync: only at epoch ends)."""
        return self.local_steps or plan.last_in_epoch

    def blocking(self, plan: _Round, *, checkpoint_due: bool) -> bool:
        """Whether the average after ``plan`` completes before the next round starts."""
        if not self.background:
            return True
        return plan.calibration or plan.last_in_epoch or checkpoint_due


SYNC = Policy("sync", local_steps=False, background=False, elastic=False)
CADENCE = Policy("cadence", local_steps=True, background=False)
ASYNC = Policy("async", local_steps=True, background=True)
_BY_NAME = {policy.name: policy for policy in (SYNC, CADENCE, ASYNC)}
assert tuple(_BY_NAME) == POLICIES


def policy_named(name: str | Policy) -> Policy:
    """The policy called ``name`` (one of fdl.settings.POLICIES; a Policy is returned as it
    is); a ValueError naming the allowed ones otherwise."""
    if isinstance(name, Policy):
        return name
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICIES)}") \
            from None
