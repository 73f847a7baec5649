"""A C++ program builds and runs against the libtorch that `fdl setup` links from the torch
wheel (0 bytes downloaded): the proof that the linked variant is a usable libtorch, not just a
directory of symlinks. Real compiler, real headers and libraries of the wheel in this venv.
The compile against torch/torch.h alone took 14 s here and the whole test 31 s, so it is
marked slow (off by default): `pytest -m slow tests/libtorch/test_cpp_against_linked_wheel.py`."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from helpers import GPU_FIXTURES, run_fdl

from fdl.system.torchenv import probe_torch

PROGRAM = r"""
#include <torch/torch.h>
#include <iostream>

int main() {
    torch::Tensor t = torch::arange(1, 11, torch::kFloat32).reshape({2, 5});
    std::cout << "sum=" << t.sum().item<float>() << " shape=" << t.size(0) << "x" << t.size(1)
              << std::endl;
    return 0;
}
"""


@pytest.mark.slow
def test_a_cpp_program_builds_and_runs_against_the_linked_wheel(tmp_path):
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler (g++ or c++) on PATH")
    torch = probe_torch()
    if not torch.installed or torch.error:
        pytest.skip(f"no usable torch in this interpreter: {torch.error or 'not installed'}")
    if not torch.libtorch:
        pytest.skip(f"the torch {torch.version} wheel ships no lib/, include/, share/cmake/Torch")
    env = {"FLODL_HOME": str(tmp_path / "home"), "FDL_GPU_SURVEY": str(GPU_FIXTURES / "none.json")}
    setup = run_fdl("setup", "--yes", env=env)
    assert setup.returncode == 0, setup.stderr
    assert "linking its libtorch (0 bytes)" in " ".join(setup.stdout.split())
    exports = run_fdl("libtorch", "env", env=env)
    assert exports.returncode == 0, exports.stderr
    root = _export(exports.stdout, "LIBTORCH")
    assert root.endswith(f"python/torch-{torch.version}")

    source = tmp_path / "sum.cpp"
    source.write_text(PROGRAM)
    binary = tmp_path / "sum"
    build = subprocess.run(
        [compiler, "-std=c++17", "-O0", "-w", str(source), "-o", str(binary),
         f"-I{root}/include", f"-I{root}/include/torch/csrc/api/include",
         f"-L{root}/lib", "-ltorch", "-ltorch_cpu", "-lc10"],
        capture_output=True, text=True, timeout=280)
    assert build.returncode == 0, build.stderr[-4000:]
    # run it as a user would: in a shell set up by `eval "$(fdl libtorch env)"` (the loader
    # finds the wheel's libraries through LD_LIBRARY_PATH; the binary has no rpath)
    script = f'{exports.stdout}\nexec {binary}\n'
    ran = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                         env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "sum=55 shape=2x5"


def _export(text: str, name: str) -> str:
    line = next(line for line in text.splitlines() if line.startswith(f"export {name}="))
    return line.split("=", 1)[1].split('"', 1)[0]
