"""Run a :class:`~fdl.libtorch.build.BuildPlan`: each step's output appended to the plan's log
and passed to ``on_line`` (the CLI's live tail), the cached checkout reused, the result verified
(``lib/`` with libtorch, ``include/torch``, ``share/cmake/Torch/TorchConfig.cmake``) and the real
CUDA version recorded from ``nvcc --version``. The plan itself is pure data in ``build.py``."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import subprocess
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TextIO

from fdl.errors import FdlError
from fdl.libtorch.build import NVCC_FILE, STAGING, BuildPlan, BuildResult, BuildStep
from fdl.system.compat import parse_arch_list

_TAIL_LINES = 25


def run_build(plan: BuildPlan, *, staging: Path, on_line: Callable[[str], None] | None = None,
              runner_env: Mapping[str, str] | None = None) -> BuildResult:
    """Run ``plan``'s steps; ``staging`` (absent or empty) receives the libtorch tree.

    ``runner_env`` is the environment the steps start from (default: this process's); each
    step adds its own ``env``. Raises ``FdlError`` for a failed step or an unusable output.
    """
    staging = Path(staging)
    if staging.exists() and any(staging.iterdir()):
        raise FdlError(f"build staging directory {staging} is not empty",
                       hint="remove it or pass an empty directory")
    staging.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ if runner_env is None else runner_env)
    plan.log_path.parent.mkdir(parents=True, exist_ok=True)
    with plan.log_path.open("a", encoding="utf-8") as handle:
        log = _Log(handle, on_line)
        for step in plan.steps:
            if step.name == "clone" and (plan.source_dir / ".git").exists():
                log(f"== fdl: clone skipped: reusing the cached checkout {plan.source_dir}")
                continue
            _run_step(plan, step, staging=staging, env=env, log=log)
        verify_tree(staging, log_path=plan.log_path)
        cuda = _recorded_cuda(plan, staging=staging, env=env)
        log(f"== fdl: built libtorch {plan.version} for {plan.torch_cuda_arch_list} "
            f"with CUDA {cuda or 'unknown (no nvcc found)'}")
    meta = {"version": plan.version, "cuda": cuda,
            "archs": [str(a) for a in parse_arch_list(plan.torch_cuda_arch_list)],
            "torch_cuda_arch_list": plan.torch_cuda_arch_list, "source": "build",
            "mode": plan.mode, "log": str(plan.log_path)}
    return BuildResult(tree=staging, meta=meta)


def parse_nvcc_version(text: str) -> str | None:
    """``"Cuda compilation tools, release 12.8, V12.8.93"`` -> ``"12.8"``."""
    match = re.search(r"release (\d+\.\d+)", text)
    return match.group(1) if match else None


def probe_nvcc(*, cuda_home: str | None, env: Mapping[str, str]) -> str | None:
    """The CUDA release of ``<cuda_home>/bin/nvcc``, or of the ``nvcc`` on ``env``'s PATH."""
    search = str(Path(cuda_home) / "bin") if cuda_home else env.get("PATH", os.defpath)
    exe = shutil.which("nvcc", path=search)
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, "--version"], capture_output=True, text=True,
                              env=dict(env), timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_nvcc_version(done.stdout)


def verify_tree(tree: Path, *, log_path: Path) -> None:
    """Raise ``FdlError`` unless ``tree`` has a libtorch library, headers and CMake config."""
    libs = [p for p in (tree / "lib").glob("*torch*") if _is_shared_library(p.name)]
    problems = [
        *([] if libs else ["lib/ has no libtorch shared library (libtorch_cpu.so or similar)"]),
        *([] if (tree / "include" / "torch").is_dir() else ["include/torch/ is missing"]),
        *([] if (tree / "share/cmake/Torch/TorchConfig.cmake").is_file()
          else ["share/cmake/Torch/TorchConfig.cmake is missing"]),
    ]
    if problems:
        raise FdlError(f"the build finished but {tree} is not a usable libtorch: "
                       + "; ".join(problems), hint=f"see the build log: {log_path}")


def _is_shared_library(name: str) -> bool:
    return (bool(re.fullmatch(r"libtorch\w*\.(so(\.[\d.]+)?|dylib)", name))
            or bool(re.fullmatch(r"torch\w*\.dll", name)))


class _Log:
    """Appends lines to the build log and hands them to ``on_line``; keeps the last few."""

    def __init__(self, handle: TextIO, on_line: Callable[[str], None] | None):
        self.handle, self.on_line = handle, on_line
        self.tail: deque[str] = deque(maxlen=_TAIL_LINES)

    def __call__(self, line: str) -> None:
        self.handle.write(line + "\n")
        self.handle.flush()
        self.tail.append(line)
        if self.on_line is not None:
            self.on_line(line)


def _run_step(plan: BuildPlan, step: BuildStep, *, staging: Path, env: dict[str, str],
              log: _Log) -> None:
    argv = [str(staging) if arg == STAGING else arg for arg in step.argv]
    log.tail.clear()
    log(f"== fdl: step {step.name}: {shlex.join(argv)}")
    step.cwd.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.Popen(
            argv, cwd=step.cwd, env={**env, **step.env}, text=True, errors="replace",
            stdin=subprocess.DEVNULL if step.stdin is None else subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except OSError as exc:
        raise FdlError(f"build step {step.name!r} could not start {argv[0]!r}: {exc.strerror}",
                       hint=f"install {argv[0]} or put it on PATH") from exc
    try:
        if step.stdin is not None:  # small (a Dockerfile): fits the pipe before any reading
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.write(step.stdin)
                proc.stdin.close()
        for line in proc.stdout:
            log(line.rstrip("\r\n"))
        code = proc.wait()
    finally:
        if proc.poll() is None:  # Ctrl-C or a failing on_line: do not leave the build running
            proc.kill()
            proc.wait()
    if code != 0 and step.check:
        raise FdlError(
            f"libtorch build step {step.name!r} failed with exit code {code}; "
            f"full log: {plan.log_path}",
            hint="last lines of the log:\n" + "\n".join(log.tail) + _resume_hint(plan))
    if code != 0:
        log(f"== fdl: step {step.name} exited with {code}; ignored")


def _resume_hint(plan: BuildPlan) -> str:
    if plan.mode == "docker":
        return "\nrerunning reuses Docker's layer cache"
    return (f"\nrerunning resumes in {plan.source_dir}; delete it to start from a fresh "
            "checkout")


def _recorded_cuda(plan: BuildPlan, *, staging: Path, env: Mapping[str, str]) -> str | None:
    """The CUDA the build used: nvcc's own report (docker: the one the Dockerfile saved)."""
    saved = staging / NVCC_FILE
    if plan.mode == "docker":
        text = saved.read_text(encoding="utf-8", errors="replace") if saved.is_file() else ""
        saved.unlink(missing_ok=True)
        return parse_nvcc_version(text)
    return probe_nvcc(cuda_home=plan.cuda_home, env=env)
