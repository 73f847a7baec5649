"""One environment per device class, for a host no single torch build covers (data, no I/O).

A GTX 1060 (sm_61) needs a CUDA 12.6 wheel, the last line with Pascal kernels; an RTX 5060 Ti
(sm_120) needs CUDA 12.8 or newer; no official wheel or libtorch has both, and a source build
with ``TORCH_CUDA_ARCH_LIST="6.1;12.0"`` takes hours. fdl's workers are separate processes
averaging through host memory (the ``cpu`` backend), so each may run its own environment: the
same torch **release**, built for its card's CUDA line (``fdl run --worker-python``).

:func:`plan_environments` takes the newest release (stable builds first) for which every GPU of
the survey is run by some build of that release (the coverage rules of fdl.libtorch.coverage:
SASS or PTX, the driver's floors), picks the fewest builds of it that run them all (the
preferred build first for each GPU), and gives each build a venv under
``$FLODL_HOME/envs/<release>-<variant>``, the GPUs it runs (the device map: UUID, or index when
the survey has none) and the exact commands that make it (``fdl_requirement``: what pip installs
as fdl, ``fdl==X.Y.Z`` or the checkout fdl runs from). None when one build covers every GPU
(one environment is the answer) or when no release covers each GPU with some build.
"""

from __future__ import annotations

import itertools
import shlex
from dataclasses import dataclass
from pathlib import Path

from fdl.libtorch.catalog import LINUX_X86_64, WINDOWS_X86_64, OfficialBuild, official_builds
from fdl.libtorch.coverage import build_preference, check_build
from fdl.system.compat import version_tuple
from fdl.system.gpus import GpuInfo, GpuSurvey


@dataclass(frozen=True)
class Environment:
    """One venv: a build of the release and the GPUs it runs."""

    name: str  # "2.14.0-cu126"
    build: OfficialBuild
    path: Path
    gpus: tuple[GpuInfo, ...]
    commands: tuple[tuple[str, ...], ...]  # argv lists, in order

    @property
    def python(self) -> Path:
        return self.path / ("Scripts/python.exe" if self.build.platform == WINDOWS_X86_64
                            else "bin/python")

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "torch": f"{self.build.version}+{self.build.variant}",
                "path": str(self.path), "python": str(self.python),
                "devices": [{"index": g.index, "name": g.name, "uuid": g.uuid,
                             "arch": g.arch} for g in self.gpus],
                "commands": [shlex.join(argv) for argv in self.commands]}


@dataclass(frozen=True)
class EnvironmentPlan:
    release: str
    environments: tuple[Environment, ...]

    @property
    def device_map(self) -> dict[str, str]:
        """GPU (UUID, or ``index:N``) -> environment name (the map file's, names only)."""
        devices = self.map_document()["devices"]
        assert isinstance(devices, dict)
        return {key: entry["environment"] for key, entry in devices.items()}

    def worker_python(self) -> str:
        """``fdl run --worker-python``'s value for one worker per GPU in index order (local
        rank r on the r-th GPU)."""
        order = sorted((gpu.index, env) for env in self.environments for gpu in env.gpus)
        return ",".join(f"{rank}={env.python}" for rank, (_, env) in enumerate(order))

    def summary(self) -> str:
        """``two environments, same torch 2.14.0: cu126 for GPU 1, cu130 for GPU 0``."""
        count = {2: "two", 3: "three", 4: "four"}.get(len(self.environments),
                                                      str(len(self.environments)))
        parts = [f"{env.build.variant} for GPU {', '.join(str(g.index) for g in env.gpus)}"
                 for env in self.environments]
        return f"{count} environments, same torch {self.release}: {', '.join(parts)}"

    def train_today(self) -> str:
        """The path that needs nothing new built: the newest GPU alone, on its environment."""
        env, gpu = max(((env, gpu) for env in self.environments for gpu in env.gpus),
                       key=lambda pair: pair[1].compute_capability)
        return (f"train today on GPU {gpu.index} ({gpu.name}) alone, on {env.build.version}+"
                f"{env.build.variant}: fdl run --devices {gpu.index} train.py")

    def map_document(self) -> dict[str, object]:
        """What ``$FLODL_HOME/envs/device-map.json`` holds (fdl run reads it): each GPU's
        interpreter by its UUID (or ``index:N``)."""
        return {"release": self.release,
                "devices": {_device_key(gpu): {"environment": env.name,
                                               "python": str(env.python)}
                            for env in self.environments for gpu in env.gpus}}

    def to_dict(self) -> dict[str, object]:
        return {"release": self.release, "train_today": self.train_today(),
                "environments": [env.to_dict() for env in self.environments],
                "device_map": self.device_map, "worker_python": self.worker_python()}


