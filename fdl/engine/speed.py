"""Step timing and slowdown emulation.

A step is timed whole, as the round loop calls it: ``start()`` before the batch is fetched,
collated and copied to the device and the learning rate set, ``stop()`` after the optimizer
step. Host work the planner never saw would make a rank look faster than it is. What the step
spent in communication — under ``sync``, DDP's gradient all-reduce inside ``backward()`` and
the wait for the peers in it, timed by :class:`fdl.engine.ddp_sync.DdpCommMeter` — is taken
out of the step's compute and kept apart (``comm_s``): it is sync, not compute, in the
timeline, in ``fdl report`` and for the slowdown emulation.

**On CUDA the timer records events; it never calls ``torch.cuda.synchronize``.** A device-wide
synchronize waits for every stream of the device, NCCL's included: the average that async
launches at a round boundary would block the next round's first step on the host, and that wait
would be booked as compute and fed to the planner as a slower rank. Instead ``start()`` and
``stop()`` record a timing event on the current (compute) stream and return at once, so the host
keeps queueing work ahead of the GPU. ``finish()``, called once at the end of the round,
waits for the round's last ``stop`` event only (``Event.synchronize`` waits for the compute
stream up to that point, not for NCCL's stream) and reads each step's elapsed time. A step's
communication comes as a pair of events too (the last gradient bucket ready on the compute
stream, its all-reduce done), read at the same time: DDP makes the compute stream wait for the
all-reduce before the optimizer step, so both have completed when the step's ``stop`` has.

The round's time is the sum of its steps' event intervals, not the interval from the first
``start`` event to the last ``stop`` event: the span would also count what the stream does
between steps (the idle GPU while a slow rank sleeps, which ``sleep_s`` already counts, and any
bookkeeping the loop queues between steps). When steps follow each other, one step's ``stop``
event and the next one's ``start`` event complete back to back, so the sum matches the wall time
of the round (tests/engine/test_gpu.py checks it on a GPU). A step whose host work is slower than
its kernels shows as such: its ``start`` event completes on an idle stream before the host has
queued the kernels.

**Slowdown emulation.** ``--simulate-slowdown 1,2.5`` (``FDL_SLOWDOWN``) makes rank r sleep
``(f_r - 1) x`` its compute per step after each step, so a CPU box behaves like two devices 2.5x
apart: the planner sees the slow rank as slow (its sleep counts in its busy time) and gives the
fast one more work. What is multiplied is the rank's own compute only — never the step's
communication or its wait for a peer, which a slower device would not make slower: under sync
that wait is the fast rank's whole idle time, and multiplying the slow rank's all-reduce slows
sync on short steps far beyond the factor. The compute slept on is the mean of the rank's last
:data:`MEAN_STEPS` steps (:class:`RunningMean`), not the last step's: sleeping on the last step
would multiply the host's own timing noise by ``f - 1`` (a real slower device does not amplify
its host's noise), and a mean over the whole run keeps the first slow steps (allocations, a busy
host) for hundreds of steps, so a rank runs well past its factor long after they are over. A
mean, not a median: over any stretch the sleep is then ``f - 1`` times the compute, so the
factor holds in time, where a median of right-skewed step times sleeps short. Once-only costs
are kept out of it: a step's compute enters the mean at most :data:`OUTLIER_FACTOR` times the
median of the recent steps (a recompilation, a resumed rank's first step, a host stall: host
work a slower device does not make slower), and the round loop does not slow the run's first
step at all (fdl.engine.rounds.RoundTally.open). The sleep is measured with the clock: what
``time.sleep`` oversleeps (a large part of a millisecond step's sleep) is owed back by the next
steps' sleeps (at most :data:`MAX_OWED_STEPS` steps' worth, so a host stall does not leave the
rank unslowed for long), so the factor holds on steps of a millisecond. What it cannot hold: on
a shared CPU host a rank's compute per step itself grows when the rank waits every step (a
sleep, sync's all-reduce), and the sleep multiplies what was measured. Emulation needs each
step's time when it ends, so on CUDA a timer with ``slowdown > 1`` waits for that step's
``stop`` event (again the compute stream only) before it sleeps. Summaries mark emulated runs.
The runs behind each of these choices are in docs/elche.md "Slowdown emulation".
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

#: the steps whose mean compute the emulation sleeps on
MEAN_STEPS = 15
#: the oversleep carried to the next steps is at most this many steps' sleep
MAX_OWED_STEPS = 4
#: a step's compute enters the mean at most this many times the median of the recent steps
#: (once OUTLIER_AFTER were added): more is a one-time cost, not the device's speed
OUTLIER_FACTOR = 4.0
OUTLIER_AFTER = 3

#: a step's communication: seconds (CPU), or the events that bracket it on the device (CUDA)
StepComm = float | tuple[torch.cuda.Event, torch.cuda.Event] | None


def mark(device: torch.device | None) -> float | torch.cuda.Event:
    """A point in time for a step's timing: ``time.perf_counter()`` on the CPU, an event
    recorded on the device's current stream on CUDA (read later: nothing waits here)."""
    if device is None or torch.device(device).type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


class CommClock(Protocol):
    """Where a step's communication is timed (fdl.engine.ddp_sync.DdpCommMeter; a test fakes
    it): ``begin_step()`` when the step starts, ``end_step()`` when it stops."""

    def begin_step(self) -> None: ...

    def end_step(self) -> StepComm: ...


