"""StepTimer as the round loop uses it: one timer a round, all of a rank's timers sharing one
RunningMean, ``finish()`` at the end of each round.

A fake clock runs the steps: each step takes the compute time the test gives it, and the
timer's emulated sleep moves the same clock, so every figure is exact and no test waits. For a
step of compute ``e`` the timer sleeps ``(f - 1) x`` the rank's mean compute per step over its
recent steps (``e`` included), not ``(f - 1) x e``: a real slower device does not amplify its
host's noise. What a step spends in communication (DDP's all-reduce under sync, faked here) is
neither compute nor slowed.

The CUDA path runs on a fake GPU driven by the same clock (the GPU is the one thing tests may
fake): streams whose queued work ends at a known time, events that complete when the work queued
before them has, ``Event.synchronize`` that moves the host clock to that point, and a
device-wide ``torch.cuda.synchronize`` that waits for every stream, NCCL's included, as the real
one does. The figures of both paths must agree wherever the GPU keeps up with the host.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import pytest
import torch

from fdl.engine.speed import RunningMean, StepTimer

DEVICE = torch.device("cuda", 1)


class FakeClock:
    """``now`` moves only when the host works (``now +=``), sleeps or waits for the fake GPU;
    ``log`` records the calls in order."""

    def __init__(self, *, oversleep: float = 0.0):
        self.now = 100.0
        self.sleeps: list[float] = []
        self.log: list[str] = []
        self.oversleep = oversleep  # what each sleep lasts beyond what was asked

    def __call__(self) -> float:
        self.log.append("clock")
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds + self.oversleep


@dataclass
class FakeStream:
    done_at: float = 0.0  # when the work queued on it so far ends


@dataclass
class FakeGpu:
    """The parts of torch.cuda the timer may touch, on ``clock``."""

    clock: FakeClock
    compute: FakeStream = field(default_factory=FakeStream)
    nccl: FakeStream = field(default_factory=FakeStream)
    devices: list[object] = field(default_factory=list)  # what current_stream was asked for

    def launch(self, seconds: float, stream: FakeStream | None = None) -> None:
        """Queue ``seconds`` of kernels; the host does not wait."""
        stream = stream or self.compute
        stream.done_at = max(stream.done_at, self.clock.now) + seconds

    def current_stream(self, device: object = None) -> FakeStream:
        self.devices.append(device)
        return self.compute

    def synchronize(self, device: object = None) -> None:
        self.clock.log.append("synchronize")
        self.clock.now = max(self.clock.now, self.compute.done_at, self.nccl.done_at)

    def event(self, *, enable_timing: bool = False) -> FakeEvent:
        assert enable_timing, "an event without timing cannot be read"
        return FakeEvent(self.clock)


class FakeEvent:
    def __init__(self, clock: FakeClock):
        self.clock = clock
        self.at: float | None = None

    def record(self, stream: FakeStream) -> None:
        self.at = max(stream.done_at, self.clock.now)
        stream.done_at = self.at

    def synchronize(self) -> None:
        self.clock.log.append("event.synchronize")
        self.clock.now = max(self.clock.now, self.at)

    def elapsed_time(self, end: FakeEvent) -> float:
        # CUDA refuses to read an event that has not completed (cudaErrorNotReady)
        assert end.at is not None and end.at <= self.clock.now, "end event not completed"
        return (end.at - self.at) * 1000


@pytest.fixture
def gpu(monkeypatch) -> FakeGpu:
    fake = FakeGpu(FakeClock())
    monkeypatch.setattr(torch.cuda, "Event", fake.event)
    monkeypatch.setattr(torch.cuda, "current_stream", fake.current_stream)
    monkeypatch.setattr(torch.cuda, "synchronize", fake.synchronize)
    return fake


@dataclass
class Rig:
    """One backend: the host clock (``gpu`` None) or the fake GPU."""

    clock: FakeClock
    gpu: FakeGpu | None

    def timer(self, *, slowdown: float, mean: RunningMean, comm: FakeComm | None = None,
              owed_s: float = 0.0) -> StepTimer:
        return StepTimer(slowdown=slowdown, mean=mean, clock=self.clock, sleep=self.clock.sleep,
                         device=DEVICE if self.gpu else None, comm=comm, owed_s=owed_s)

    def compute(self, seconds: float) -> None:
        if self.gpu:
            self.gpu.launch(seconds)
        else:
            self.clock.now += seconds


class FakeComm:
    """DDP's gradient all-reduce at the end of a step's backward pass, as
    fdl.engine.ddp_sync.DdpCommMeter reports it: seconds on the host clock, or on the fake GPU
    the events around the compute stream's wait for it."""

    def __init__(self, rig: Rig):
        self.rig = rig
        self.step: float | tuple[FakeEvent, FakeEvent] | None = None

    def begin_step(self) -> None:
        self.step = None

    def all_reduce(self, seconds: float) -> None:
        gpu = self.rig.gpu
        if gpu is None:
            self.rig.clock.now += seconds
            self.step = seconds
            return
        handed, done = gpu.event(enable_timing=True), gpu.event(enable_timing=True)
        handed.record(gpu.compute)
        gpu.launch(seconds)  # the compute stream waits for the collective
        done.record(gpu.compute)
        self.step = (handed, done)

    def end_step(self) -> float | tuple[FakeEvent, FakeEvent] | None:
        return self.step


