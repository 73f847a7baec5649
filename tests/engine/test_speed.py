"""StepTimer: step timing, and slowdown emulation that sleeps (f - 1) x each measured step.

The relations checked follow from ``stop()``: for a step of measured compute time ``e`` it
sleeps ``e x (f - 1)`` and adds ``e + e x (f - 1) = f x e`` to ``busy_s``. So, summed over the
steps, ``compute = busy_s - sleep_s``, ``sleep_s = (f - 1) x compute`` and
``busy_s = f x compute`` — relations between recorded values, not wall-clock thresholds.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from fdl.engine.speed import StepTimer


def work() -> None:
    """A little real compute between start() and stop()."""
    sum(i * i for i in range(20_000))


def run_steps(timer: StepTimer, num_steps: int) -> float:
    """Runs the steps; returns the wall time they took (an upper bound on busy_s)."""
    began = time.perf_counter()
    for _ in range(num_steps):
        timer.start()
        work()
        timer.stop()
    return time.perf_counter() - began


def test_no_slowdown_sleeps_nothing():
    timer = StepTimer(slowdown=1.0)
    wall_s = run_steps(timer, 3)
    assert timer.steps == 3
    assert timer.sleep_s == 0.0
    assert 0 < timer.busy_s <= wall_s
    assert timer.step_ms == pytest.approx(timer.busy_s * 1000 / 3)


def test_slowdown_three_sleeps_twice_the_measured_compute():
    timer = StepTimer(slowdown=3.0)
    wall_s = run_steps(timer, 4)
    compute_s = timer.busy_s - timer.sleep_s
    assert timer.steps == 4
    assert compute_s > 0
    assert timer.sleep_s == pytest.approx(2 * compute_s, rel=1e-9)
    assert timer.busy_s == pytest.approx(3 * compute_s, rel=1e-9)
    # the sleep really happened: the steps took at least the time they recorded
    assert wall_s >= timer.busy_s
    assert timer.step_ms == pytest.approx(timer.busy_s * 1000 / 4)


def test_a_fractional_slowdown_counts_its_sleep_in_busy_time():
    timer = StepTimer(slowdown=1.5)
    run_steps(timer, 2)
    compute_s = timer.busy_s - timer.sleep_s
    assert timer.sleep_s == pytest.approx(0.5 * compute_s, rel=1e-9)


def test_a_slowdown_below_one_never_sleeps_or_shortens_steps():
    timer = StepTimer(slowdown=0.5)
    wall_s = run_steps(timer, 2)
    assert timer.sleep_s == 0.0
    assert 0 < timer.busy_s <= wall_s


def test_step_ms_is_nan_without_steps():
    timer = StepTimer(slowdown=2.0)
    assert timer.steps == 0
    assert math.isnan(timer.step_ms)


def test_a_cpu_sync_device_is_accepted():
    timer = StepTimer()
    timer.start()
    timer.stop(sync_device=torch.device("cpu"))
    assert timer.steps == 1 and timer.busy_s >= 0
