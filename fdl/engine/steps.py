"""What the engine sees of the user's step without owning it: the optimizer steps it takes
(:class:`StepWatch`) and the scalars it logs (:class:`Logged`).

A round of El Che must end on an optimizer step, never between the batches of one: averaging
replicas halfway through an accumulated gradient would average models that have not taken the
step their batches were for. ``run.batches(..., accumulate=k)`` yields k batches per step, and
after each one the watch checks the optimizer stepped exactly after the k-th. It counts
``optimizer.step()`` through the optimizer's public step hook and, under fp16, the
``GradScaler.update()`` of ``run.scaler`` (a step the scaler skipped for an inf gradient still
ends the step).

A torch LR scheduler handed to ``run.batches(..., scheduler=...)`` is stepped by the engine
(:class:`DrivenScheduler`): a rank's own ``scheduler.step()`` per optimizer step would run
ahead on the fast rank under cadence and async.
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
class DrivenScheduler:
    """A torch LR scheduler that the engine steps once per global step of the run
    (``world_size x batch_size x accumulate`` samples, as ``max_steps`` and a plain DDP script
    count them), however each rank's own steps fall: before each of a rank's steps it is
    stepped until it has counted the global steps before that step's position (the rank's
    estimate within a round), and at each round's end to the round's end, which every rank
    knows alike (so checkpoints and the run's end hold the same count everywhere). Under
    sync that is once per step, as a DDP script's ``scheduler.step()`` after
    ``optimizer.step()``; under cadence and async the fast rank's steps each cover less of
    the run and the slow rank's more. The count never goes back (a rank whose estimate ran
    ahead of a round's real end waits for the run to catch up)."""

    scheduler: Any
    samples_per_step: int  # one global step's samples
    _count: int | None = None  # scheduler.last_epoch as the engine left it (None: not yet)

    @classmethod
    def of(cls, scheduler: Any, optimizer: torch.optim.Optimizer, *,
           samples_per_step: int) -> DrivenScheduler:
        """``scheduler`` checked: a torch LR scheduler stepped per step, made on
        ``optimizer``."""
        from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

        if isinstance(scheduler, ReduceLROnPlateau) or not isinstance(scheduler, LRScheduler):
            raise UsageError(
                f"run.batches(..., scheduler=) takes a torch LR scheduler stepped once per "
                f"step (torch.optim.lr_scheduler.LRScheduler), got {type(scheduler).__name__}",
                hint="step ReduceLROnPlateau on a metric at epoch ends (run.at_epoch_end); "
                     "for a schedule of your own, set the LR from run.progress")
        if scheduler.optimizer is not optimizer:
            raise UsageError("the scheduler given to run.batches(..., scheduler=) was made on "
                             "another optimizer than the one given with optimizer=",
                             hint="make the scheduler on the optimizer the loop steps")
        return cls(scheduler, samples_per_step)

    def advance(self, position: float) -> None:
        """Before a step at ``position`` (the run's samples done, as this rank estimates)."""
        scheduler = self.scheduler
        if self._count is not None and scheduler.last_epoch != self._count:
            raise UsageError("scheduler.step() was called by the script, and the engine steps "
                             "the scheduler given to run.batches(..., scheduler=): it would "
                             "count each step twice",
                             hint="remove the script's scheduler.step() call")
        target = int(position // self.samples_per_step)
        while (step := scheduler.last_epoch + 1) <= target:
            try:
                scheduler.step()
            except ValueError as exc:  # OneCycleLR past its total_steps
                raise UsageError(f"the scheduler given to run.batches(..., scheduler=) refused "
                                 f"global step {step}: {exc}",
                                 hint="size it with run.total_steps(data, batch_size=..., "
                                      "epochs=...), which applies fdl run's --epochs and "
                                      "budgets") from None
        self._count = scheduler.last_epoch


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
