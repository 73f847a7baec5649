"""libtorch source builds: the plan exhaustively, the runner against a stand-in PyTorch repo.

The runner tests clone a throw-away local git repo whose ``tools/build_libtorch.py`` is
``standin/build_libtorch.py`` (seconds, no compiler), with a fake ``nvcc`` on PATH.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from fdl.errors import FdlError, UsageError
from fdl.libtorch.build import NVCC_FILE, STAGING, BuildStep, plan_build
from fdl.libtorch.build_runner import parse_nvcc_version, probe_nvcc, run_build, verify_tree

STANDIN = Path(__file__).parent / "standin" / "build_libtorch.py"
PY = "/opt/py/bin/python3"
BUILD_ENV = {"TORCH_CUDA_ARCH_LIST": "6.1;12.0", "USE_CUDA": "1", "USE_CUDNN": "1",
             "USE_NCCL": "1", "USE_DISTRIBUTED": "1", "BUILD_PYTHON": "OFF",
             "BUILD_TEST": "OFF", "MAX_JOBS": "8"}

NVCC_12_8 = """\
nvcc: NVIDIA (R) Cuda compiler driver
Copyright (c) 2005-2025 NVIDIA Corporation
Built on Fri_Feb_21_20:23:50_PST_2025
Cuda compilation tools, release 12.8, V12.8.93
Build cuda_12.8.r12.8/compiler.35583870_0
"""
NVCC_13_0 = """\
nvcc: NVIDIA (R) Cuda compiler driver
Copyright (c) 2005-2025 NVIDIA Corporation
Built on Wed_Aug_20_01:58:59_PM_PDT_2025
Cuda compilation tools, release 13.0, V13.0.88
Build cuda_13.0.r13.0/compiler.36424714_0
"""
NVCC_11_8 = """\
nvcc: NVIDIA (R) Cuda compiler driver
Copyright (c) 2005-2022 NVIDIA Corporation
Built on Wed_Sep_21_10:33:58_PDT_2022
Cuda compilation tools, release 11.8, V11.8.89
Build cuda_11.8.r11.8/compiler.31833905_0
"""

posix_only = pytest.mark.skipif(os.name == "nt", reason="stand-in tools are POSIX scripts")


def native(tmp_path: Path, **overrides) -> object:
    args = dict(version="2.13.0", archs=["6.1", "12.0"], jobs=8, mode="native",
                cache_dir=tmp_path / "cache", python=PY)
    return plan_build(**{**args, **overrides})


# ---- the plan ---------------------------------------------------------------------------------

def test_native_plan_steps_argv_cwd_and_env_exactly(tmp_path):
    plan = native(tmp_path)
    src = tmp_path / "cache" / "pytorch-src" / "v2.13.0"
    steps = {step.name: step for step in plan.steps}
    assert [step.name for step in plan.steps] == [
        "clone", "submodules", "configure", "build", "install"]
    assert steps["clone"].argv == (
        "git", "clone", "--depth", "1", "--branch", "v2.13.0", "--recurse-submodules",
        "--shallow-submodules", "https://github.com/pytorch/pytorch.git", str(src))
    assert (steps["clone"].cwd, steps["clone"].env) == (src.parent, {})
    assert steps["submodules"].argv == (
        "git", "submodule", "update", "--init", "--recursive", "--depth", "1")
    assert (steps["submodules"].cwd, steps["submodules"].env) == (src, {})
    assert steps["configure"].argv == (PY, "tools/build_libtorch.py", "--cmake-only",
                                       "--rerun-cmake")
    assert steps["build"].argv == (PY, "tools/build_libtorch.py")
    assert steps["configure"].env == steps["build"].env == BUILD_ENV
    assert steps["build"].cwd == src
    assert steps["install"].argv == ("cp", "-R", "torch/lib", "torch/include", "torch/share",
                                     STAGING)
    assert (steps["install"].cwd, steps["install"].env) == (src, {})
    assert all(step.check and step.stdin is None for step in plan.steps)


def test_native_plan_fields(tmp_path):
    plan = native(tmp_path)
    assert plan.version == "2.13.0"
    assert plan.archs == ("6.1", "12.0")
    assert plan.torch_cuda_arch_list == "6.1;12.0"
    assert (plan.jobs, plan.mode) == (8, "native")
    assert plan.source_dir == tmp_path / "cache" / "pytorch-src" / "v2.13.0"
    assert plan.output_name == "2.13.0-sm61-sm120"
    assert plan.log_path == tmp_path / "cache" / "build-logs" / "2.13.0-sm61-sm120.log"
    assert (plan.dockerfile, plan.base_image, plan.cuda_home) == (None, None, None)


def test_cuda_home_is_added_to_the_build_env_only(tmp_path):
    plan = native(tmp_path, cuda_home="/usr/local/cuda-12.8")
    envs = {step.name: step.env for step in plan.steps}
    assert envs["build"] == envs["configure"] == {**BUILD_ENV, "CUDA_HOME": "/usr/local/cuda-12.8"}
    assert envs["clone"] == envs["submodules"] == envs["install"] == {}
    assert plan.cuda_home == "/usr/local/cuda-12.8"


def test_python_defaults_to_this_interpreter_and_repo_url_is_used(tmp_path):
    plan = plan_build(version="v2.13.0", archs=["8.6"], jobs=1, mode="native",
                      cache_dir=tmp_path, repo_url="file:///srv/pytorch")
    steps = {step.name: step for step in plan.steps}
    assert steps["build"].argv[0] == sys.executable
    assert steps["clone"].argv[-2:] == ("file:///srv/pytorch", str(tmp_path / "pytorch-src" /
                                                                   "v2.13.0"))
    assert plan.version == "2.13.0"


@pytest.mark.parametrize(("archs", "expected", "name"), [
    (["12.0", "6.1"], ("6.1", "12.0"), "sm61-sm120"),
    (["6.1;12.0+PTX"], ("6.1", "12.0+PTX"), "sm61-sm120-compute120"),
    (["sm_61", "sm_120"], ("6.1", "12.0"), "sm61-sm120"),
    (["8.6, 8.9 9.0"], ("8.6", "8.9", "9.0"), "sm86-sm89-sm90"),
    (["12.0", "12.0+ptx", "12.0"], ("12.0+PTX",), "sm120-compute120"),
    (["9.0a"], ("9.0a",), "sm90a"),
])
def test_arch_lists_are_normalised(tmp_path, archs, expected, name):
    plan = native(tmp_path, archs=archs)
    assert plan.archs == expected
    assert plan.torch_cuda_arch_list == ";".join(expected)
    assert plan.output_name == f"2.13.0-{name}"
    assert plan.steps[3].env["TORCH_CUDA_ARCH_LIST"] == ";".join(expected)


@pytest.mark.parametrize(("archs", "message"), [
    ([], "no CUDA architectures"),
    (["", " ; "], "no CUDA architectures"),
    (["banana"], "not a CUDA architecture: 'banana'"),
    (["6.1", "12"], "not a CUDA architecture: '12'"),
    (["compute_120"], "no PTX-only entries"),
    (["6.1", "11.0"], "no CUDA toolkit compiles for all of 6.1, 11.0"),
])
def test_bad_arch_lists_are_usage_errors(tmp_path, archs, message):
    with pytest.raises(UsageError, match=message) as info:
        native(tmp_path, archs=archs)
    assert info.value.exit_code == 2
    assert info.value.hint


@pytest.mark.parametrize("jobs", [0, -1, True, 2.5, "8"])
def test_jobs_must_be_a_positive_int(tmp_path, jobs):
    with pytest.raises(UsageError, match=f"jobs must be a whole number >= 1, got {jobs!r}"):
        native(tmp_path, jobs=jobs)


def test_unknown_mode_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="build mode 'podman' is unknown; allowed: native, docker"):
        native(tmp_path, mode="podman")


@pytest.mark.parametrize("version", ["latest", "2.13", "2.13.0.1", "main", ""])
def test_bad_versions_are_usage_errors(tmp_path, version):
    with pytest.raises(UsageError, match="is not a release number"):
        native(tmp_path, version=version)


def test_release_candidates_use_pytorchs_tag_spelling(tmp_path):
    assert native(tmp_path, version="2.14.0-rc2").steps[0].argv[5] == "v2.14.0-rc2"


def test_docker_plan_with_pascal_uses_a_cuda_12_image(tmp_path):
    plan = native(tmp_path, mode="docker")
    assert plan.base_image == "nvidia/cuda:12.8.1-cudnn-devel-ubuntu22.04"
    text = plan.dockerfile
    assert "FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu22.04 AS build" in text
    assert 'ARG TORCH_CUDA_ARCH_LIST="6.1;12.0"' in text
    assert "ARG VERSION=2.13.0" in text
    assert "ARG MAX_JOBS=8" in text
    assert "ARG REPO_URL=https://github.com/pytorch/pytorch.git" in text
    assert "python tools/build_libtorch.py" in text
    assert "BUILD_PYTHON=OFF BUILD_TEST=OFF" in text
    assert "/out/libtorch" in text
    assert "@{" not in text and "${TORCH_CUDA_ARCH_LIST}" in text
    assert plan.cuda_home is None


@pytest.mark.parametrize(("archs", "cuda"), [
    (["7.5", "12.0"], "13.0"),
    (["8.6", "9.0", "10.0", "12.0+PTX"], "13.0"),
    (["6.1", "12.0"], "12.8"),
    (["6.1", "8.6"], "12.8"),
    (["6.1", "10.3"], "12.9"),  # sm_103 arrived in 12.9, sm_61 left after 12.9
])
def test_docker_base_image_follows_the_toolkits_that_compile_every_arch(tmp_path, archs, cuda):
    plan = native(tmp_path, mode="docker", archs=archs)
    assert plan.base_image.startswith(f"nvidia/cuda:{cuda}.")
    assert f"FROM {plan.base_image} AS build" in plan.dockerfile


def test_docker_plan_steps(tmp_path):
    plan = native(tmp_path, mode="docker", jobs=4)
    cache = tmp_path / "cache"
    steps = {step.name: step for step in plan.steps}
    assert list(steps) == ["build", "cleanup", "create", "copy", "remove"]
    assert steps["build"].argv == (
        "docker", "build", "-t", "fdl-libtorch:2.13.0-sm61-sm120",
        "--build-arg", "VERSION=2.13.0", "--build-arg", "TORCH_CUDA_ARCH_LIST=6.1;12.0",
        "--build-arg", "MAX_JOBS=4", "-")
    assert steps["build"].stdin == plan.dockerfile
    assert steps["cleanup"].argv == ("docker", "rm", "-f", "fdl-libtorch-2.13.0-sm61-sm120")
    assert not steps["cleanup"].check
    assert steps["create"].argv == ("docker", "create", "--name",
                                    "fdl-libtorch-2.13.0-sm61-sm120",
                                    "fdl-libtorch:2.13.0-sm61-sm120")
    assert steps["copy"].argv == ("docker", "cp",
                                  "fdl-libtorch-2.13.0-sm61-sm120:/out/libtorch/.", STAGING)
    assert steps["remove"].argv == ("docker", "rm", "fdl-libtorch-2.13.0-sm61-sm120")
    assert all(step.cwd == cache and step.env == {} for step in plan.steps)


@pytest.mark.parametrize("mode", ["native", "docker"])
def test_to_dict_is_json_serialisable(tmp_path, mode):
    plan = native(tmp_path, mode=mode, cuda_home="/usr/local/cuda")
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["archs"] == ["6.1", "12.0"]
    assert data["mode"] == mode
    assert data["log_path"] == str(plan.log_path)
    assert data["steps"][0]["argv"] == list(plan.steps[0].argv)
    assert data["steps"][0]["cwd"] == str(plan.steps[0].cwd)
    assert data["dockerfile"] == plan.dockerfile


# ---- nvcc ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "version"), [
    (NVCC_12_8, "12.8"), (NVCC_13_0, "13.0"), (NVCC_11_8, "11.8"),
    ("", None), ("bash: nvcc: command not found", None),
])
def test_parse_nvcc_version(text, version):
    assert parse_nvcc_version(text) == version


def fake_nvcc(folder: Path, output: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "nvcc"
    script.write_text(f"#!/bin/sh\nprintf '%s' '{output}'\n")  # a builtin: PATH may be bare
    script.chmod(0o755)
    return folder


@posix_only
def test_probe_nvcc_uses_cuda_home_then_path(tmp_path):
    on_path = fake_nvcc(tmp_path / "path-bin", NVCC_12_8)
    home = tmp_path / "cuda-13.0"
    fake_nvcc(home / "bin", NVCC_13_0)
    env = {"PATH": str(on_path)}
    assert probe_nvcc(cuda_home=None, env=env) == "12.8"
    assert probe_nvcc(cuda_home=str(home), env=env) == "13.0"
    assert probe_nvcc(cuda_home=str(tmp_path / "no-cuda"), env=env) is None
    assert probe_nvcc(cuda_home=None, env={"PATH": str(tmp_path / "empty")}) is None


# ---- the output check ---------------------------------------------------------------------------

def make_tree(root: Path, *, lib: str = "libtorch_cpu.so", config: bool = True) -> Path:
    for path in (f"lib/{lib}", "include/torch/x.h",
                 *(["share/cmake/Torch/TorchConfig.cmake"] if config else [])):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text("x")
    return root


@pytest.mark.parametrize("lib", ["libtorch_cpu.so", "libtorch.so.2.13", "libtorch.dylib",
                                 "libtorch_cpu.dylib", "torch_cpu.dll"])
def test_verify_tree_accepts_libtorch_libraries(tmp_path, lib):
    verify_tree(make_tree(tmp_path, lib=lib), log_path=tmp_path / "log")


@pytest.mark.parametrize(("lib", "config", "problem"), [
    ("libc10.so", True, "lib/ has no libtorch shared library"),
    ("libtorch_cpu.a", True, "lib/ has no libtorch shared library"),
    ("libtorch_cpu.so", False, "share/cmake/Torch/TorchConfig.cmake is missing"),
])
def test_verify_tree_rejects_incomplete_trees(tmp_path, lib, config, problem):
    with pytest.raises(FdlError, match=problem) as info:
        verify_tree(make_tree(tmp_path, lib=lib, config=config), log_path=tmp_path / "b.log")
    assert str(tmp_path / "b.log") in info.value.hint


def test_verify_tree_names_missing_headers(tmp_path):
    (tmp_path / "lib").mkdir()
    with pytest.raises(FdlError, match="include/torch/ is missing"):
        verify_tree(tmp_path, log_path=tmp_path / "log")


# ---- the runner, against the stand-in -----------------------------------------------------------

def git(*args: str, cwd: Path) -> None:
    subprocess.run(["git", "-c", "user.name=fdl", "-c", "user.email=fdl@example.invalid",
                    "-c", "commit.gpgsign=false", "-c", "tag.gpgsign=false", *args],
                   cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pytorch_repo(tmp_path_factory) -> str:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path_factory.mktemp("pytorch-standin")
    (repo / "tools").mkdir()
    shutil.copy(STANDIN, repo / "tools" / "build_libtorch.py")
    git("init", "-q", cwd=repo)
    git("add", ".", cwd=repo)
    git("commit", "-q", "-m", "stand-in pytorch", cwd=repo)
    git("tag", "v9.9.9", cwd=repo)
    return repo.as_uri()


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    bin_dir = fake_nvcc(tmp_path / "fake-bin", NVCC_12_8)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "STANDIN_MODE": "ok"}


def standin_plan(tmp_path: Path, repo: str):
    return plan_build(version="9.9.9", archs=["6.1", "12.0"], jobs=3, mode="native",
                      cache_dir=tmp_path / "cache", repo_url=repo, python=sys.executable)


@posix_only
def test_run_build_stages_a_verified_tree_and_logs_every_line(tmp_path, pytorch_repo, env):
    plan = standin_plan(tmp_path, pytorch_repo)
    seen: list[str] = []
    result = run_build(plan, staging=tmp_path / "stage", on_line=seen.append, runner_env=env)
    assert result.tree == tmp_path / "stage"
    assert (result.tree / "lib" / "libtorch_cpu.so").is_file()
    assert (result.tree / "include" / "torch" / "x.h").is_file()
    assert (result.tree / "share" / "cmake" / "Torch" / "TorchConfig.cmake").is_file()
    assert result.meta == {"version": "9.9.9", "cuda": "12.8", "archs": ["sm_61", "sm_120"],
                           "torch_cuda_arch_list": "6.1;12.0", "source": "build",
                           "mode": "native", "log": str(plan.log_path)}
    log = plan.log_path.read_text().splitlines()
    assert log == seen
    for line in ("-- stand-in configured for 6.1;12.0",
                 "[1/3] stand-in build run 1 with MAX_JOBS=3",
                 "[2/3] stand-in linking (on stderr)", "[3/3] stand-in installed into torch/"):
        assert line in log
    assert [line.split(":")[1].strip() for line in log if line.startswith("== fdl: step")] == [
        "step clone", "step submodules", "step configure", "step build", "step install"]


@posix_only
def test_second_run_reuses_the_cached_checkout(tmp_path, pytorch_repo, env):
    plan = standin_plan(tmp_path, pytorch_repo)
    run_build(plan, staging=tmp_path / "stage1", runner_env=env)
    seen: list[str] = []
    run_build(plan, staging=tmp_path / "stage2", on_line=seen.append, runner_env=env)
    assert seen[0] == f"== fdl: clone skipped: reusing the cached checkout {plan.source_dir}"
    assert "[1/3] stand-in build run 2 with MAX_JOBS=3" in seen  # the same build/ folder
    assert not any(line.startswith("== fdl: step clone") for line in seen)
    log = plan.log_path.read_text()
    assert log.count("== fdl: step clone") == 1 and log.count("clone skipped") == 1


@posix_only
def test_failing_step_names_step_exit_code_and_log(tmp_path, pytorch_repo, env):
    plan = standin_plan(tmp_path, pytorch_repo)
    with pytest.raises(FdlError) as info:
        run_build(plan, staging=tmp_path / "stage", runner_env={**env, "STANDIN_MODE": "fail"})
    message = info.value.message
    assert "'build'" in message and "exit code 3" in message and str(plan.log_path) in message
    assert "error: stand-in compiler failure" in info.value.hint
    assert "[1/3] stand-in build run 1" in info.value.hint
    assert str(plan.source_dir) in info.value.hint  # how to resume or start over
    assert "error: stand-in compiler failure" in plan.log_path.read_text()


@posix_only
def test_missing_cmake_config_fails_verification(tmp_path, pytorch_repo, env):
    plan = standin_plan(tmp_path, pytorch_repo)
    with pytest.raises(FdlError, match=r"TorchConfig\.cmake is missing") as info:
        run_build(plan, staging=tmp_path / "stage",
                  runner_env={**env, "STANDIN_MODE": "no-cmake-config"})
    assert str(plan.log_path) in info.value.hint


def test_non_empty_staging_is_refused(tmp_path):
    (tmp_path / "stage").mkdir()
    (tmp_path / "stage" / "old").write_text("x")
    with pytest.raises(FdlError, match="is not empty"):
        run_build(native(tmp_path), staging=tmp_path / "stage")


def test_a_missing_program_is_reported_by_step(tmp_path):
    plan = native(tmp_path)
    plan = replace(plan, steps=(BuildStep("build", (str(tmp_path / "no-python"),), tmp_path),))
    with pytest.raises(FdlError, match="build step 'build' could not start"):
        run_build(plan, staging=tmp_path / "stage")


def test_runner_feeds_stdin_fills_staging_ignores_unchecked_failures_reads_docker_nvcc(tmp_path):
    """The docker path's runner mechanics without Docker: stdin, <staging>, check=False."""
    write_tree = (
        "import sys, pathlib; root = pathlib.Path(sys.argv[1]); text = sys.stdin.read()\n"
        "for p in ('lib/libtorch_cpu.so', 'include/torch/x.h',"
        " 'share/cmake/Torch/TorchConfig.cmake', '.fdl-nvcc-version'):\n"
        "    (root / p).parent.mkdir(parents=True, exist_ok=True); (root / p).write_text(text)\n"
        "print('copied', len(text))")
    steps = (BuildStep("cleanup", (sys.executable, "-c", "raise SystemExit(1)"), tmp_path,
                       check=False),
             BuildStep("copy", (sys.executable, "-c", write_tree, STAGING), tmp_path,
                       stdin=NVCC_13_0))
    plan = replace(native(tmp_path, mode="docker"), steps=steps)
    result = run_build(plan, staging=tmp_path / "stage")
    assert result.meta["cuda"] == "13.0" and result.meta["mode"] == "docker"
    assert not (result.tree / NVCC_FILE).exists()
    log = plan.log_path.read_text()
    assert "== fdl: step cleanup exited with 1; ignored" in log
    assert f"copied {len(NVCC_13_0)}" in log


