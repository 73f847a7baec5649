"""Which libtorch covers every GPU of this host: ``resolve_variant`` (pure).

* no GPU -> the CPU variant;
* GPUs -> the newest stable CUDA variant whose kernels run on every GPU and whose CUDA runtime
  the driver supports (``fdl.libtorch.coverage`` decides, by real CUDA rules);
* none covers all (a GTX 1060 beside an RTX 5060 Ti) -> no archive, with the options: the
  variant covering the most GPUs and the ones it leaves out, and a source build with the exact
  ``TORCH_CUDA_ARCH_LIST`` and CUDA toolkit range.
"""

from __future__ import annotations

from dataclasses import dataclass

from fdl.libtorch.catalog import (
    LINUX_X86_64,
    LibtorchArchive,
    find_archive,
    latest_version,
)
from fdl.libtorch.coverage import advise_builds
from fdl.system.gpus import GpuSurvey


@dataclass(frozen=True)
class Resolution:
    archive: LibtorchArchive | None  # what to install; None when no official variant covers all
    reason: str  # one line: why this choice
    best_partial: LibtorchArchive | None = None
    left_out: tuple[str, ...] = ()  # GPU names best_partial leaves out
    source_arch_list: str | None = None  # TORCH_CUDA_ARCH_LIST for a source build covering all
    source_cuda: tuple[str, str | None] | None = None
    driver_needed: str | None = None


def resolve_variant(survey: GpuSurvey, *, version: str | None = None,
                    platform: str = LINUX_X86_64, base: str | None = None) -> Resolution:
    if not survey.gpus:
        version = version or latest_version()
        archive = find_archive(version=version, variant="cpu", platform=platform, base=base)
        return Resolution(archive, f"no NVIDIA GPU: the CPU variant {archive.name}")
    advice = advise_builds(survey, platform=platform, version=version)
    names = ", ".join(f"{g.name} ({g.arch})" for g in survey.gpus)
    if advice.recommended is not None:
        ver, variant = advice.recommended.label.removeprefix("torch ").split("+", 1)
        archive = find_archive(version=ver, variant=variant, platform=platform, base=base)
        return Resolution(archive, f"{archive.name} covers {names}",
                          driver_needed=advice.driver_needed)
    partial = None
    left_out: tuple[str, ...] = ()
    if advice.best_partial is not None:
        ver, variant = advice.best_partial.label.removeprefix("torch ").split("+", 1)
        partial = find_archive(version=ver, variant=variant, platform=platform, base=base)
        left_out = tuple(g.name for g in advice.best_partial.missing)
    reason = f"no official libtorch covers {names}"
    if advice.driver_needed:
        reason += (f" with driver {survey.driver_version}; NVIDIA driver >= "
                   f"{advice.driver_needed} would let an official variant run")
    return Resolution(None, reason, partial, left_out, advice.source_arch_list,
                      advice.source_cuda, advice.driver_needed)
