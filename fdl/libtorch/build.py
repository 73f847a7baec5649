"""Build libtorch from source for exactly the GPUs you own (``fdl libtorch build``).

No official build covers a Pascal and a Blackwell card at once (CUDA 13 dropped sm_61, CUDA
12.6 predates sm_120); one source build with ``TORCH_CUDA_ARCH_LIST="6.1;12.0"`` on CUDA 12.8
does. ``plan_build`` decides everything (argv lists, env dicts, paths; no I/O) for
``--dry-run``; ``build_runner.run_build`` executes it::

    plan = plan_build(version="2.13.0", archs=["6.1", "12.0"], jobs=8, mode="native",
                      cache_dir=cache)
    result = run_build(plan, staging=store.staging() / "build.tree", on_line=show_tail)
    store.install(kind="builds", name=plan.output_name, tree=result.tree, meta=result.meta)

Native steps: ``clone`` the tag ``v<version>`` with shallow submodules into
``<cache>/pytorch-src/v<version>`` (skipped when that checkout exists: a rerun resumes where
ninja stopped); ``submodules`` completes a cut-short checkout; ``configure`` runs
``tools/build_libtorch.py --cmake-only --rerun-cmake`` because CMake reads TORCH_CUDA_ARCH_LIST
only when it configures, so a reused checkout would keep its previous arch list; ``build`` runs
``tools/build_libtorch.py`` (2-6 hours) with TORCH_CUDA_ARCH_LIST, USE_CUDA/USE_CUDNN/USE_NCCL/
USE_DISTRIBUTED=1, BUILD_PYTHON/BUILD_TEST=OFF, MAX_JOBS (and CUDA_HOME when given);
``install`` copies ``torch/{lib,include,share}`` into the staging directory.

Docker mode needs only Docker: ``templates/Dockerfile.build``, rendered on a cuDNN devel
``nvidia/cuda`` image whose toolkit compiles for every arch, goes to ``docker build -`` on stdin
(empty context); ``docker create`` / ``cp`` / ``rm`` copy ``/out/libtorch`` out.

Every output line goes to ``plan.log_path`` and to ``on_line``. A failing step raises
``FdlError`` naming the step, its exit code and the log, with the log's last lines as hint.
"""

from __future__ import annotations

import json
import re
import string
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from fdl.errors import UsageError
from fdl.system.compat import parse_arch_list, source_build_cuda_range, version_tuple

DEFAULT_REPO = "https://github.com/pytorch/pytorch.git"
MODES = ("native", "docker")
STAGING = "<staging>"  # stands for run_build's staging directory in a step's argv
NVCC_FILE = ".fdl-nvcc-version"  # written by the Dockerfile beside lib/, removed after reading
# nvidia/cuda cuDNN devel images, in order of preference: the toolkits PyTorch's own releases
# are built with (newest first), then the others. The first whose CUDA compiles for every
# requested arch is used.
BUILD_IMAGES: tuple[tuple[str, str], ...] = (
    ("13.0", "13.0.0-cudnn-devel-ubuntu24.04"),
    ("12.8", "12.8.1-cudnn-devel-ubuntu22.04"),
    ("12.6", "12.6.3-cudnn-devel-ubuntu22.04"),
    ("12.9", "12.9.1-cudnn-devel-ubuntu22.04"),
)


@dataclass(frozen=True)
class BuildStep:
    """One command of a build: ``argv`` run in ``cwd`` with ``env`` added to the environment."""

    name: str
    argv: tuple[str, ...]
    cwd: Path
    env: dict[str, str] = field(default_factory=dict)  # only the variables this step adds
    stdin: str | None = None  # text fed to the command (docker build's Dockerfile)
    check: bool = True  # False: a non-zero exit is logged and ignored (cleanup)



# What a source build costs (pytorch's own build docs and flodl's report: 2-6 hours on a
# desktop, 4 h reported by flodl), said before it starts
BUILD_COST = ("2-6 hours of compiling (flodl reports 4 h), a recursive clone of pytorch and "
              "tens of GB of disk")


