"""Official PyTorch CUDA builds and the GPU architectures each one carries (data, no I/O).

Sources (checked 2026-11; confirm per release):
* pytorch/pytorch ``RELEASE.md`` "Release Compatibility Matrix" and "PyTorch CUDA Support
  Matrix": 2.12-2.14 publish CUDA 12.6 (Maxwell 5.0 ... Hopper 9.0) and CUDA 13.0 / 13.2
  (Turing 7.5 ... Blackwell 10.0, 12.0, plus compute_120 PTX on Linux builds only); 2.10-2.11
  publish CUDA 12.6, 12.8 and 13.0.
* ``torch.cuda.get_arch_list()`` as measured by users (pytorch/pytorch#182250): 2.11 cu126 =
  sm_50..sm_90; 2.11 cu128 = sm_75..sm_120; 2.10 cu128 = sm_70..sm_120.

The 2.15 release (2026-10-28) is not listed yet: its matrix was not in the sources above.
"""

from __future__ import annotations

from dataclasses import dataclass

LINUX_X86_64 = "linux-x86_64"
WINDOWS_X86_64 = "windows-x86_64"

_CU126 = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")
_TURING_TO_BLACKWELL = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120")
_CU128_WITH_VOLTA = ("sm_70", *_TURING_TO_BLACKWELL)


@dataclass(frozen=True)
class OfficialBuild:
    """One published torch/libtorch build: ``version`` + ``variant`` on one platform."""

    version: str
    variant: str  # "cu126", "cu130", ...
    cuda: str  # "12.6"
    archs: tuple[str, ...]  # as torch.cuda.get_arch_list() reports them
    platform: str = LINUX_X86_64
    experimental: bool = False

    @property
    def label(self) -> str:
        return f"torch {self.version}+{self.variant}"

    @property
    def wheel_index_url(self) -> str:
        return f"https://download.pytorch.org/whl/{self.variant}"


def _release(version: str, variants: dict[str, tuple[tuple[str, ...], bool]]) -> list[OfficialBuild]:
    builds = []
    for platform in (LINUX_X86_64, WINDOWS_X86_64):
        for variant, (archs, experimental) in variants.items():
            cuda = f"{variant[2:-1]}.{variant[-1]}"
            # CUDA 13 builds add compute_120 PTX, on Linux only.
            ptx = ("compute_120",) if platform == LINUX_X86_64 and int(variant[2:]) >= 130 else ()
            builds.append(OfficialBuild(version, variant, cuda, archs + ptx, platform, experimental))
    return builds


# Newest first: the first build that covers every GPU is the one to recommend.
OFFICIAL_BUILDS: tuple[OfficialBuild, ...] = tuple(
    _release("2.14.0", {"cu130": (_TURING_TO_BLACKWELL, False),
                        "cu132": (_TURING_TO_BLACKWELL, False),
                        "cu126": (_CU126, False)})
    + _release("2.13.0", {"cu130": (_TURING_TO_BLACKWELL, False),
                          "cu126": (_CU126, False),
                          "cu132": (_TURING_TO_BLACKWELL, True)})
    + _release("2.12.0", {"cu130": (_TURING_TO_BLACKWELL, False),
                          "cu126": (_CU126, False),
                          "cu132": (_TURING_TO_BLACKWELL, True)})
    + _release("2.11.0", {"cu130": (_TURING_TO_BLACKWELL, False),
                          "cu128": (_TURING_TO_BLACKWELL, False),
                          "cu126": (_CU126, False)})
    + _release("2.10.0", {"cu128": (_CU128_WITH_VOLTA, False),
                          "cu126": (_CU126, False),
                          "cu130": (_TURING_TO_BLACKWELL, True)})
)


def official_builds(*, platform: str = LINUX_X86_64, version: str | None = None,
                    include_experimental: bool = True) -> tuple[OfficialBuild, ...]:
    """The catalog filtered by platform and (optionally) exact version, newest first."""
    return tuple(
        build for build in OFFICIAL_BUILDS
        if build.platform == platform
        and (version is None or build.version == version)
        and (include_experimental or not build.experimental)
    )


def latest_version() -> str:
    return OFFICIAL_BUILDS[0].version
