"""``fdl setup`` as data: what the host needs, decided before anything is downloaded.

:func:`plan_setup` is pure. Given the GPU survey, the installed torch wheel and the store's
contents it says: which libtorch variant covers every GPU (or that none does, with the options),
whether it is already installed or active, and whether the current Python torch wheel covers
every GPU — with the exact ``pip install`` command (and index URL) when it does not.

The plan carries that command twice over one source: ``torch_install`` as a person reads it and
``pip_argv``, the argv ``fdl setup --install-torch`` runs: the same words after the interpreter
whose torch was checked (``<python> -m pip install ...``), so the wheel lands where it was
found wanting. A source build has no ``pip_argv``: fdl shows it and never runs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fdl.libtorch.catalog import LINUX_X86_64, LibtorchArchive, find_archive
from fdl.libtorch.coverage import advise_builds, check_build
from fdl.libtorch.install import ArchiveRequest
from fdl.libtorch.request import archive_request
from fdl.libtorch.resolve import Resolution, resolve_variant
from fdl.libtorch.wheel import CPU_WHEEL, TorchInstall, torch_install
from fdl.system.gpus import GpuSurvey
from fdl.system.torchenv import TorchInfo


@dataclass(frozen=True)
class SetupPlan:
    resolution: Resolution
    action: str  # "download" | "activate" | "present" | "none"
    archive: LibtorchArchive | None
    torch_covers: bool | None  # None: torch not installed
    torch_install: TorchInstall | None  # the wheel to install when the current one does not fit
    pip_argv: tuple[str, ...] | None  # what --install-torch runs; None: nothing fdl can run
    notes: tuple[str, ...] = ()

    @property
    def variant_id(self) -> str | None:
        return f"precompiled/{self.archive.name}" if self.archive else None

    @property
    def download_request(self) -> ArchiveRequest | None:
        """The archive to install when the plan downloads one (the same request, metadata and
        all, as ``fdl libtorch download`` makes for a catalog entry)."""
        if self.action != "download" or self.archive is None:
            return None
        return archive_request(self.archive)


def plan_setup(*, survey: GpuSurvey, torch: TorchInfo, installed: Sequence[str],
               active: str | None, version: str | None = None, variant: str | None = None,
               platform: str = LINUX_X86_64, base: str | None = None) -> SetupPlan:
    """``variant`` (``"2.11.0-cu128"``) overrides the automatic choice, e.g. to take the
    best-partial option on mixed GPUs."""
    resolution = resolve_variant(survey, version=version, platform=platform, base=base)
    if variant is not None:
        ver, _, name = variant.partition("-")
        chosen = find_archive(version=ver, variant=name, platform=platform, base=base)
        resolution = Resolution(chosen, f"{chosen.name} chosen with --variant")
    archive = resolution.archive
    if archive is None:
        action = "none"
    else:
        wanted = f"precompiled/{archive.name}"
        action = "present" if active == wanted else "activate" if wanted in installed \
            else "download"
    covers, command = _torch_wheel(survey, torch, platform)
    pip_argv = (torch.python, "-m", *command.argv) if command and command.is_wheel else None
    return SetupPlan(resolution, action, archive, covers, command, pip_argv, _notes(resolution))


def _torch_wheel(survey: GpuSurvey, torch: TorchInfo,
                 platform: str) -> tuple[bool | None, TorchInstall | None]:
    if not survey.gpus:
        if not torch.installed:
            return None, CPU_WHEEL
        return True, (CPU_WHEEL if torch.cuda_version else None)
    command = torch_install(advise_builds(survey, platform=platform))
    if not torch.installed or torch.error:
        return None, command
    coverage = check_build(survey, label=f"torch {torch.version}", archs=torch.arch_list,
                           cuda=torch.cuda_version)
    return coverage.covers_all, None if coverage.covers_all else command


def _notes(resolution: Resolution) -> tuple[str, ...]:
    if resolution.archive is not None:
        return ()
    notes = [resolution.reason]
    if resolution.best_partial is not None:
        notes.append(f"option: {resolution.best_partial.name} covers the most GPUs but leaves "
                     f"out {', '.join(resolution.left_out)} (fdl setup --variant "
                     f"{resolution.best_partial.name})")
    if resolution.source_arch_list:
        span = ""
        if resolution.source_cuda:
            low, high = resolution.source_cuda
            span = f" with CUDA {low}" + (f"-{high}" if high and high != low else "+")
        notes.append(f"option: build from source{span}: fdl libtorch build --archs "
                     f'"{resolution.source_arch_list}" (takes hours)')
    if resolution.driver_needed:
        notes.append(f"option: install NVIDIA driver >= {resolution.driver_needed}")
    return tuple(notes)
