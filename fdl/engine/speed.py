"""Step timing and slowdown emulation.

``--simulate-slowdown 1,2.5`` (``FDL_SLOWDOWN``) makes rank r sleep ``(f_r - 1) x`` its measured
step time after each step, so a CPU box behaves like two devices 2.5x apart: the planner sees
the slow rank as slow (its sleep counts in its step time) and gives the fast one more work.
Summaries mark emulated runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class StepTimer:
    """Times optimizer steps (compute plus emulated slowdown) for one round."""

    slowdown: float = 1.0
    steps: int = 0
    busy_s: float = 0.0  # compute + emulated sleep
    sleep_s: float = 0.0
    _start: float = field(default=0.0, repr=False)

    def start(self) -> None:
        self._start = time.perf_counter()

    def stop(self, *, sync_device: object = None) -> None:
        """End a step; ``sync_device`` (a torch.device) waits for queued GPU work first."""
        if sync_device is not None and getattr(sync_device, "type", "") == "cuda":
            import torch

            torch.cuda.synchronize(sync_device)
        elapsed = time.perf_counter() - self._start
        extra = elapsed * (self.slowdown - 1.0)
        if extra > 0:
            time.sleep(extra)
            self.sleep_s += extra
        self.busy_s += elapsed + max(extra, 0.0)
        self.steps += 1

    @property
    def step_ms(self) -> float:
        return self.busy_s * 1000 / self.steps if self.steps else float("nan")
