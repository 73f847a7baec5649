"""Which CUDA builds run on which GPUs and drivers: real CUDA rules as pure functions.

The rules (NVIDIA's CUDA compatibility guide and the nvcc manual):

* **SASS** (a cubin, ``sm_X.y``) runs on a GPU of compute capability ``X.z`` with ``z >= y``:
  same major version only. ``sm_86`` runs on an 8.9 card; ``sm_90`` does not run on a 12.0 card.
  Architecture-specific cubins (``sm_90a``) run only on exactly ``X.y``; family-specific ones
  (``sm_100f``) on the same major with ``z >= y``.
* **PTX** (``compute_X.y``) is JIT-compiled by the driver for any GPU with capability ``>= X.y``
  (a slow first start, and only when the driver is at least as new as the toolkit that wrote it).
* Nothing runs on a GPU older than the oldest architecture in the build.
* **Driver**: a CUDA runtime ``X.Y`` is fully supported by drivers from that toolkit's release
  on (``CUDA_RELEASE_DRIVERS``); within one major version, older drivers down to the
  minor-version-compatibility floor (``MINOR_COMPAT_FLOOR``) run it too, but cannot JIT its PTX.
* A GPU needs a driver that knows its architecture: at least the release driver of the first
  CUDA toolkit that supports it (``ARCH_FIRST_CUDA``) — a Blackwell card needs a CUDA 12.8 driver.

Nothing here does I/O; ``fdl/libtorch/diagnose.py`` applies these to the survey.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fdl.errors import UsageError

# Minimum driver for each CUDA toolkit release: (Linux x86_64, Windows). From NVIDIA's CUDA
# toolkit release notes, table "CUDA Toolkit and Corresponding Driver Versions" (GA releases).
CUDA_RELEASE_DRIVERS: dict[str, tuple[str, str]] = {
    "11.0": ("450.36.06", "451.22"),
    "11.1": ("455.23", "456.38"),
    "11.2": ("460.27.03", "460.82"),
    "11.3": ("465.19.01", "465.89"),
    "11.4": ("470.42.01", "471.11"),
    "11.5": ("495.29.05", "496.04"),
    "11.6": ("510.39.01", "511.23"),
    "11.7": ("515.43.04", "516.01"),
    "11.8": ("520.61.05", "520.06"),
    "12.0": ("525.60.13", "527.41"),
    "12.1": ("530.30.02", "531.14"),
    "12.2": ("535.54.03", "536.25"),
    "12.3": ("545.23.06", "545.84"),
    "12.4": ("550.54.14", "551.61"),
    "12.5": ("555.42.02", "555.85"),
    "12.6": ("560.28.03", "560.76"),
    "12.8": ("570.26", "570.65"),
    "12.9": ("575.51.03", "576.02"),
    "13.0": ("580.65.06", "580.88"),
    "13.1": ("590.44.01", "591.34"),
    "13.2": ("595.45.04", "595.79"),
}

# Minor-version compatibility: the oldest driver that runs any runtime of that major version.
MINOR_COMPAT_FLOOR: dict[int, tuple[str, str]] = {
    11: ("450.80.02", "452.39"),
    12: ("525.60.13", "528.33"),
    13: ("580.65.06", "580.88"),
}

# First CUDA toolkit that can build for (and whose driver knows) each compute capability.
ARCH_FIRST_CUDA: dict[tuple[int, int], str] = {
    (5, 0): "11.0", (5, 2): "11.0", (5, 3): "11.0", (6, 0): "11.0", (6, 1): "11.0",
    (6, 2): "11.0", (7, 0): "11.0", (7, 2): "11.0", (7, 5): "11.0", (8, 0): "11.0",
    (8, 6): "11.1", (8, 7): "11.4", (8, 9): "11.8", (9, 0): "11.8", (10, 0): "12.8",
    (10, 1): "12.8", (10, 3): "12.9", (11, 0): "13.0", (12, 0): "12.8", (12, 1): "12.9",
}

# The newest toolkit that can still build for an architecture (CUDA 13 dropped sm_50..sm_72).
ARCH_LAST_CUDA: dict[int, str] = {5: "12.9", 6: "12.9"}
_ARCH_LAST_CUDA_EXACT: dict[tuple[int, int], str] = {(7, 0): "12.9", (7, 2): "12.9"}

ARCH_NAMES: dict[int, str] = {
    5: "Maxwell", 6: "Pascal", 7: "Volta/Turing", 8: "Ampere/Ada", 9: "Hopper",
    10: "Blackwell", 11: "Blackwell", 12: "Blackwell",
}


def generation(cc: tuple[int, int]) -> str:
    if cc[0] == 7:
        return "Turing" if cc[1] >= 5 else "Volta"
    if cc[0] == 8:
        return "Ada" if cc[1] >= 9 else "Ampere"
    return ARCH_NAMES.get(cc[0], f"sm_{cc[0]}{cc[1]}")


def version_tuple(text: str) -> tuple[int, ...]:
    """``"570.86.15"`` -> ``(570, 86, 15)``; non-numeric parts end the tuple."""
    parts = []
    for piece in text.strip().split("."):
        match = re.match(r"\d+", piece)
        if not match:
            break
        parts.append(int(match.group()))
    return tuple(parts)


@dataclass(frozen=True, order=True)
class CudaArch:
    """One entry of a build's arch list: SASS ``sm_86`` / ``sm_90a`` or PTX ``compute_120``."""

    major: int
    minor: int
    ptx: bool = False
    suffix: str = ""  # "", "a" (arch-specific) or "f" (family-specific)

    @classmethod
    def parse(cls, text: str) -> CudaArch:
        """Accepts ``sm_61``, ``compute_120``, ``sm_90a`` and TORCH_CUDA_ARCH_LIST's ``6.1``."""
        value = text.strip()
        match = re.fullmatch(r"(sm|compute)_(\d+?)(\d)([af]?)", value)
        if match:
            kind, major, minor, suffix = match.groups()
            return cls(int(major), int(minor), kind == "compute", suffix)
        match = re.fullmatch(r"(\d+)\.(\d)([af]?)", value)
        if match:
            return cls(int(match.group(1)), int(match.group(2)), False, match.group(3))
        raise UsageError(
            f"not a CUDA architecture: {text!r}",
            hint="use sm_XY / compute_XY (e.g. sm_61, compute_120) or X.Y (e.g. 6.1, 12.0+PTX)",
        )

    @property
    def cc(self) -> tuple[int, int]:
        return (self.major, self.minor)

    def __str__(self) -> str:
        return f"{'compute' if self.ptx else 'sm'}_{self.major}{self.minor}{self.suffix}"