@pytest.fixture(params=["cpu", "cuda"])
def rig(request, gpu) -> Rig:
    return Rig(gpu.clock, gpu if request.param == "cuda" else None)


def run_round(rig: Rig, timer: StepTimer, compute_s: list[float],
              comm_s: float = 0.0) -> StepTimer:
    for seconds in compute_s:
        timer.start()
        rig.compute(seconds)
        if timer.comm is not None:
            timer.comm.all_reduce(comm_s)
        timer.stop()
    timer.finish()
    return timer


def run_rounds(rig: Rig, rounds: list[list[float]], *, slowdown: float, comm_s: float = 0.0,
               ) -> list[tuple[StepTimer, float]]:
    """Rounds as the round loop runs them: one timer each, the mean and the owed sleep carried
    from one to the next; each timer with the wall time its round took."""
    mean, owed, timed = RunningMean(), 0.0, []
    comm = FakeComm(rig) if comm_s else None
    for compute_s in rounds:
        began = rig.clock.now
        timer = run_round(rig, rig.timer(slowdown=slowdown, mean=mean, comm=comm, owed_s=owed),
                          compute_s, comm_s)
        owed = timer.owed_s
        timed.append((timer, rig.clock.now - began))
    return timed


def test_a_slowed_rank_s_communication_is_neither_slowed_nor_compute(rig):
    """Sync on steps of 1 ms with 2 ms in DDP's all-reduce (the collective and the wait for the
    peer): the rank at 2.5x sleeps 1.5 ms a step, on its compute alone, and the 2 ms are booked
    apart (comm_s), outside busy_s. Multiplying the step whole slept 4.5 ms."""
    [(timer, wall)] = run_rounds(rig, [[0.001] * 10], slowdown=2.5, comm_s=0.002)
    assert rig.clock.sleeps == pytest.approx([0.0015] * 10)
    assert timer.step_times_s == pytest.approx([0.001] * 10)
    assert timer.comm_s == pytest.approx(0.020)
    assert timer.busy_s == pytest.approx(0.025)
    assert wall == pytest.approx(timer.busy_s + timer.comm_s)


def test_the_factor_holds_after_slow_first_steps(rig):
    """Ten steps of 50 ms (allocations, a busy host), then steps of 1 ms: a round later the rank
    at 2.5x takes 2.5 ms a step again. The mean over the whole run that the emulation slept on
    before kept the first steps: the 1 ms steps slept ~4 ms each, 5x instead of 2.5x."""
    timed = run_rounds(rig, [[0.050] * 10, *[[0.001] * 50] * 4], slowdown=2.5)
    timer, wall = timed[-1]
    assert wall / sum(timer.step_times_s) == pytest.approx(2.5, rel=0.02)


