"""Step timing and slowdown emulation.

``--simulate-slowdown 1,2.5`` (``FDL_SLOWDOWN``) makes rank r sleep ``(f_r - 1) x`` its measured
step time after each step, so a CPU box behaves like two devices 2.5x apart: the planner sees
the slow rank as slow (its sleep counts in its step time) and gives the fast one more work.
The step time slept on is the rank's running mean over the run, not the last step's: sleeping
on the last step would multiply the host's own timing noise by ``f - 1`` (a real slower device
does not amplify its host's noise). Summaries mark emulated runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class StepTimer:
    """Times optimizer steps (compute plus emulated slowdown) for one round.

    ``clock`` and ``sleep`` are ``time.perf_counter`` and ``time.sleep``; a test passes a fake
    pair to check the figures on a known sequence of step times."""

    slowdown: float = 1.0
    steps: int = 0
    busy_s: float = 0.0  # compute + emulated sleep
    sleep_s: float = 0.0
    mean: RunningMean | None = None  # the rank's compute time per step, shared across rounds
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False)
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)
    _start: float = field(default=0.0, repr=False)

    def start(self) -> None:
        self._start = self.clock()

    def stop(self, *, sync_device: object = None) -> None:
        """End a step; ``sync_device`` (a torch.device) waits for queued GPU work first."""
        if sync_device is not None and getattr(sync_device, "type", "") == "cuda":
            import torch

            torch.cuda.synchronize(sync_device)
        elapsed = self.clock() - self._start
        if self.mean is not None:
            self.mean.add(elapsed)
        extra = (self.mean.value if self.mean is not None else elapsed) * (self.slowdown - 1.0)
        if extra > 0:
            self.sleep(extra)
            self.sleep_s += extra
        self.busy_s += elapsed + max(extra, 0.0)
        self.steps += 1

    @property
    def step_ms(self) -> float:
        return self.busy_s * 1000 / self.steps if self.steps else float("nan")


@dataclass
class RunningMean:
    """The mean of every value added so far."""

    count: int = 0
    total: float = 0.0

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value

    @property
    def value(self) -> float:
        return self.total / self.count if self.count else 0.0
