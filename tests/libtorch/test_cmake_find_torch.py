"""A libtorch archive made from this venv's torch wheel (lib/, include/, share/), installed with
`fdl libtorch download --url file://...`, activated, and found by CMake's find_package(Torch)
through `fdl libtorch env` — then a tiny C++ program is built against it and run. About a
minute (a 500 MB archive and a C++ compile), so it is marked slow like the other C++ build
(off by default): `pytest -m slow tests/libtorch/test_cmake_find_torch.py`."""

from __future__ import annotations

import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
from helpers import clean_env, run_fdl

CMAKE = """cmake_minimum_required(VERSION 3.18)
project(fdl_probe CXX)
find_package(Torch REQUIRED)
add_executable(probe probe.cpp)
target_link_libraries(probe "${TORCH_LIBRARIES}")
set_property(TARGET probe PROPERTY CXX_STANDARD 17)
"""
PROBE = """#include <torch/torch.h>
#include <iostream>
int main() { std::cout << torch::ones({2, 2}).sum().item<float>() << std::endl; }
"""


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("cmake") and shutil.which("g++")), reason="needs cmake, g++")
def test_wheel_archive_installs_and_cmake_builds_against_it(tmp_path):
    import torch

    wheel = Path(torch.__file__).parent
    archive = tmp_path / "libtorch-from-wheel.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_STORED) as zf:
        for part in ("lib", "include", "share"):
            for path in (wheel / part).rglob("*"):
                if path.is_file():
                    zf.write(path, f"libtorch/{path.relative_to(wheel)}")
    env = {"FLODL_HOME": str(tmp_path / "home")}
    proc = run_fdl("libtorch", "download", "--url", archive.as_uri(), "--variant", "from-wheel",
                   env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    exports = run_fdl("libtorch", "env", env=env).stdout
    project = tmp_path / "project"
    project.mkdir()
    (project / "CMakeLists.txt").write_text(CMAKE)
    (project / "probe.cpp").write_text(PROBE)
    script = (f"{exports}\ncmake -S {project} -B {project}/build -DCMAKE_BUILD_TYPE=Release "
              f"&& cmake --build {project}/build -j2 && {project}/build/probe")
    build = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=1200,
                           env=clean_env(env))
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    assert build.stdout.strip().splitlines()[-1] == "4"
    assert str(tmp_path / "home") in build.stdout  # CMake found Torch in the store