def test_oversleep_is_paid_back_so_short_steps_keep_their_factor(rig):
    """Every sleep lasts 0.3 ms more than asked (the OS wakes a sleeper late; on a 1 ms step
    that is a third of the sleep): the next sleeps are shortened by it, so over rounds of 1 ms
    steps the rank at 2 x takes 2 ms a step, not 2.3 ms, and its sleep is booked as slept."""
    rig.clock.oversleep = 0.0003
    timed = run_rounds(rig, [[0.001] * 40] * 3, slowdown=2.0)
    for timer, wall in timed[1:]:
        assert wall / sum(timer.step_times_s) == pytest.approx(2.0, rel=0.02)
        assert timer.busy_s == pytest.approx(wall)


def test_the_factor_holds_on_short_steps_of_a_sync_run(rig):
    """All at once, as fdl init's MLP under sync at 1,2.5 had it: slow first steps, then steps
    of 0.8 ms with 1.5 ms in DDP's all-reduce and sleeps that overshoot by 0.1 ms. Each later
    round of the slow rank is 2.5 x its compute plus its communication (2.9 ms against 0.8 ms,
    3.6x, before)."""
    rig.clock.oversleep = 0.0001
    timed = run_rounds(rig, [[0.020] * 5, *[[0.0008] * 50] * 5], slowdown=2.5, comm_s=0.0015)
    for timer, wall in timed[2:]:
        compute = sum(timer.step_times_s)
        assert compute == pytest.approx(0.0008 * 50)
        assert timer.comm_s == pytest.approx(0.0015 * 50)
        assert (wall - timer.comm_s) / compute == pytest.approx(2.5, rel=0.02)
        assert timer.busy_s == pytest.approx(wall - timer.comm_s)


def test_a_host_stall_in_a_sleep_is_paid_back_over_a_few_steps_only(rig):
    """A sleep that lasts a whole second (the host stalled) leaves the owed sleep at four steps'
    worth: the rank skips the next four sleeps and sleeps again from the sixth step on, not
    after a thousand steps."""
    timer = rig.timer(slowdown=2.0, mean=RunningMean())
    rig.clock.oversleep = 1.0
    run_round(rig, timer, [0.001])
    assert timer.owed_s == pytest.approx(-0.004)
    rig.clock.oversleep = 0.0
    run_round(rig, timer, [0.001] * 6)
    assert [s for s in rig.clock.sleeps if s > 1e-9] == pytest.approx([0.001] * 3)
    assert timer.owed_s == pytest.approx(0.0, abs=1e-9)
    assert timer.sleep_s == pytest.approx(1.003)


def test_the_emulated_sleep_follows_the_running_mean_across_rounds(rig):
    mean = RunningMean()
    first = run_round(rig, rig.timer(slowdown=3.0, mean=mean), [0.010, 0.020])
    # mean 0.010 then 0.015: sleeps 2 x 0.010 and 2 x 0.015 (not 2 x 0.020, the last step)
    assert rig.clock.sleeps == pytest.approx([0.020, 0.030])
    assert first.steps == 2
    assert first.step_times_s == pytest.approx([0.010, 0.020])
    assert first.sleep_s == pytest.approx(0.050)
    assert first.busy_s == pytest.approx(0.030 + 0.050)
    assert first.step_ms == pytest.approx(40.0)

    second = run_round(rig, rig.timer(slowdown=3.0, mean=mean), [0.030])
    # the next round's timer goes on with the same mean: of 0.010, 0.020 and 0.030, 0.020
    assert rig.clock.sleeps[2:] == pytest.approx([0.040])
    assert (second.steps, second.sleep_s) == (1, pytest.approx(0.040))
    assert second.step_ms == pytest.approx(70.0)
    assert (mean.count, mean.total) == (3, pytest.approx(0.060))


