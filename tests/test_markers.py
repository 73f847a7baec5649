"""The default selection (pyproject's addopts, and scripts/test's --deselect-gpu) as pytest itself
collects it: the C++ builds are `slow` and off by default, and without a CUDA GPU the `gpu` tests
are deselected with one line saying how many and why."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers import GUARD_S, clean_env

ROOT = Path(__file__).parents[1]


def collect(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=GUARD_S, env=clean_env())


def test_the_cpp_builds_are_slow_and_off_by_default():
    builds = ["tests/libtorch/test_cmake_find_torch.py",
              "tests/libtorch/test_cpp_against_linked_wheel.py"]
    default = collect(*builds)
    assert "no tests collected (2 deselected)" in default.stdout, default.stdout
    assert collect("-m", "slow", *builds).stdout.count("::test_") == 2


def test_deselect_gpu_says_how_many_and_why():
    gpu = "tests/engine/test_gpu.py"
    plain = collect(gpu)  # without the option the gpu tests are collected (and skip)
    every = plain.stdout.count("::test_")
    assert every > 0 and "gpu tests deselected" not in plain.stdout, plain.stdout
    proc = collect("--deselect-gpu", "torch 9.9.9+cpu sees no CUDA GPU", gpu,
                   "tests/engine/test_simulator.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"==> pytest: {every} gpu tests deselected: torch 9.9.9+cpu sees no CUDA GPU " \
           "(scripts/test-gpu runs them)" in proc.stdout.splitlines()
    assert "test_gpu.py::" not in proc.stdout and "test_simulator.py::" in proc.stdout
    assert f"({every} deselected)" in proc.stdout


def test_the_suite_in_parallel_says_what_it_deselected_and_runs_alone_tests_alone():
    """scripts/test runs the suite on pytest-xdist's workers, which collect in their own
    processes: the controller still says how many gpu tests were deselected, and why; and a test
    marked ``alone`` holds the run's lock by itself while any other shares it
    (tests/fixtures/alone_probe.py)."""
    every = collect("tests/engine/test_gpu.py").stdout.count("::test_")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-n", "2", "--deselect-gpu", "torch 9.9.9+cpu sees no CUDA GPU",
                           "tests/engine/test_gpu.py", "tests/fixtures/alone_probe.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=GUARD_S,
                          env=clean_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert every > 0
    assert f"==> pytest: {every} gpu tests deselected: torch 9.9.9+cpu sees no CUDA GPU " \
           "(scripts/test-gpu runs them)" in proc.stdout.splitlines(), proc.stdout
    assert "2 passed" in proc.stdout, proc.stdout  # the probe's two tests