def plan_environments(survey: GpuSurvey, *, home: Path, fdl_requirement: str,
                      platform: str = LINUX_X86_64, python: str = "python3",
                      index_base: str | None = None) -> EnvironmentPlan | None:
    """The environments per device class for ``survey`` (see the module docstring)."""
    if len(survey.gpus) < 2:
        return None
    builds = official_builds(platform=platform)
    windows = platform == WINDOWS_X86_64
    if any(check_build(survey, label=b.label, archs=b.archs, cuda=b.cuda,
                       windows=windows).covers_all for b in builds):
        return None  # one build runs every GPU: one environment
    for stable_only in (True, False):
        for release in sorted({b.version for b in builds}, key=version_tuple, reverse=True):
            candidates = [b for b in builds if b.version == release
                          and (not stable_only or not b.experimental)]
            chosen = _fewest_builds(survey, candidates, windows=windows)
            if chosen is not None:
                return EnvironmentPlan(release, tuple(
                    _environment(build, gpus, home=home, fdl_requirement=fdl_requirement,
                                 python=python, index_base=index_base)
                    for build, gpus in chosen))
    return None


def _fewest_builds(survey: GpuSurvey, candidates: list[OfficialBuild], *, windows: bool
                   ) -> list[tuple[OfficialBuild, tuple[GpuInfo, ...]]] | None:
    """The fewest of ``candidates`` that run every GPU, each GPU on the most preferred build
    of them that runs it; None when some GPU is run by none."""
    runs: dict[OfficialBuild, set[int]] = {}
    for build in candidates:
        runs[build] = {gpu.index for gpu in survey.gpus
                       if check_build(_alone(survey, gpu), label=build.label, archs=build.archs,
                                      cuda=build.cuda, windows=windows).covers_all}
    ranked = sorted(candidates, key=lambda b: build_preference(
        (b, check_build(survey, label=b.label, archs=b.archs, cuda=b.cuda, windows=windows))),
        reverse=True)
    wanted = {gpu.index for gpu in survey.gpus}
    for size in range(1, len(ranked) + 1):
        for subset in itertools.combinations(ranked, size):  # kept in preference order
            if set().union(*(runs[b] for b in subset)) != wanted:
                continue
            left, chosen = set(wanted), []
            for build in subset:
                gpus = tuple(g for g in survey.gpus if g.index in left & runs[build])
                left -= {g.index for g in gpus}
                if gpus:
                    chosen.append((build, gpus))
            return chosen
    return None


def _alone(survey: GpuSurvey, gpu: GpuInfo) -> GpuSurvey:
    return GpuSurvey(survey.source, (gpu,), survey.driver_version, survey.cuda_driver_version)


def _environment(build: OfficialBuild, gpus: tuple[GpuInfo, ...], *, home: Path,
                 fdl_requirement: str, python: str, index_base: str | None) -> Environment:
    name = f"{build.version}-{build.variant}"
    path = home / "envs" / name
    env = Environment(name, build, path, gpus, ())
    inside = str(env.python)
    index = f"{index_base.rstrip('/')}/{build.variant}" if index_base else build.wheel_index_url
    commands = (
        (python, "-m", "venv", str(path)),
        (inside, "-m", "pip", "install", f"torch=={build.version}", "--index-url", index),
        (inside, "-m", "pip", "install", fdl_requirement),
    )
    return Environment(name, build, path, gpus, commands)


DEVICE_MAP = "device-map.json"  # in $FLODL_HOME/envs: written once the environments work
TORCH_INDEX_ENV = "FDL_TORCH_INDEX"  # a mirror of https://download.pytorch.org/whl


def _device_key(gpu: GpuInfo) -> str:
    return gpu.uuid or f"index:{gpu.index}"