def test_an_outlier_step_is_not_amplified(rig):
    """A step of 110 ms among steps of 10 ms (a recompilation, a host stall) adds its own
    0.1 s, and enters the mean at 4x the recent steps' median, 40 ms: the mean moves by 3 ms
    and the last sleep is 13 ms (20 ms with the step whole; a 30 s compilation would have
    moved it by 2 s for 15 steps)."""
    timer = run_round(rig, rig.timer(slowdown=2.0, mean=RunningMean()), [0.010] * 9 + [0.110])
    assert rig.clock.sleeps[-1] == pytest.approx(0.013)
    assert timer.sleep_s == pytest.approx(9 * 0.010 + 0.013)
    assert timer.busy_s == pytest.approx(0.200 + timer.sleep_s)


def test_a_resumed_rank_s_first_step_enters_its_restored_mean_capped(rig):
    """A rank resumed from a checkpoint whose mean was 1 ms over 500 steps compiles again in
    its first step (30 s): at 2.5x it sleeps 1.5x (1 + 4) / 2 ms, not 1.5x (1 + 30000) / 2."""
    mean = RunningMean(500, 0.5)
    run_round(rig, rig.timer(slowdown=2.5, mean=mean), [30.0, 0.001])
    assert rig.clock.sleeps == pytest.approx([1.5 * 0.0025, 1.5 * 0.002])


@pytest.mark.parametrize("slowdown", [1.0, 0.5])
def test_no_slowdown_or_a_speedup_never_sleeps_and_still_feeds_the_mean(rig, slowdown):
    mean = RunningMean()
    timer = run_round(rig, rig.timer(slowdown=slowdown, mean=mean), [0.010, 0.030])
    assert rig.clock.sleeps == [] and timer.sleep_s == 0.0
    assert timer.busy_s == pytest.approx(0.040)  # a factor below 1 does not shorten steps
    assert timer.step_ms == pytest.approx(20.0)
    assert (mean.count, mean.total) == (2, pytest.approx(0.040))


def test_a_checkpointed_mean_goes_on_where_it_stopped(rig):
    """A resumed rank restores its mean as RunningMean(count, count x mean) (older checkpoints
    kept the sum: the same): the first sleep after the resume is on that value with the new
    step, not on the new step alone."""
    mean = RunningMean(4, 0.200)
    run_round(rig, rig.timer(slowdown=2.0, mean=mean), [0.010])
    assert rig.clock.sleeps == pytest.approx([(0.050 + 0.010) / 2])
    assert (mean.count, mean.total) == (5, pytest.approx(5 * 0.030))


def test_step_ms_is_nan_without_steps(rig):
    timer = run_round(rig, rig.timer(slowdown=2.0, mean=RunningMean()), [])
    assert timer.steps == 0 and math.isnan(timer.step_ms) and timer.busy_s == 0.0


def test_finish_is_a_no_op_on_the_cpu():
    clock = FakeClock()
    timer = StepTimer(slowdown=2.0, mean=RunningMean(), clock=clock, sleep=clock.sleep)
    timer.start()
    clock.now += 0.010
    timer.stop()
    figures = (timer.steps, timer.busy_s, timer.sleep_s, list(timer.step_times_s))
    log = list(clock.log)
    timer.finish()
    timer.finish()
    assert (timer.steps, timer.busy_s, timer.sleep_s, timer.step_times_s) == figures
    assert figures == (1, pytest.approx(0.020), pytest.approx(0.010), [pytest.approx(0.010)])
    assert clock.log == log == ["clock"] * 4  # the step's start and stop, the sleep's