@dataclass(frozen=True)
class BuildPlan:
    """Everything a source build will do, decided before anything runs."""

    version: str  # "2.13.0" -> git tag v2.13.0
    archs: tuple[str, ...]  # ("6.1", "12.0+PTX")
    torch_cuda_arch_list: str  # "6.1;12.0+PTX"
    jobs: int
    mode: str  # "native" | "docker"
    source_dir: Path  # the cached checkout (native mode)
    output_name: str  # "2.13.0-sm61-sm120"
    log_path: Path
    steps: tuple[BuildStep, ...]
    dockerfile: str | None = None  # docker mode: the rendered Dockerfile
    base_image: str | None = None  # docker mode: "nvidia/cuda:12.8.1-cudnn-devel-ubuntu22.04"
    cuda_home: str | None = None  # native mode: the toolkit to build with (else nvcc on PATH)
    cuda_range: tuple[str, str | None] | None = None  # the CUDA toolkits that compile the archs
    # native mode: the nvcc found and what is wrong with it for these archs (None: it fits)
    nvcc: str | None = None
    toolkit_problem: str | None = None
    cost: str = BUILD_COST

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types (paths as strings, tuples as lists) for ``--dry-run``/``--json``."""
        return json.loads(json.dumps(asdict(self), default=str))


@dataclass(frozen=True)
class BuildResult:
    """A finished build: ``tree`` holds lib/, include/, share/ for ``Store.install``."""

    tree: Path
    meta: dict[str, Any]


def plan_build(*, version: str, archs: Sequence[str], jobs: int, mode: str, cache_dir: Path,
               repo_url: str = DEFAULT_REPO, cuda_home: str | None = None,
               python: str = sys.executable, nvcc: str | None = None) -> BuildPlan:
    """The build of libtorch ``version`` for ``archs`` (``"6.1"``, ``"12.0+PTX"``, ``sm_86``).
    ``nvcc``: the toolkit version a native build would use (None: none found), checked
    against the range the archs need (:attr:`BuildPlan.toolkit_problem`)."""
    version = _check_version(version)
    arch_list = normalize_archs(archs)
    cuda_range = _cuda_range(arch_list)
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise UsageError(f"jobs must be a whole number >= 1, got {jobs!r}")
    if mode not in MODES:
        raise UsageError(f"build mode {mode!r} is unknown; allowed: {', '.join(MODES)}")
    cache_dir, arch_str = Path(cache_dir), ";".join(arch_list)
    name = f"{version}-" + "-".join(_arch_tag(arch) for arch in arch_list)
    source_dir = cache_dir / "pytorch-src" / f"v{version}"
    dockerfile = base_image = None
    if mode == "docker":
        base_image = f"nvidia/cuda:{_pick_image(cuda_range, arch_list)}"
        dockerfile = render_dockerfile(base_image=base_image, version=version, jobs=jobs,
                                       arch_list=arch_str, repo_url=repo_url)
        steps = _docker_steps(name=name, dockerfile=dockerfile, cwd=cache_dir, build_args={
            "VERSION": version, "TORCH_CUDA_ARCH_LIST": arch_str, "MAX_JOBS": str(jobs)})
    else:
        env = build_env(arch_list=arch_str, jobs=jobs, cuda_home=cuda_home)
        steps = _native_steps(source_dir=source_dir, version=version, repo_url=repo_url,
                              python=python, env=env)
    return BuildPlan(version=version, archs=arch_list, torch_cuda_arch_list=arch_str, jobs=jobs,
                     mode=mode, source_dir=source_dir, output_name=name,
                     log_path=cache_dir / "build-logs" / f"{name}.log", steps=steps,
                     dockerfile=dockerfile, base_image=base_image,
                     cuda_home=cuda_home if mode == "native" else None, cuda_range=cuda_range,
                     nvcc=nvcc if mode == "native" else None,
                     toolkit_problem=toolkit_problem(nvcc, cuda_range, arch_list)
                     if mode == "native" else None)


def toolkit_problem(nvcc: str | None, cuda_range: tuple[str, str | None],
                    arch_list: Sequence[str]) -> str | None:
    """Why the nvcc found cannot build ``arch_list`` (None: it can). CUDA 13 dropped
    sm_50..sm_72, and Blackwell (sm_120) needs 12.8: a wrong toolkit fails hours into the build,
    after a multi-GB clone."""
    low, high = cuda_range
    span = f"CUDA {low}" + (f"-{high}" if high and high != low else "+" if not high else "")
    if nvcc is None:
        return f"no nvcc found (CUDA_HOME, PATH): this build needs {span}"
    found = version_tuple(nvcc)
    if found < version_tuple(low) or (high is not None and found[:2] > version_tuple(high)[:2]):
        return (f"nvcc {nvcc} cannot build {';'.join(arch_list)}: this build needs {span}")
    return None


def normalize_archs(archs: Sequence[str]) -> tuple[str, ...]:
    """``["sm_120", "6.1;12.0+PTX"]`` -> ``("6.1", "12.0+PTX")``: sorted, duplicates merged."""
    entries = [e for item in archs for e in re.split(r"[;\s,]+", str(item)) if e]
    if not entries:
        raise UsageError("no CUDA architectures given for the build",
                         hint="pass your GPUs' compute capabilities, e.g. --archs 6.1,12.0 "
                              "(`fdl diagnose` lists them)")
    wanted: dict[tuple[int, int, str], bool] = {}
    for entry in entries:
        with_ptx = entry.upper().endswith("+PTX")
        arch = parse_arch_list(entry)[0]
        if arch.ptx:
            raise UsageError(f"arch {entry!r}: TORCH_CUDA_ARCH_LIST has no PTX-only entries",
                             hint=f"write {arch.major}.{arch.minor}+PTX for a cubin plus PTX")
        key = (arch.major, arch.minor, arch.suffix)
        wanted[key] = wanted.get(key, False) or with_ptx
    return tuple(f"{major}.{minor}{suffix}{'+PTX' if ptx else ''}"
                 for (major, minor, suffix), ptx in sorted(wanted.items()))


def build_env(*, arch_list: str, jobs: int, cuda_home: str | None = None) -> dict[str, str]:
    """The variables PyTorch's build reads (BUILD_*/USE_* become CMake options)."""
    env = {"TORCH_CUDA_ARCH_LIST": arch_list, "USE_CUDA": "1", "USE_CUDNN": "1",
           "USE_NCCL": "1", "USE_DISTRIBUTED": "1", "BUILD_PYTHON": "OFF", "BUILD_TEST": "OFF",
           "MAX_JOBS": str(jobs)}
    if cuda_home:
        env["CUDA_HOME"] = cuda_home
    return env


