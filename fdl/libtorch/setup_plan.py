"""``fdl setup`` as data: what the host needs, decided before anything is downloaded.

:func:`plan_setup` is pure. Given the GPU survey, the installed torch wheel and the store's
contents it says: which libtorch variant covers every GPU (or that none does, with the options),
whether it is already installed or active, and whether the current Python torch wheel covers
every GPU — with the exact ``pip install`` command (and index URL) when it does not.

Link or download: when the installed torch wheel covers every GPU (``fdl.libtorch.coverage``
decides, as for any build) and ships its libtorch (``lib/``, ``include/``,
``share/cmake/Torch``), the plan links it (``action="link"``, ``python/torch-<version>``: 0
bytes, what ``fdl libtorch link-python`` does) instead of downloading an archive. It downloads
instead when asked (``download=True``, ``--download``), when ``variant`` names a catalog
archive, when ``version`` is not the wheel's, when torch is not installed or broken, and when
the wheel misses a GPU; ``notes`` then says why (naming the GPUs the wheel misses).

The plan carries that command twice over one source: ``torch_install`` as a person reads it and
``pip_argv``, the argv ``fdl setup --install-torch`` runs: the same words after the interpreter
whose torch was checked (``<python> -m pip install ...``), so the wheel lands where it was
found wanting. A source build has no ``pip_argv``: fdl shows it and never runs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fdl.libtorch.catalog import LINUX_X86_64, LibtorchArchive, split_variant
from fdl.libtorch.coverage import advise_builds, check_build
from fdl.libtorch.environments import EnvironmentPlan, plan_environments
from fdl.libtorch.install import ArchiveRequest
from fdl.libtorch.request import archive_request
from fdl.libtorch.resolve import Resolution, resolve_variant
from fdl.libtorch.wheel import CPU_WHEEL, TorchInstall, torch_install
from fdl.system.gpus import GpuSurvey
from fdl.system.torchenv import TorchInfo


@dataclass(frozen=True)
class SetupPlan:
    resolution: Resolution
    action: str  # "link" | "download" | "activate" | "present" | "none"
    archive: LibtorchArchive | None
    torch_covers: bool | None  # None: torch not installed
    torch_install: TorchInstall | None  # the wheel to install when the current one does not fit
    pip_argv: tuple[str, ...] | None  # what --install-torch runs; None: nothing fdl can run
    notes: tuple[str, ...] = ()
    link_python: str | None = None  # the interpreter whose wheel's libtorch is used (linked)
    link_id: str | None = None  # "python/torch-2.13.0+cpu" when the wheel's libtorch is used
    why: str = ""  # one line: why this libtorch (link or download)
    # No single build covers every GPU: one environment per device class, the default proposal
    environments: EnvironmentPlan | None = None

    @property
    def variant_id(self) -> str | None:
        if self.link_id is not None:
            return self.link_id
        return f"precompiled/{self.archive.name}" if self.archive else None

    @property
    def source(self) -> str:
        """Where the libtorch comes from: "wheel" (linked, 0 bytes), "archive" or "none"."""
        return "wheel" if self.link_id else "archive" if self.archive else "none"

    @property
    def download_request(self) -> ArchiveRequest | None:
        """The archive to install when the plan downloads one (the same request, metadata and
        all, as ``fdl libtorch download`` makes for a catalog entry)."""
        if self.action != "download" or self.archive is None:
            return None
        return archive_request(self.archive)


def plan_setup(*, survey: GpuSurvey, torch: TorchInfo, installed: Sequence[str],
               active: str | None, version: str | None = None, variant: str | None = None,
               download: bool = False, platform: str = LINUX_X86_64,
               base: str | None = None, envs_home: Path | None = None,
               fdl_requirement: str = "fdl", env_python: str = "python3",
               torch_index: str | None = None) -> SetupPlan:
    """``variant`` (``"2.11.0-cu128"``) overrides the automatic choice, e.g. to take the
    best-partial option on mixed GPUs; it and ``download`` rule out linking the wheel.
    ``envs_home`` (``$FLODL_HOME``): where environments per device class would live, planned
    when no single build covers every GPU (fdl.libtorch.environments); ``fdl_requirement`` is
    what their ``pip install`` of fdl names, ``env_python`` what makes their venvs and
    ``torch_index`` a mirror of PyTorch's wheel index (``FDL_TORCH_INDEX``)."""
    resolution = resolve_variant(survey, version=version, platform=platform, base=base)
    if variant is not None:
        chosen = split_variant(variant, version=version, platform=platform, base=base)
        resolution = Resolution(chosen, f"{chosen.name} chosen with --variant")
    archive = resolution.archive
    covers, missing, command = _torch_wheel(survey, torch, platform)
    pip_argv = (torch.python, "-m", *command.argv) if command and command.is_wheel else None
    refusal = _no_link_reason(torch, covers=covers, missing=missing, download=download,
                              variant=variant, version=version,
                              instead=": downloading the libtorch archive" if archive else
                              ", and no official libtorch archive does either")
    if refusal is None:
        wanted = f"python/torch-{torch.version}"
        instead = f"downloading {archive.name}" if archive else "a source build"
        why = (f"the installed torch {torch.version} wheel covers {_names(survey)}: linking "
               f"its libtorch (0 bytes) instead of {instead}")
        return SetupPlan(resolution, _action(wanted, installed, active, new="link"), archive,
                         covers, command, pip_argv, (), torch.python, wanted, why)
    action = "none" if archive is None else _action(f"precompiled/{archive.name}", installed,
                                                      active, new="download")
    environments = plan_environments(survey, home=envs_home, fdl_requirement=fdl_requirement,
                                     platform=platform, python=env_python,
                                     index_base=torch_index) \
        if envs_home is not None and archive is None and variant is None else None
    return SetupPlan(resolution, action, archive, covers, command, pip_argv,
                     (*_environment_notes(environments), *_notes(resolution),
                      refusal),
                     why=resolution.reason, environments=environments)


