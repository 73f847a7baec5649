"""Before any worker starts on a GPU: has the torch it will run a kernel for that GPU?

A worker on a GTX 1060 (sm_61) under a cu128 wheel (sm_75 and up) would fail at its first
CUDA call with "no kernel image is available", after the rendezvous, with the other workers
waiting. ``fdl run`` asks each interpreter its workers will run under (its own, and those
``--worker-python`` names) for its torch build, in a subprocess (fdl.system.torchenv: the
release, CUDA version and ``torch.cuda.get_arch_list()``), and checks each worker's GPU against
it with the rules ``fdl diagnose`` applies (fdl.system.compat: SASS or PTX, the driver's
floors). A worker that cannot run is refused before anything starts; ``--dry-run`` shows the
check. Only for GPU workers: a CPU run pays nothing. Each interpreter is asked once per process
(``fdl compare`` plans many runs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
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


def kernel_problems(devices: DevicePlan, survey: GpuSurvey, pythons: Mapping[int, str],
                    builds: Mapping[str, TorchInfo]) -> tuple[str, ...]:
    """One line per local worker whose torch cannot run on its GPU (none for CPU workers).
    ``pythons``: each local rank's interpreter; ``builds``: what :func:`probe_builds` found."""
    if devices.kind != "cuda":
        return ()
    problems = []
    for rank, gpu in enumerate(devices.gpus):
        python = pythons[rank]
        info, where = builds[python], f"local rank {rank} (GPU {gpu.index} {gpu.name}, {gpu.arch})"
        if info.error or not info.installed:
            problems.append(f"{where}: no usable torch under {python}"
                            + (f" ({info.error})" if info.error else ""))
        elif not info.cuda_version:
            problems.append(f"{where}: torch {info.version} under {python} is a CPU-only build")
        else:
            reason = _why_not(gpu, info, survey)
            if reason is not None:
                problems.append(f"{where}: torch {info.version} under {python} cannot run on "
                                f"it ({reason})")
    return tuple(problems)


def _why_not(gpu: GpuInfo, info: TorchInfo, survey: GpuSurvey) -> str | None:
    """Why ``info``'s CUDA build cannot run on ``gpu`` with this driver (None: it can), by the
    rules fdl diagnose applies (fdl.system.compat)."""
    kernel = kernel_verdict(gpu.compute_capability, parse_arch_list(list(info.arch_list)))
    if not kernel.runs:
        return kernel.reason
    known = gpu_driver_verdict(gpu.compute_capability, driver_version=survey.driver_version)
    if known.status == "too-old":
        return known.reason
    runtime = driver_verdict(driver_version=survey.driver_version,
                             cuda_driver_version=survey.cuda_driver_version,
                             runtime_cuda=str(info.cuda_version))
    return runtime.reason if runtime.status == "too-old" else None