def render_dockerfile(*, base_image: str, version: str, arch_list: str, jobs: int,
                      repo_url: str) -> str:
    """``templates/Dockerfile.build`` with ``@{name}`` fields filled (``$`` is Docker's)."""
    text = resources.files("fdl.libtorch").joinpath("templates/Dockerfile.build").read_text(
        encoding="utf-8")
    return _AtTemplate(text).substitute(base_image=base_image, version=version,
                                        arch_list=arch_list, jobs=jobs, repo_url=repo_url)


class _AtTemplate(string.Template):
    delimiter = "@"


def _check_version(version: str) -> str:
    value = version.strip().removeprefix("v")
    if not re.fullmatch(r"\d+\.\d+\.\d+(?:-rc\d+)?", value):
        raise UsageError(f"libtorch version {version!r} is not a release number",
                         hint="use the PyTorch release to build, e.g. 2.13.0 (tag v2.13.0)")
    return value


def _cuda_range(arch_list: Sequence[str]) -> tuple[str, str | None]:
    cuda_range = source_build_cuda_range(parse_arch_list(arch)[0].cc for arch in arch_list)
    if cuda_range is None:
        raise UsageError(
            f"no CUDA toolkit compiles for all of {', '.join(arch_list)}: the newest needs a "
            "toolkit that dropped the oldest (CUDA 13 dropped sm_50..sm_72)",
            hint="build one libtorch per group of GPUs, e.g. --archs 6.1,8.6 and --archs 12.0")
    return cuda_range


def _arch_tag(arch: str) -> str:
    sass = "sm" + arch.removesuffix("+PTX").replace(".", "")
    return f"{sass}-compute{sass[2:]}" if arch.endswith("+PTX") else sass


def _pick_image(cuda_range: tuple[str, str | None], arch_list: Sequence[str]) -> str:
    low, high = (version_tuple(v) if v else None for v in cuda_range)
    for cuda, tag in BUILD_IMAGES:
        if version_tuple(cuda) >= low and (high is None or version_tuple(cuda) <= high):
            return tag
    raise UsageError(f"no nvidia/cuda build image fdl knows has a CUDA between {cuda_range[0]} "
                     f"and {cuda_range[1]} for {', '.join(arch_list)}",
                     hint="use --mode native with a matching toolkit (CUDA_HOME)")


def _native_steps(*, source_dir: Path, version: str, repo_url: str, python: str,
                  env: dict[str, str]) -> tuple[BuildStep, ...]:
    script = "tools/build_libtorch.py"
    return (
        BuildStep("clone", ("git", "clone", "--depth", "1", "--branch", f"v{version}",
                            "--recurse-submodules", "--shallow-submodules", repo_url,
                            str(source_dir)), source_dir.parent),
        BuildStep("submodules", ("git", "submodule", "update", "--init", "--recursive",
                                 "--depth", "1"), source_dir),
        BuildStep("configure", (python, script, "--cmake-only", "--rerun-cmake"), source_dir,
                  dict(env)),
        BuildStep("build", (python, script), source_dir, dict(env)),
        BuildStep("install", ("cp", "-R", "torch/lib", "torch/include", "torch/share",
                              STAGING), source_dir),
    )


def _docker_steps(*, name: str, dockerfile: str, cwd: Path,
                  build_args: dict[str, str]) -> tuple[BuildStep, ...]:
    image, container = f"fdl-libtorch:{name}", f"fdl-libtorch-{name}"
    flags = [part for key, value in build_args.items()
             for part in ("--build-arg", f"{key}={value}")]
    return (
        BuildStep("build", ("docker", "build", "-t", image, *flags, "-"), cwd, stdin=dockerfile),
        BuildStep("cleanup", ("docker", "rm", "-f", container), cwd, check=False),
        BuildStep("create", ("docker", "create", "--name", container, image), cwd),
        BuildStep("copy", ("docker", "cp", f"{container}:/out/libtorch/.", STAGING), cwd),
        BuildStep("remove", ("docker", "rm", container), cwd),
    )