def parse_arch_list(value: str | Iterable[str]) -> tuple[CudaArch, ...]:
    """A build's arch list from ``get_arch_list()`` entries or a TORCH_CUDA_ARCH_LIST string.

    ``"6.1;12.0+PTX"`` yields ``sm_61, sm_120, compute_120`` (``+PTX`` adds the PTX twin).
    """
    entries = re.split(r"[;\s,]+", value) if isinstance(value, str) else list(value)
    archs: list[CudaArch] = []
    for entry in filter(None, (item.strip() for item in entries)):
        with_ptx = entry.upper().endswith("+PTX")
        arch = CudaArch.parse(entry[:-4] if with_ptx else entry)
        archs.append(arch)
        if with_ptx:
            archs.append(CudaArch(arch.major, arch.minor, True))
    return tuple(archs)


def torch_cuda_arch_list(ccs: Iterable[tuple[int, int]]) -> str:
    """The TORCH_CUDA_ARCH_LIST that builds SASS for exactly these capabilities: ``6.1;12.0``."""
    return ";".join(f"{major}.{minor}" for major, minor in sorted(set(ccs)))


@dataclass(frozen=True)
class KernelVerdict:
    """Whether a build has kernels for one GPU. ``status``: ok | ptx-jit | missing."""

    status: str
    via: str | None
    reason: str

    @property
    def runs(self) -> bool:
        return self.status != "missing"


def kernel_verdict(cc: tuple[int, int], archs: Sequence[CudaArch]) -> KernelVerdict:
    """Can a build with ``archs`` run on a GPU of compute capability ``cc``, and how."""
    name = f"sm_{cc[0]}{cc[1]}"
    sass = [a for a in archs if not a.ptx and _sass_runs(a, cc)]
    if sass:
        best = max(sass)
        how = "native" if best.cc == cc else f"same-major cubin for {name}"
        return KernelVerdict("ok", str(best), f"{best} ({how})")
    ptx = [a for a in archs if a.ptx and a.cc <= cc]
    if ptx:
        best = max(ptx)
        return KernelVerdict(
            "ptx-jit", str(best),
            f"no {name} cubin; the driver JIT-compiles {best} PTX (slow first start)",
        )
    if not archs:
        return KernelVerdict("missing", None, "a CPU-only build: no CUDA kernels at all")
    listed = ", ".join(str(a) for a in sorted(archs))
    return KernelVerdict(
        "missing", None,
        f"no kernel image for {name}: the build has {listed} (a cubin runs only on its own "
        f"major version, PTX only on newer GPUs)",
    )