@dataclass
class StepTimer:
    """Times one round's steps (compute, communication, emulated slowdown) on one device.

    ``device`` None or a CPU device: steps are timed with ``clock`` (``time.perf_counter``; a
    test passes a fake one with a matching ``sleep``) and every figure is current after each
    ``stop()``. A CUDA device: steps are timed with CUDA events on the current stream, and
    ``busy_s``, ``comm_s``, ``step_ms`` and ``step_times_s`` are complete only after
    ``finish()``. ``mean`` is the rank's compute time per step, shared by all of its rounds'
    timers (and checkpointed): the emulated sleep follows it. ``owed_s`` is the sleep the
    rank still owes (negative: overslept), carried from round to round by the caller.
    ``comm`` times each step's communication (None: the steps do not communicate)."""

    slowdown: float = 1.0
    mean: RunningMean | None = None
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False)
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)
    device: torch.device | None = None
    comm: CommClock | None = field(default=None, repr=False)
    owed_s: float = 0.0
    steps: int = field(default=0, init=False)
    sleep_s: float = field(default=0.0, init=False)
    comm_s: float = field(default=0.0, init=False)
    step_times_s: list[float] = field(default_factory=list, init=False)  # compute, step by step
    _cuda: bool = field(default=False, init=False, repr=False)
    _compute_s: float = field(default=0.0, init=False, repr=False)
    _started: float = field(default=0.0, init=False, repr=False)
    _start_event: torch.cuda.Event | None = field(default=None, init=False, repr=False)
    _pending: list[tuple[torch.cuda.Event, torch.cuda.Event, StepComm]] = field(
        default_factory=list, init=False, repr=False)  # CUDA steps whose time is not read yet

    def __post_init__(self) -> None:
        self._cuda = self.device is not None and torch.device(self.device).type == "cuda"

    def start(self) -> None:
        """Begin a step: before its batch is fetched."""
        if self.comm is not None:
            self.comm.begin_step()
        if self._cuda:
            self._start_event = self._record()
        else:
            self._started = self.clock()

    def stop(self) -> None:
        """End a step: after its optimizer step. On CUDA this returns without waiting for the
        GPU unless the timer emulates a slowdown."""
        self.steps += 1
        comm = self.comm.end_step() if self.comm is not None else None
        if not self._cuda:
            self._account(self.clock() - self._started, comm if isinstance(comm, float) else 0.0)
            self._emulate_slowdown()
            return
        assert self._start_event is not None, "StepTimer.stop() without start()"
        end = self._record()
        self._pending.append((self._start_event, end, comm))
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
        """Compute plus emulated sleep over the round's steps, in seconds (communication
        excluded: ``comm_s``)."""
        assert not self._pending, "StepTimer: call finish() before reading CUDA step times"
        return self._compute_s + self.sleep_s

    @property
    def step_ms(self) -> float:
        """Mean busy milliseconds per step (NaN before the first step)."""
        return self.busy_s * 1000 / self.steps if self.steps else float("nan")

    def _record(self) -> torch.cuda.Event:
        return mark(self.device)

    def _read_pending(self) -> None:
        """Book the steps whose events have completed (the caller waited for the last one)."""
        for start, end, comm in self._pending:
            comm_s = comm[0].elapsed_time(comm[1]) / 1000 if isinstance(comm, tuple) else 0.0
            self._account(start.elapsed_time(end) / 1000, comm_s)
        self._pending.clear()

    def _account(self, elapsed: float, comm: float) -> None:
        comm = min(max(comm, 0.0), elapsed)
        compute = elapsed - comm
        self.step_times_s.append(compute)
        self._compute_s += compute
        self.comm_s += comm
        if self.mean is not None:
            self.mean.add(compute)

    def _emulate_slowdown(self) -> None:
        """Sleep ``(slowdown - 1) x`` the rank's mean compute per step (this step's without a
        mean), plus what earlier sleeps owe; book the time the clock says was slept."""
        if self.slowdown <= 1.0:
            return
        base = self.mean.value if self.mean is not None else self.step_times_s[-1]
        target = base * (self.slowdown - 1.0)
        wanted = target + self.owed_s
        slept = 0.0
        if wanted > 0:
            began = self.clock()
            self.sleep(wanted)
            slept = self.clock() - began
        self.owed_s = max(wanted - slept, -MAX_OWED_STEPS * target)
        self.sleep_s += slept


@dataclass
class RunningMean:
    """The mean of the last :data:`MEAN_STEPS` values added: a rank's compute per step as the
    slowdown emulation sleeps on it. What a checkpoint keeps of it is ``(count, total)``,
    ``total`` being ``count x`` its value (older checkpoints kept the sum over the run: the same
    mean); ``RunningMean(count, total)`` goes on from that value.

    From :data:`OUTLIER_AFTER` values on (a restored mean's count included) a value enters at
    most :data:`OUTLIER_FACTOR` times the median of the recent ones: a one-time cost (a
    recompilation, a host stall) is not the device's speed (the module docstring says why)."""

    count: int = 0
    total: float = 0.0
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=MEAN_STEPS), repr=False)

    def __post_init__(self) -> None:
        if self.count and not self.recent:
            self.recent.append(self.total / self.count)

    def add(self, value: float) -> None:
        if self.count >= OUTLIER_AFTER:
            value = min(value, OUTLIER_FACTOR * statistics.median(self.recent))
        self.recent.append(value)
        self.count += 1
        self.total = self.value * self.count

    @property
    def value(self) -> float:
        return sum(self.recent) / len(self.recent) if self.recent else 0.0
