"""The GPU survey's data: ``GpuInfo`` (one GPU), ``GpuSurvey`` (what a survey found) and the
compute-capability parser every source shares.

A leaf below both survey sources: :mod:`fdl.system.gpus` (NVML, nvidia-smi, and
CUDA_VISIBLE_DEVICES) and :mod:`fdl.system.gpu_fixture` (the ``FDL_GPU_SURVEY`` test seam) build
these, and ``gpus`` reads the fixture through ``gpu_fixture``, so the types live here to keep
that dependency one-way. Import them from :mod:`fdl.system.gpus`, the survey's public face.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_CC_RE = re.compile(r"^\s*(\d+)\.(\d+)\s*$")


@dataclass(frozen=True)
class GpuInfo:
    """One NVIDIA GPU; ``index`` is its CUDA ordinal after CUDA_VISIBLE_DEVICES (PCI order)."""

    index: int
    name: str
    compute_capability: tuple[int, int]
    memory_mib: int | None = None
    uuid: str | None = None
    pci_bus_id: str | None = None

    @property
    def arch(self) -> str:
        """The SASS target name nvcc and torch use: ``"sm_61"``, ``"sm_120"``."""
        major, minor = self.compute_capability
        return f"sm_{major}{minor}"

    @property
    def cc(self) -> str:
        """The compute capability as NVIDIA writes it: ``"6.1"``, ``"12.0"``."""
        major, minor = self.compute_capability
        return f"{major}.{minor}"


@dataclass(frozen=True)
class GpuSurvey:
    """What ``probe_gpus`` found, where it came from, and ``notes`` explaining anything missing."""

    source: str
    gpus: tuple[GpuInfo, ...]
    driver_version: str | None
    cuda_driver_version: str | None
    notes: tuple[str, ...] = ()
    visible_devices: str | None = None


def parse_compute_capability(text: str) -> tuple[int, int] | None:
    """``"8.6"`` -> ``(8, 6)``; None for text that is not ``MAJOR.MINOR``."""
    match = _CC_RE.match(text)
    return (int(match.group(1)), int(match.group(2))) if match else None