def _sass_runs(arch: CudaArch, cc: tuple[int, int]) -> bool:
    if arch.suffix == "a":
        return arch.cc == cc
    return arch.major == cc[0] and arch.minor <= cc[1]


@dataclass(frozen=True)
class DriverVerdict:
    """Whether the driver runs a CUDA runtime or knows a GPU. ``status``: ok | minor-compat |
    too-old | no-driver. ``needed`` is the driver version that would make it ``ok``."""

    status: str
    reason: str
    needed: str | None = None

    @property
    def runs(self) -> bool:
        return self.status in ("ok", "minor-compat")


def release_driver(cuda: str, *, windows: bool = False) -> str | None:
    """The driver NVIDIA released with CUDA ``cuda`` (``"12.8"`` -> ``"570.26"`` on Linux)."""
    key = ".".join(str(part) for part in version_tuple(cuda)[:2])
    floors = CUDA_RELEASE_DRIVERS.get(key)
    return None if floors is None else floors[1 if windows else 0]


def driver_verdict(*, driver_version: str | None, cuda_driver_version: str | None,
                   runtime_cuda: str, windows: bool = False) -> DriverVerdict:
    """Can this driver run a build made with CUDA ``runtime_cuda``?"""
    if not driver_version:
        return DriverVerdict("no-driver", "no NVIDIA driver found", release_driver(runtime_cuda))
    needed = release_driver(runtime_cuda, windows=windows)
    have = version_tuple(driver_version)
    runtime = version_tuple(runtime_cuda)[:2]
    if (cuda_driver_version and version_tuple(cuda_driver_version)[:2] >= runtime) or (
        needed and have >= version_tuple(needed)
    ):
        return DriverVerdict("ok", f"driver {driver_version} supports CUDA {runtime_cuda}")
    floor = MINOR_COMPAT_FLOOR.get(runtime[0])
    if floor and have >= version_tuple(floor[1 if windows else 0]):
        return DriverVerdict(
            "minor-compat",
            f"driver {driver_version} runs CUDA {runtime_cuda} only through minor-version "
            f"compatibility (no PTX JIT); {needed or 'a newer driver'} supports it fully",
            needed,
        )
    return DriverVerdict(
        "too-old",
        f"driver {driver_version} is too old for CUDA {runtime_cuda} (needs >= {needed})",
        needed,
    )


def gpu_driver_verdict(cc: tuple[int, int], *, driver_version: str | None,
                       windows: bool = False) -> DriverVerdict:
    """Does the driver know this GPU's architecture at all?"""
    first = ARCH_FIRST_CUDA.get(cc)
    needed = release_driver(first, windows=windows) if first else None
    if not driver_version:
        return DriverVerdict("no-driver", "no NVIDIA driver found", needed)
    if needed and version_tuple(driver_version) < version_tuple(needed):
        return DriverVerdict(
            "too-old",
            f"{generation(cc)} (sm_{cc[0]}{cc[1]}) needs a driver for CUDA >= {first}, "
            f"i.e. >= {needed}; found {driver_version}",
            needed,
        )
    return DriverVerdict("ok", f"driver {driver_version} supports sm_{cc[0]}{cc[1]}")


def source_build_cuda_range(ccs: Iterable[tuple[int, int]]) -> tuple[str, str | None] | None:
    """The CUDA toolkits that can compile for every capability: ``("12.8", "12.9")``.

    ``None`` when no single toolkit can (the newest arch needs a toolkit that dropped the
    oldest); the upper bound is ``None`` when no toolkit has dropped any of them yet.
    """
    ccs = list(ccs)
    lows = [ARCH_FIRST_CUDA.get(cc, "13.0") for cc in ccs]
    highs = [h for h in (_ARCH_LAST_CUDA_EXACT.get(cc) or ARCH_LAST_CUDA.get(cc[0]) for cc in ccs) if h]
    low = max(lows, key=version_tuple)
    high = min(highs, key=version_tuple) if highs else None
    if high and version_tuple(high) < version_tuple(low):
        return None
    return (low, high)
