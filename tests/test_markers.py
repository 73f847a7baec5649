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
