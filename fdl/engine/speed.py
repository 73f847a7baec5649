"""Step timing and slowdown emulation.

A step is timed whole, as the round loop calls it: ``start()`` before the batch is fetched,
collated and copied to the device and the learning rate set, ``stop()`` after the optimizer
step. Host work the planner never saw would make a rank look faster than it is.

**On CUDA the timer records events; it never calls ``torch.cuda.synchronize``.** A device-wide
synchronize waits for every stream of the device, NCCL's included: the average that async
launches at a round boundary would block the next round's first step on the host, and that wait
would be booked as compute and fed to the planner as a slower rank. Instead ``start()`` and
``stop()`` record a timing event on the current (compute) stream and return at once, so the host
keeps queueing work ahead of the GPU. ``finish()``, called once at the end of the round,
waits for the round's last ``stop`` event only (``Event.synchronize`` waits for the compute
stream up to that point, not for NCCL's stream) and reads each step's elapsed time.

The round's time is the sum of its steps' event intervals, not the interval from the first
``start`` event to the last ``stop`` event: the span would also count what the stream does
between steps (the idle GPU while a slow rank sleeps, which ``sleep_s`` already counts, and any
bookkeeping the loop queues between steps). When steps follow each other, one step's ``stop``
event and the next one's ``start`` event complete back to back, so the sum matches the wall time
of the round (tests/engine/test_gpu.py checks it on a GPU). A step whose host work is slower than
its kernels shows as such: its ``start`` event completes on an idle stream before the host has
queued the kernels.

``--simulate-slowdown 1,2.5`` (``FDL_SLOWDOWN``) makes rank r sleep ``(f_r - 1) x`` its measured
step time after each step, so a CPU box behaves like two devices 2.5x apart: the planner sees
the slow rank as slow (its sleep counts in its step time) and gives the fast one more work.
The step time slept on is the rank's running mean over the run, not the last step's: sleeping
on the last step would multiply the host's own timing noise by ``f - 1`` (a real slower device
does not amplify its host's noise). Emulation needs each step's time when it ends, so on CUDA a
timer with ``slowdown > 1`` waits for that step's ``stop`` event (again the compute stream only)
before it sleeps. Summaries mark emulated runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class StepTimer:
    """Times one round's steps (compute plus emulated slowdown) on one device.

    ``device`` None or a CPU device: steps are timed with ``clock`` (``time.perf_counter``; a
    test passes a fake one with a matching ``sleep``) and every figure is current after each
    ``stop()``. A CUDA device: steps are timed with CUDA events on the current stream, and
    ``busy_s``, ``step_ms`` and ``step_times_s`` are complete only after ``finish()``.
    ``mean`` is the rank's compute time per step, shared by all of its rounds' timers (and
    checkpointed): the emulated sleep follows it."""

    slowdown: float = 1.0
    mean: RunningMean | None = None
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False)
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)
    device: torch.device | None = None
    steps: int = field(default=0, init=False)
    sleep_s: float = field(default=0.0, init=False)
    step_times_s: list[float] = field(default_factory=list, init=False)  # compute, step by step
    _cuda: bool = field(default=False, init=False, repr=False)
    _compute_s: float = field(default=0.0, init=False, repr=False)
    _started: float = field(default=0.0, init=False, repr=False)
    _start_event: torch.cuda.Event | None = field(default=None, init=False, repr=False)
    _pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(
        default_factory=list, init=False, repr=False)  # CUDA steps whose time is not read yet

    def __post_init__(self) -> None:
        self._cuda = self.device is not None and torch.device(self.device).type == "cuda"

    def start(self) -> None:
        """Begin a step: before its batch is fetched."""
        if self._cuda:
            self._start_event = self._record()
        else:
            self._started = self.clock()

    def stop(self) -> None:
        """End a step: after its optimizer step. On CUDA this returns without waiting for the
        GPU unless the timer emulates a slowdown."""
        self.steps += 1
        if not self._cuda:
            self._account(self.clock() - self._started)
            self._emulate_slowdown()
            return
        assert self._start_event is not None, "StepTimer.stop() without start()"
        end = self._record()
        self._pending.append((self._start_event, end))
        self._start_event = None
        if self.slowdown > 1.0:
            end.synchronize()  # this step's kernels only: not NCCL's stream, not the device
            self._read_pending()
            self._emulate_slowdown()

    def finish(self) -> None:
        """End the round: wait for its last step's ``stop`` event and read every step's time.
        A no-op on the CPU, where each step was read when it stopped; safe to call twice."""
        if self._pending:
            self._pending[-1][1].synchronize()
            self._read_pending()

    @property
    def busy_s(self) -> float:
        """Compute plus emulated sleep over the round's steps, in seconds."""
        assert not self._pending, "StepTimer: call finish() before reading CUDA step times"
        return self._compute_s + self.sleep_s

    @property
    def step_ms(self) -> float:
        """Mean busy milliseconds per step (NaN before the first step)."""
        return self.busy_s * 1000 / self.steps if self.steps else float("nan")

    def _record(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _read_pending(self) -> None:
        """Book the steps whose events have completed (the caller waited for the last one)."""
        for start, end in self._pending:
            self._account(start.elapsed_time(end) / 1000)
        self._pending.clear()

    def _account(self, elapsed: float) -> None:
        self.step_times_s.append(elapsed)
        self._compute_s += elapsed
        if self.mean is not None:
            self.mean.add(elapsed)

    def _emulate_slowdown(self) -> None:
        """Sleep ``(slowdown - 1) x`` the rank's mean step time (this step's without a mean)."""
        base = self.mean.value if self.mean is not None else self.step_times_s[-1]
        extra = base * (self.slowdown - 1.0)
        if extra > 0:
            self.sleep(extra)
            self.sleep_s += extra


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
