"""What a worker's device can train with, decided without torch: the precision a choice becomes
on a device, and whether a backend has the device it needs.

The workers apply these rules to their own device (:mod:`fdl.engine.precision`,
:mod:`fdl.engine.collectives`); ``fdl run`` applies the same functions to the devices it planned
(:mod:`fdl.launch.spec`), so that ``--dry-run`` and the launcher refuse, before anything starts,
what every worker would refuse after the run directory exists. This module imports no torch:
the launcher's planning stays light.
"""

from __future__ import annotations

from fdl.errors import UsageError

BF16_CAPABILITY = (8, 0)  # the first CUDA compute capability with bf16 tensor cores (Ampere)
REDUCED = ("bf16", "fp16")  # the precisions autocast runs in; fp32 runs without it


def precision_on(choice: str, *, device_type: str, capability: tuple[int, int] | None,
                 device: str) -> str:
    """``fp32``, ``bf16`` or ``fp16`` for ``choice`` (``auto`` or one of those) on a device of
    ``device_type`` (``cuda``, ``cpu`` ...) with ``capability`` (CUDA's compute capability;
    None elsewhere), named ``device`` in the error. The rules and why: fdl.engine.precision. A
    choice the device cannot train in is a UsageError saying what it can."""
    if choice not in ("auto", "fp32", *REDUCED):
        raise UsageError(f"unknown precision {choice!r}", hint="use one of: auto, fp32, bf16, fp16")
    if device_type != "cuda":
        if device_type == "cpu" and choice == "fp16":
            raise UsageError("precision fp16 is not supported on the CPU (few CPUs compute "
                             "fp16 faster than fp32)", hint="use bf16 or fp32 on the CPU")
        return "fp32" if choice == "auto" else choice
    assert capability is not None, "a CUDA device has a compute capability"
    has_bf16 = tuple(capability) >= BF16_CAPABILITY
    if choice == "auto":
        return "bf16" if has_bf16 else "fp32"
    if choice == "bf16" and not has_bf16:
        major, minor = capability
        raise UsageError(f"precision bf16 needs a GPU of compute capability 8.0 or newer; "
                         f"{device} has {major}.{minor}",
                         hint="use fp16 or fp32 on this GPU (auto picks fp32 there)")
    return choice


def check_backend(backend: str, *, has_cuda: bool) -> None:
    """``backend`` (``auto``, ``nccl``, ``cpu``) on a worker with or without a CUDA GPU: NCCL
    needs one."""
    if backend == "nccl" and not has_cuda:
        raise UsageError("backend 'nccl' needs a CUDA GPU, and this worker has none",
                         hint="use --backend cpu (or auto)")
