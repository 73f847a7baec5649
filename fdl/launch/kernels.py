"""Before any worker starts on a GPU: has the torch it will run a kernel for that GPU?

A worker on a GTX 1060 (sm_61) under a cu128 wheel (sm_75 and up) would fail at its first
CUDA call with "no kernel image is available", after the rendezvous, with the other workers
waiting. So, for GPU workers only (a CPU run pays nothing):

* :func:`probe_builds` (the probe, run by :func:`fdl.launch.plan_run`) asks each interpreter
  the workers will run under (the launcher's, and those ``--worker-python`` or the device map
  names) for its torch build, in a subprocess (fdl.system.torchenv: the release, CUDA and NCCL
  versions, ``torch.cuda.get_arch_list()``); each interpreter once per process (``fdl compare``
  plans many runs);
* :func:`kernel_problems` (pure) checks each worker's GPU against its build with the rules
  ``fdl diagnose`` applies (fdl.system.compat: SASS or PTX, the driver's floors) and returns a
  :class:`KernelProblem` per worker that cannot run, with its :class:`Refusal`;
* :func:`shared_nccl` (pure) says whether the builds carry one and the same NCCL.

:func:`fdl.launch.spec.build_launch_spec` decides with them: a run with a problem is refused
before anything starts (``--dry-run`` shows the check), and workers under several environments
that share one NCCL keep the usual backend.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fdl.system.compat import driver_verdict, gpu_driver_verdict, kernel_verdict, parse_arch_list
from fdl.system.gpus import GpuInfo, GpuSurvey
from fdl.system.torchenv import TorchInfo, probe_torch

if TYPE_CHECKING:
    from fdl.launch.devices import DevicePlan


@functools.lru_cache(maxsize=16)
def _probe_once(python: str) -> TorchInfo:
    return probe_torch(python=python, peers=False)  # the build is what is checked


def probe_builds(pythons: Mapping[int, str], *,
                 probe: Callable[[str], TorchInfo] = _probe_once) -> dict[str, TorchInfo]:
    """Each interpreter's torch build, probed at once (once per interpreter and process)."""
    paths = sorted(set(pythons.values()))
    with ThreadPoolExecutor(max_workers=max(1, len(paths))) as pool:
        return dict(zip(paths, pool.map(probe, paths), strict=True))


def shared_nccl(builds: Mapping[str, TorchInfo]) -> str | None:
    """The NCCL every build carries when it is one and the same (None otherwise): several
    environments may then still average over NCCL."""
    versions = {info.nccl_version for info in builds.values()}
    only = versions.pop() if len(versions) == 1 else None
    return only or None


class Refusal(enum.Enum):
    """Why a worker's torch build cannot run on its GPU."""

    NO_TORCH = "no usable torch"  # the probe failed, or torch is not installed
    CPU_ONLY = "a CPU-only build"
    NO_KERNEL = "no kernel for the GPU"  # neither a cubin of its major version nor older PTX
    GPU_UNKNOWN_TO_DRIVER = "the driver predates the GPU's architecture"
    DRIVER_TOO_OLD = "the driver is too old for the build's CUDA"


@dataclass(frozen=True)
class KernelProblem:
    """A local worker whose torch build cannot run on its GPU, and why."""

    local_rank: int
    gpu: GpuInfo
    python: str  # the interpreter the worker runs under
    refusal: Refusal
    torch: str | None = None  # the build's version (None: no usable torch)
    detail: str | None = None  # the probe's error, or fdl.system.compat's reason

    @property
    def message(self) -> str:
        """One line naming the worker, its GPU, the torch and why."""
        where = (f"local rank {self.local_rank} (GPU {self.gpu.index} {self.gpu.name}, "
                 f"{self.gpu.arch})")
        if self.refusal is Refusal.NO_TORCH:
            return f"{where}: no usable torch under {self.python}" + (
                f" ({self.detail})" if self.detail else "")
        if self.refusal is Refusal.CPU_ONLY:
            return f"{where}: torch {self.torch} under {self.python} is a CPU-only build"
        return f"{where}: torch {self.torch} under {self.python} cannot run on it ({self.detail})"


def kernel_problems(devices: DevicePlan, survey: GpuSurvey, pythons: Mapping[int, str],
                    builds: Mapping[str, TorchInfo]) -> tuple[KernelProblem, ...]:
    """Each local worker whose torch cannot run on its GPU (none for CPU workers). Pure.
    ``pythons``: each local rank's interpreter; ``builds``: what :func:`probe_builds` found."""
    if devices.kind != "cuda":
        return ()
    problems = []
    for rank, gpu in enumerate(devices.gpus):
        python = pythons[rank]
        info = builds[python]
        if info.error or not info.installed:
            problems.append(KernelProblem(rank, gpu, python, Refusal.NO_TORCH,
                                          detail=info.error))
        elif not info.cuda_version:
            problems.append(KernelProblem(rank, gpu, python, Refusal.CPU_ONLY, info.version))
        else:
            why = _why_not(gpu, info, survey)
            if why is not None:
                problems.append(KernelProblem(rank, gpu, python, why[0], info.version, why[1]))
    return tuple(problems)


def _why_not(gpu: GpuInfo, info: TorchInfo, survey: GpuSurvey) -> tuple[Refusal, str] | None:
    """Why ``info``'s CUDA build cannot run on ``gpu`` with this driver (None: it can), by the
    rules fdl diagnose applies (fdl.system.compat)."""
    kernel = kernel_verdict(gpu.compute_capability, parse_arch_list(list(info.arch_list)))
    if not kernel.runs:
        return Refusal.NO_KERNEL, kernel.reason
    known = gpu_driver_verdict(gpu.compute_capability, driver_version=survey.driver_version)
    if known.status == "too-old":
        return Refusal.GPU_UNKNOWN_TO_DRIVER, known.reason
    runtime = driver_verdict(driver_version=survey.driver_version,
                             cuda_driver_version=survey.cuda_driver_version,
                             runtime_cuda=str(info.cuda_version))
    return (Refusal.DRIVER_TOO_OLD, runtime.reason) if runtime.status == "too-old" else None
