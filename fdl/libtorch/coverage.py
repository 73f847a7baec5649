"""Does a build cover every GPU in the survey, and which official build would?

Applies the per-GPU rules of :mod:`fdl.system.compat` to a whole :class:`GpuSurvey`:

* :func:`check_build` — one build (the installed torch wheel, a libtorch variant) against every
  GPU: kernel verdict per GPU, whether the driver knows each GPU, whether it runs the build's
  CUDA runtime.
* :func:`advise_builds` — every official build in the catalog against the survey: those that
  cover all GPUs (the newest stable one recommended), or, when none does (a GTX 1060 beside an
  RTX 5060 Ti), the build covering the most GPUs with the ones it leaves out, and the exact
  ``TORCH_CUDA_ARCH_LIST`` and CUDA toolkit range for a source build.

Pure functions over data; no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fdl.libtorch.catalog import LINUX_X86_64, WINDOWS_X86_64, OfficialBuild, official_builds
from fdl.system.compat import (
    DriverVerdict,
    KernelVerdict,
    driver_verdict,
    gpu_driver_verdict,
    kernel_verdict,
    parse_arch_list,
    source_build_cuda_range,
    torch_cuda_arch_list,
    version_tuple,
)
from fdl.system.gpus import GpuInfo, GpuSurvey


@dataclass(frozen=True)
class GpuCoverage:
    gpu: GpuInfo
    kernel: KernelVerdict
    driver: DriverVerdict  # does the driver know this GPU's architecture

    @property
    def runs(self) -> bool:
        return self.kernel.runs and self.driver.status != "too-old"


@dataclass(frozen=True)
class BuildCoverage:
    label: str
    cuda: str | None
    archs: tuple[str, ...]
    gpus: tuple[GpuCoverage, ...]
    runtime: DriverVerdict | None  # the driver against the build's CUDA runtime

    @property
    def missing(self) -> tuple[GpuInfo, ...]:
        return tuple(item.gpu for item in self.gpus if not item.runs)

    @property
    def covers_all(self) -> bool:
        runtime_ok = self.runtime is None or self.runtime.status != "too-old"
        return runtime_ok and not self.missing


def check_build(survey: GpuSurvey, *, label: str, archs: Sequence[str], cuda: str | None,
                windows: bool = False) -> BuildCoverage:
    """One build against every GPU of the survey."""
    parsed = parse_arch_list(list(archs))
    gpus = tuple(
        GpuCoverage(
            gpu,
            kernel_verdict(gpu.compute_capability, parsed),
            gpu_driver_verdict(gpu.compute_capability, driver_version=survey.driver_version,
                               windows=windows),
        )
        for gpu in survey.gpus
    )
    runtime = None
    if cuda and survey.gpus:
        runtime = driver_verdict(driver_version=survey.driver_version,
                                 cuda_driver_version=survey.cuda_driver_version,
                                 runtime_cuda=cuda, windows=windows)
    return BuildCoverage(label, cuda, tuple(archs), gpus, runtime)


@dataclass(frozen=True)
class BuildAdvice:
    """What to install so every GPU runs. Empty when the survey has no GPU."""

    covering: tuple[BuildCoverage, ...]  # official builds that cover every GPU, best first
    best_partial: BuildCoverage | None  # when none covers all: the one covering the most
    source_arch_list: str | None  # TORCH_CUDA_ARCH_LIST for a source build covering all
    source_cuda: tuple[str, str | None] | None  # CUDA toolkits that can build that list
    driver_needed: str | None  # a driver that would let a (better) official build run

    @property
    def recommended(self) -> BuildCoverage | None:
        return self.covering[0] if self.covering else None


def advise_builds(survey: GpuSurvey, *, platform: str = LINUX_X86_64,
                  version: str | None = None) -> BuildAdvice:
    """Every official build of ``platform`` (optionally one ``version``) against the survey."""
    if not survey.gpus:
        return BuildAdvice((), None, None, None, None)
    windows = platform == WINDOWS_X86_64
    checked = [(build, check_build(survey, label=build.label, archs=build.archs,
                                   cuda=build.cuda, windows=windows))
               for build in official_builds(platform=platform, version=version)]
    covering = sorted((pair for pair in checked if pair[1].covers_all), key=build_preference,
                      reverse=True)
    ccs = [gpu.compute_capability for gpu in survey.gpus]
    driver_needed = _driver_needed(survey, checked)
    if covering:
        return BuildAdvice(tuple(c for _, c in covering), None, None, None, driver_needed)
    partial = max(checked, key=_partial_preference, default=None)
    return BuildAdvice(
        (),
        partial[1] if partial and len(partial[1].missing) < len(survey.gpus) else None,
        torch_cuda_arch_list(ccs),
        source_build_cuda_range(ccs),
        driver_needed,
    )


def build_preference(pair: tuple[OfficialBuild, BuildCoverage]) -> tuple:
    build, coverage = pair
    full_driver = coverage.runtime is None or coverage.runtime.status == "ok"
    all_native = all(item.kernel.status == "ok" for item in coverage.gpus)
    return (full_driver, not build.experimental, all_native, version_tuple(build.version),
            version_tuple(build.cuda))


def _partial_preference(pair: tuple[OfficialBuild, BuildCoverage]) -> tuple:
    _build, coverage = pair
    covered = [item.gpu for item in coverage.gpus if item.runs]
    newest = max((gpu.compute_capability for gpu in covered), default=(0, 0))
    runtime_ok = coverage.runtime is None or coverage.runtime.status != "too-old"
    return (runtime_ok, len(covered), newest, *build_preference(pair))


def _driver_needed(survey: GpuSurvey,
                   checked: list[tuple[OfficialBuild, BuildCoverage]]) -> str | None:
    """The oldest driver with which some official build runs every GPU fully, when the
    installed driver is not already enough (None then, or when no build has the kernels)."""
    options = []
    for _, coverage in checked:
        if not all(item.kernel.runs for item in coverage.gpus):
            continue
        needs = [item.driver.needed for item in coverage.gpus
                 if item.driver.status == "too-old" and item.driver.needed]
        if coverage.runtime and coverage.runtime.status != "ok" and coverage.runtime.needed:
            needs.append(coverage.runtime.needed)
        if not needs:
            return None
        options.append(max(needs, key=version_tuple))
    return min(options, key=version_tuple) if options else None
