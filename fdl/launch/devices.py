"""Which devices the workers of one node use: one per visible GPU, else CPU workers.

* GPUs: one worker per visible GPU (``CUDA_VISIBLE_DEVICES`` honoured by the survey), or the
  ones ``--devices 0,2`` picks (indices among the visible GPUs). Workers see exactly the chosen
  GPUs, in local-rank order, with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so CUDA's numbering matches
  NVML's: local rank r trains on ``cuda:r`` even when the GPUs differ.
* No GPU (or ``--nproc-per-node cpu``): ``--nproc-per-node`` CPU workers (default 2), each with
  ``OMP_NUM_THREADS`` set to its share of the cores — torchrun's default of 1 thread throttles
  CPU training.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from fdl.engine.device_rules import check_backend, precision_on
from fdl.errors import UsageError
from fdl.system.gpus import GpuInfo, GpuSurvey

DEFAULT_CPU_WORKERS = 2


@dataclass(frozen=True)
class DevicePlan:
    kind: str  # "cuda" | "cpu"
    nproc: int
    gpus: tuple[GpuInfo, ...]  # one per local rank when kind == "cuda"
    threads_per_worker: int
    cuda_visible_devices: str | None  # what workers see (None: leave the variable alone)
    reason: str

    def device_name(self, local_rank: int) -> str:
        return f"cuda:{local_rank}" if self.kind == "cuda" else "cpu"

    def describe(self, local_rank: int) -> str:
        if self.kind == "cuda":
            gpu = self.gpus[local_rank]
            return f"cuda:{local_rank} {gpu.name} ({gpu.arch})"
        return f"cpu ({self.threads_per_worker} threads)"


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity where the OS has one (``taskset``, a
    container's cpuset, a batch scheduler's allocation), else every logical core. Workers and
    their threads are planned on these, never on cores the node cannot give them."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def plan_devices(*, survey: GpuSurvey, devices: str | None, nproc: int | str | None,
                 logical_cores: int, env: Mapping[str, str]) -> DevicePlan:
    """Decide the local workers' devices. Raises UsageError for impossible requests."""
    if nproc == "gpu" and not survey.gpus:
        raise UsageError("--nproc-per-node gpu asks for one worker per GPU, and no NVIDIA GPU "
                         "was found", hint="use --nproc-per-node N or cpu; `fdl diagnose` "
                                           "says why no GPU is visible")
    if nproc == "cpu" or (not survey.gpus and devices is None):
        count = logical_cores if nproc == "cpu" else (nproc if isinstance(nproc, int)
                                                      else DEFAULT_CPU_WORKERS)
        why = "no NVIDIA GPU" if not survey.gpus else "--nproc-per-node cpu"
        return DevicePlan("cpu", count, (), max(1, logical_cores // count), None,
                          f"{why}: {count} CPU workers")
    chosen = _chosen_gpus(survey, devices)
    if isinstance(nproc, int):
        if nproc > len(chosen):
            raise UsageError(f"--nproc-per-node {nproc} asks for more workers than GPUs "
                             f"({len(chosen)} visible)",
                             hint="one worker per GPU; use --nproc-per-node cpu for CPU workers")
        chosen = chosen[:nproc]
    return DevicePlan("cuda", len(chosen), chosen, max(1, logical_cores // len(chosen)),
                      ",".join(_visible_token(gpu, env) for gpu in chosen),
                      f"{len(chosen)} GPU worker(s)")


def check_devices(devices: DevicePlan, *, backend: str, precision: tuple[str, ...],
                  one_node: bool) -> None:
    """What each local worker's engine would refuse on the device planned for it, refused now
    with the engine's own rules (fdl.engine.device_rules): ``nccl`` without a GPU, a precision
    its device cannot train in. ``precision`` is the setting (one choice, or one per rank); a
    choice per rank is checked on ``one_node`` only, where the rank is the local rank."""
    check_backend(backend, has_cuda=devices.kind == "cuda")
    if len(precision) > 1 and not one_node:
        return
    for local_rank in range(devices.nproc):
        choice = precision[0] if len(precision) == 1 else precision[local_rank]
        capability = devices.gpus[local_rank].compute_capability if devices.kind == "cuda" \
            else None
        precision_on(choice, device_type=devices.kind, capability=capability,
                     device=devices.describe(local_rank))


def _chosen_gpus(survey: GpuSurvey, devices: str | None) -> tuple[GpuInfo, ...]:
    if devices is None:
        return survey.gpus
    visible = ", ".join(str(gpu.index) for gpu in survey.gpus) or "none"
    try:
        indices = [int(part) for part in devices.split(",") if part.strip()]
    except ValueError:
        indices = []
    if not indices or len(set(indices)) != len(indices):
        raise UsageError(f"--devices {devices!r} is not a list of distinct GPU indices",
                         hint=f"e.g. --devices 0,1 (visible GPUs: {visible})")
    by_index = {gpu.index: gpu for gpu in survey.gpus}
    for index in indices:
        if index not in by_index:
            raise UsageError(f"--devices names GPU {index}, which does not exist "
                             f"(visible GPUs: {visible})",
                             hint="`fdl diagnose` lists the GPUs")
    return tuple(by_index[index] for index in indices)


def _visible_token(gpu: GpuInfo, env: Mapping[str, str]) -> str:
    """How to name ``gpu`` in the workers' CUDA_VISIBLE_DEVICES: its UUID, else its index
    among the GPUs the parent's CUDA_VISIBLE_DEVICES already exposes."""
    if gpu.uuid:
        return gpu.uuid
    parent = [p.strip() for p in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if p.strip()]
    return parent[gpu.index] if gpu.index < len(parent) else str(gpu.index)