# ---- the toolkit, checked before the clone ------------------------------------------------------

@pytest.mark.parametrize(("nvcc", "problem"), [
    ("12.8", None), ("12.9", None),
    ("13.0", "nvcc 13.0 cannot build 6.1;12.0: this build needs CUDA 12.8-12.9"),
    ("12.6", "nvcc 12.6 cannot build 6.1;12.0: this build needs CUDA 12.8-12.9"),
    (None, "no nvcc found (CUDA_HOME, PATH): this build needs CUDA 12.8-12.9")])
def test_the_nvcc_found_is_checked_against_the_range_the_archs_need(tmp_path, nvcc, problem):
    """CUDA 13 dropped Pascal, Blackwell needs 12.8: a Pascal + Blackwell build has a window."""
    plan = plan_build(version="2.14.0", archs=["6.1", "12.0"], jobs=2, mode="native",
                      cache_dir=tmp_path, nvcc=nvcc)
    assert plan.toolkit_problem == problem
    assert plan.cuda_range == ("12.8", "12.9")
    docker = plan_build(version="2.14.0", archs=["6.1", "12.0"], jobs=2, mode="docker",
                        cache_dir=tmp_path, nvcc=nvcc)
    assert docker.toolkit_problem is None  # the container brings its own


@posix_only
def test_a_build_with_the_wrong_nvcc_is_refused_before_anything_and_dry_run_pastes(tmp_path):
    from helpers import run_fdl

    bin_dir = fake_nvcc(tmp_path / "bin", NVCC_13_0)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "FDL_CACHE_DIR": str(tmp_path / "cache"), "FLODL_HOME": str(tmp_path / "home")}
    proc = run_fdl("libtorch", "build", "--archs", "6.1;12.0", env=env)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0] == (
        "error: nvcc 13.0 cannot build 6.1;12.0: this build needs CUDA 12.8-12.9")
    assert not (tmp_path / "cache" / "pytorch-src").exists()  # nothing cloned
    planned = run_fdl("libtorch", "build", "--archs", "6.1;12.0", "--dry-run", env=env)
    assert planned.returncode == 0, planned.stderr
    assert "toolkit: nvcc 13.0 cannot build 6.1;12.0" in planned.stdout
    assert "2-6 hours of compiling" in planned.stdout
    steps = [line.split("] ", 1)[1] for line in planned.stdout.splitlines()
             if line.strip().startswith("[")]
    configure = next(step for step in steps if "--cmake-only" in step)
    assert "TORCH_CUDA_ARCH_LIST='6.1;12.0'" in configure
    words = shlex.split(configure)  # it pastes: one subshell, the list one word
    assert words[0] == "(cd" and "TORCH_CUDA_ARCH_LIST=6.1;12.0" in words