def _environment_notes(plan: EnvironmentPlan | None) -> tuple[str, ...]:
    if plan is None:
        return ()
    return (f"proposed: {plan.summary()} (the environments below; then fdl run "
            f"--worker-python {plan.worker_python()})",
            f"or {plan.train_today()}",
            "C++ (libtorch): one process runs one libtorch, so a C++ program on every GPU "
            "still needs the source build; environments per card serve fdl's Python workers")


def _action(wanted: str, installed: Sequence[str], active: str | None, *, new: str) -> str:
    return "present" if active == wanted else "activate" if wanted in installed else new


def _names(survey: GpuSurvey) -> str:
    if not survey.gpus:
        return "this CPU-only host"
    return " and ".join(f"{g.name} ({g.arch})" for g in survey.gpus)


def _no_link_reason(torch: TorchInfo, *, covers: bool | None, missing: Sequence[str],
                    download: bool, variant: str | None, version: str | None,
                    instead: str) -> str | None:
    """Why the wheel's libtorch is not linked, ending with what the plan does ``instead`` (the
    archive, or nothing when none covers every GPU either); None when it is the one to use."""
    if not torch.installed or torch.error or not torch.version:
        return f"no usable torch wheel to link{instead}"
    if missing:
        return (f"the installed torch {torch.version} wheel does not cover "
                f"{', '.join(missing)}{instead}")
    if not covers:
        return f"the installed torch {torch.version} wheel does not cover every GPU{instead}"
    if not torch.libtorch:
        return (f"the installed torch {torch.version} wheel ships no libtorch "
                f"(lib/, include/, share/cmake/Torch){instead}")
    if download or variant is not None:
        flag = "--download" if download else "--variant"
        return (f"{flag}: downloading although the installed torch {torch.version} wheel "
                "covers every GPU (fdl setup without it links the wheel's libtorch, 0 bytes)")
    if version is not None and torch.version.split("+")[0] != version:
        return f"--version {version}: the installed torch wheel is {torch.version}{instead}"
    return None


def _torch_wheel(survey: GpuSurvey, torch: TorchInfo, platform: str
                 ) -> tuple[bool | None, tuple[str, ...], TorchInstall | None]:
    """Does the wheel cover every GPU, which GPUs it misses, and what to pip-install if not."""
    if not survey.gpus:
        if not torch.installed:
            return None, (), CPU_WHEEL
        return True, (), (CPU_WHEEL if torch.cuda_version else None)
    command = torch_install(advise_builds(survey, platform=platform))
    if not torch.installed or torch.error:
        return None, (), command
    coverage = check_build(survey, label=f"torch {torch.version}", archs=torch.arch_list,
                           cuda=torch.cuda_version)
    missing = tuple(f"{gpu.name} ({gpu.arch})" for gpu in coverage.missing)
    return coverage.covers_all, missing, None if coverage.covers_all else command


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