@pytest.mark.parametrize(("host_s", "gpu_s", "step_times_s"), [
    (0.001, [0.010, 0.020, 0.030], [0.011, 0.020, 0.030]),  # GPU-bound: the host runs ahead
    (0.050, [0.010, 0.010, 0.010], [0.060, 0.050, 0.050]),  # host-bound: the GPU waits for it
], ids=["gpu-bound", "host-bound"])
def test_cuda_steps_are_queued_and_read_once_at_finish(gpu, host_s, gpu_s, step_times_s):
    """Without a slowdown the host never waits during the round; ``finish()`` waits for the
    last step's event only, and the steps' times add up to the round's wall time, whichever of
    host work (fetching, collating, copying the batch) and kernels is the slower."""
    clock, mean = gpu.clock, RunningMean()
    timer = StepTimer(mean=mean, clock=clock, device=DEVICE)
    for seconds in gpu_s:
        timer.start()
        clock.now += host_s  # the batch is fetched and copied inside the step
        gpu.launch(seconds)
        timer.stop()
    assert clock.now == pytest.approx(100.0 + host_s * len(gpu_s))  # the host never waited
    assert timer.steps == len(gpu_s)
    with pytest.raises(AssertionError, match="finish"):
        _ = timer.busy_s
    timer.finish()
    assert clock.log == ["event.synchronize"]
    assert clock.now == pytest.approx(gpu.compute.done_at)  # the round's kernels are done
    assert timer.step_times_s == pytest.approx(step_times_s)
    assert timer.busy_s == pytest.approx(clock.now - 100.0)  # the round's wall time
    assert mean.count == len(gpu_s)
    assert mean.value == pytest.approx(statistics.fmean(step_times_s))
    timer.finish()
    assert clock.log == ["event.synchronize"]
    assert gpu.devices and set(gpu.devices) == {DEVICE}


@pytest.mark.parametrize("slowdown", [1.0, 2.5])
def test_an_average_on_another_stream_is_not_booked_as_compute(gpu, slowdown):
    """Async's reduce, launched at the boundary on NCCL's stream, runs for 0.5 s while the next
    round computes three 10 ms steps. The timer never waits for it: the steps are booked at
    10 ms each and the host is done with the round long before the reduce ends (a device-wide
    synchronize would have waited for it and booked it in the first step)."""
    clock = gpu.clock
    gpu.launch(0.5, stream=gpu.nccl)
    timer = StepTimer(slowdown=slowdown, mean=RunningMean(), clock=clock, sleep=clock.sleep,
                      device=DEVICE)
    for _ in range(3):
        timer.start()
        gpu.launch(0.010)
        timer.stop()
    timer.finish()
    assert "synchronize" not in clock.log
    assert timer.step_times_s == pytest.approx([0.010] * 3)
    assert timer.busy_s == pytest.approx(3 * 0.010 * slowdown)
    assert clock.now == pytest.approx(100.0 + timer.busy_s)
    assert clock.now < gpu.nccl.done_at - 0.4


def test_a_cuda_slowdown_waits_for_each_step_before_it_sleeps(gpu):
    """Emulation needs each step's time when it ends: the slow rank waits for that step's end
    event (the compute stream, nothing else) and then sleeps on the mean."""
    clock = gpu.clock
    timer = StepTimer(slowdown=2.0, mean=RunningMean(), clock=clock, sleep=clock.sleep,
                      device=DEVICE)
    for seconds in [0.010, 0.030]:
        timer.start()
        gpu.launch(seconds)
        timer.stop()
        assert clock.now == pytest.approx(gpu.compute.done_at + clock.sleeps[-1])
    assert clock.log == ["event.synchronize", "clock", "clock"] * 2  # the sleep is measured
    assert clock.sleeps == pytest.approx([0.010, 0.020])
    assert timer.busy_s == pytest.approx(0.040 + 0.030)  # readable without finish()


def test_the_default_clock_measures_real_work():
    mean = RunningMean()
    timer = StepTimer(slowdown=1.0, mean=mean)
    for _ in range(3):
        timer.start()
        sum(i * i for i in range(20_000))
        timer.stop()
    timer.finish()
    assert timer.steps == mean.count == 3
    assert timer.busy_s > 0 and timer.busy_s == pytest.approx(sum(timer.step_times_s))
    assert mean.value == pytest.approx(statistics.fmean(timer.step_times_s))
