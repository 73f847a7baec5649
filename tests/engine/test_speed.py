"""StepTimer as the trainer uses it: one timer a round, all of a rank's timers sharing one
RunningMean (``run_slice`` builds ``StepTimer(slowdown=..., mean=worker's mean)``).

A fake clock runs the steps: each step takes the compute time the test gives it, and the
timer's emulated sleep moves the same clock, so every figure is exact and no test waits. For a
step of compute ``e`` the timer sleeps ``(f - 1) x`` the rank's mean compute per step so far
(``e`` included), not ``(f - 1) x e``: a real slower device does not amplify its host's noise.
"""

from __future__ import annotations

import math

import pytest
import torch

from fdl.engine.speed import RunningMean, StepTimer


class FakeClock:
    """``now`` moves only when a step computes (``run``) or the timer sleeps; ``log`` records
    the calls in order."""

    def __init__(self):
        self.now = 100.0
        self.sleeps: list[float] = []
        self.log: list[str] = []

    def __call__(self) -> float:
        self.log.append("clock")
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def timer_for(clock: FakeClock, *, slowdown: float, mean: RunningMean) -> StepTimer:
    return StepTimer(slowdown=slowdown, mean=mean, clock=clock, sleep=clock.sleep)


def run_round(timer: StepTimer, clock: FakeClock, compute_s: list[float]) -> StepTimer:
    for seconds in compute_s:
        timer.start()
        clock.now += seconds
        timer.stop()
    return timer


def test_the_emulated_sleep_follows_the_running_mean_across_rounds():
    clock, mean = FakeClock(), RunningMean()
    first = run_round(timer_for(clock, slowdown=3.0, mean=mean), clock, [0.010, 0.020])
    # mean 0.010 then 0.015: sleeps 2 x 0.010 and 2 x 0.015 (not 2 x 0.020, the last step)
    assert clock.sleeps == pytest.approx([0.020, 0.030])
    assert first.steps == 2
    assert first.sleep_s == pytest.approx(0.050)
    assert first.busy_s == pytest.approx(0.030 + 0.050)
    assert first.step_ms == pytest.approx(40.0)

    second = run_round(timer_for(clock, slowdown=3.0, mean=mean), clock, [0.030])
    # the next round's timer starts from the same mean: (0.010 + 0.020 + 0.030) / 3 = 0.020
    assert clock.sleeps[2:] == pytest.approx([0.040])
    assert (second.steps, second.sleep_s) == (1, pytest.approx(0.040))
    assert second.step_ms == pytest.approx(70.0)
    assert (mean.count, mean.total) == (3, pytest.approx(0.060))


def test_an_outlier_step_is_not_amplified():
    clock, mean = FakeClock(), RunningMean()
    timer = run_round(timer_for(clock, slowdown=2.0, mean=mean), clock, [0.010] * 9 + [0.110])
    # the hiccup adds its own 0.1 s and moves the mean by 0.01 s, so the last sleep is 0.02 s
    assert clock.sleeps[-1] == pytest.approx(0.020)
    assert timer.sleep_s == pytest.approx(9 * 0.010 + 0.020)
    assert timer.busy_s == pytest.approx(0.200 + timer.sleep_s)


@pytest.mark.parametrize("slowdown", [1.0, 0.5])
def test_no_slowdown_or_a_speedup_never_sleeps_and_still_feeds_the_mean(slowdown):
    clock, mean = FakeClock(), RunningMean()
    timer = run_round(timer_for(clock, slowdown=slowdown, mean=mean), clock, [0.010, 0.030])
    assert clock.sleeps == [] and timer.sleep_s == 0.0
    assert timer.busy_s == pytest.approx(0.040)  # a factor below 1 does not shorten steps
    assert timer.step_ms == pytest.approx(20.0)
    assert (mean.count, mean.total) == (2, pytest.approx(0.040))


def test_a_checkpointed_mean_goes_on_where_it_stopped():
    """A resumed rank restores its mean as RunningMean(count, total): the first sleep after the
    resume is on the whole run's mean, not on the first step alone."""
    clock, mean = FakeClock(), RunningMean(4, 0.200)  # 50 ms a step before the checkpoint
    run_round(timer_for(clock, slowdown=2.0, mean=mean), clock, [0.010])
    assert clock.sleeps == pytest.approx([0.210 / 5])


def test_step_ms_is_nan_without_steps():
    timer = StepTimer(slowdown=2.0, mean=RunningMean())
    assert timer.steps == 0 and math.isnan(timer.step_ms)


def test_a_cuda_step_waits_for_the_device_before_reading_the_clock(monkeypatch):
    clock = FakeClock()
    synced: list[torch.device] = []

    def synchronize(device):
        clock.log.append("synchronize")
        synced.append(device)

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    timer = timer_for(clock, slowdown=1.0, mean=RunningMean())
    timer.start()
    timer.stop(sync_device=torch.device("cuda", 1))
    timer.start()
    timer.stop(sync_device=torch.device("cpu"))  # nothing to wait for on the CPU
    assert clock.log == ["clock", "synchronize", "clock", "clock", "clock"]
    assert synced == [torch.device("cuda", 1)]


def test_the_default_clock_measures_real_work():
    mean = RunningMean()
    timer = StepTimer(slowdown=1.0, mean=mean)
    for _ in range(3):
        timer.start()
        sum(i * i for i in range(20_000))
        timer.stop()
    assert timer.steps == mean.count == 3
    assert timer.busy_s > 0 and timer.busy_s == pytest.approx(mean.total)
