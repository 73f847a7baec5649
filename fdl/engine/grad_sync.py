"""Sync's gradient all-reduce as the round loop sees it: one protocol, three implementations.

Under ``--policy sync`` every step's gradients are averaged over the ranks before the optimizer
steps, as plain DDP does. Who does it depends on who calls the model:

* :class:`fdl.engine.ddp_sync.DdpSync` for ``fdl.Trainer``, which calls the model through
  DDP's wrapper (its C++ reducer; under the slowdown emulation through a timed communication
  hook);
* :class:`fdl.engine.hook_sync.HookSync` for a loop script, which calls its own model: DDP's
  bucketed all-reduce done with public autograd hooks;
* :class:`NoGradSync` for every other case (cadence, async, a rank alone): the step calls the
  model and nothing is reduced.

The round loop (fdl.engine.rounds) talks to whichever it has through :class:`GradSync` only, so
it has one path for every step and one for a round some ranks have fewer steps in (an epoch's
last round under sync, whose batches do not split evenly): :meth:`GradSync.uneven` around the
rank's steps, :meth:`GradSync.before_step` before each. A step's exposed communication is timed
through the same object (the step timer's ``CommClock``: fdl.engine.speed).

Micro-batches (``--micro-batch``) work under each: :meth:`GradSync.parts` returns the parts of a
batch so that only the last part's backward reduces (DDP's ``no_sync`` around the others; the
hook reducer held back until the last).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Protocol

from torch import nn

from fdl.engine.speed import StepComm


class GradSync(Protocol):
    """What a step needs of sync's gradient all-reduce (see the module docstring)."""

    step_model: nn.Module  # what the step calls: DDP's wrapper, or the model itself

    def begin_step(self) -> None:
        """A step starts (its communication is timed from here)."""

    def end_step(self) -> StepComm:
        """A step ended: its exposed communication (None: none)."""

    def before_step(self, *, ranks_with_data: int) -> None:
        """The next step's gradients are the mean over ``ranks_with_data`` ranks."""

    def last_batch(self) -> None:
        """The next backward is the step's last: its gradients are reduced."""

    def empty_step(self) -> None:
        """A planned step of this rank that has no samples: join the others' reduction."""

    def uneven(self, steps: Sequence[int], *, rank: int) -> contextlib.AbstractContextManager:
        """Around a rank's steps of a round in which rank r takes ``steps[r]`` steps: a rank
        with fewer joins the others' remaining reductions and ends with their model."""

    def parts(self, parts: list[tuple[Any, float]]) -> list[tuple[Any, float]]:
        """A batch's micro-batches, iterated so that only the last part's backward reduces."""

    def close(self) -> None:
        """Training is over: hooks removed, DDP's wrapper dropped (before the group goes)."""


class NoGradSync:
    """No gradient all-reduce: the step calls the model itself (cadence, async, alone)."""

    def __init__(self, model: nn.Module) -> None:
        self.step_model = model

    def begin_step(self) -> None:
        return None

    def end_step(self) -> StepComm:
        return None

    def before_step(self, *, ranks_with_data: int) -> None:
        return None

    def last_batch(self) -> None:
        return None

    def empty_step(self) -> None:
        return None

    def uneven(self, steps: Sequence[int], *, rank: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def parts(self, parts: list[tuple[Any, float]]) -> list[tuple[Any, float]]:
        return parts

    def close(self) -> None:
        return None
