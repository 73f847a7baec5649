"""Test helpers: run the real `fdl` entry point in a subprocess, locate fixtures."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"
GPU_FIXTURES = FIXTURES / "gpus"


def run_fdl(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
            timeout: float = 120, input: str | None = None) -> subprocess.CompletedProcess:
    """``python -m fdl ARGS`` as a user would run it; returns the completed process."""
    return subprocess.run([sys.executable, "-m", "fdl", *args], capture_output=True, text=True,
                          env=clean_env(env), cwd=cwd, timeout=timeout, input=input)


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without fdl's variables, Slurm or OMP_NUM_THREADS, plus
    ``extra``."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("FDL_", "SLURM_")) and k != "OMP_NUM_THREADS"}
    return {**base, "NO_COLOR": "1", "COLUMNS": "200", **(extra or {})}


