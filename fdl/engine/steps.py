"""What the engine sees of the user's step without owning it: the optimizer steps it takes
(:class:`StepWatch`) and the scalars it logs (:class:`Logged`).

A round of El Che must end on an optimizer step, never between the batches of one: averaging
replicas halfway through an accumulated gradient would average models that have not taken the
step their batches were for. ``run.batches(..., accumulate=k)`` yields k batches per step, and
after each one the watch checks the optimizer stepped exactly after the k-th. It counts
``optimizer.step()`` through the optimizer's public step hook and, under fp16, the
``GradScaler.update()`` of ``run.scaler`` (a step the scaler skipped for an inf gradient still
ends the step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from fdl.errors import UsageError


@dataclass
class StepWatch:
    """Whether the optimizer stepped since the last check."""

    stepped: int = 0
    _handles: list[Any] = field(default_factory=list, repr=False)

    @classmethod
    def on(cls, optimizer: torch.optim.Optimizer) -> StepWatch:
        watch = cls()
        watch._handles.append(optimizer.register_step_post_hook(watch._count))
        return watch

    def _count(self, *_: Any) -> None:
        self.stepped += 1

    def step_ended(self) -> None:
        """A step that ended without ``optimizer.step()`` (fp16: the scaler skipped it)."""
        self.stepped = max(self.stepped, 1)

    def check(self, *, after: int, of: int) -> None:
        """After batch ``after`` of a step of ``of`` batches: the optimizer must have stepped
        once after the last batch and not before."""
        stepped, self.stepped = self.stepped, 0
        if after < of and stepped:
            raise UsageError(f"the optimizer stepped after batch {after} of a step of {of} "
                             f"(run.batches(..., accumulate={of}))",
                             hint=f"step every {of} batches, or pass accumulate={after}")
        if after == of and not stepped:
            raise UsageError(f"the optimizer did not step after {of} batch(es) from "
                             f"run.batches(..., accumulate={of}): a round of El Che ends on an "
                             "optimizer step",
                             hint="call optimizer.step() after every batch, or pass "
                                  "accumulate=k when the loop steps every k batches")

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class CountingScaler(torch.amp.GradScaler):
    """``run.scaler`` of an fp16 rank: torch's GradScaler, whose ``update()`` (once per step,
    after ``scaler.step``) also ends the step for the watch, since a step the scaler skipped
    for an inf gradient never reaches ``optimizer.step()``."""

    watch: StepWatch | None = None

    def update(self, new_scale: Any = None) -> None:
        super().update(new_scale)
        if self.watch is not None:
            self.watch.step_ended()


@dataclass
class Logged:
    """``run.log``'s scalars: each summed where it lives (a tensor stays on its device, so a
    step never waits for the GPU to read it) and read once per round as the round's means."""

    sums: dict[str, Any] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise UsageError(f"run.log({name}=...) takes a number or a one-element tensor, "
                                 f"got a tensor of shape {tuple(value.shape)}")
            value = value.detach().reshape(()).to(torch.float64)
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UsageError(f"run.log({name}=...) takes a number or a one-element tensor, "
                             f"got {type(value).__name__}")
        else:
            value = float(value)
        self.sums[name] = self.sums[name] + value if name in self.sums else value
        self.counts[name] = self.counts.get(name, 0) + 1

    def read(self) -> dict[str, float]:
        """Each scalar's mean since the last read (one wait for the device), and start over."""
        means = {name: float(total) / self.counts[name] for name, total in self.sums.items()}
        self.sums, self.counts = {}, {}
        return means
