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


# --- libtorch archives (download.pytorch.org) --------------------------------------------------
# URL patterns (pytorch.org "Get started" LibTorch links; seen for 2.0 through 2.14.1):
#   Linux x86_64   <base>/<variant>/libtorch-shared-with-deps-<ver>%2B<variant>.zip
#   Windows x86_64 <base>/<variant>/libtorch-win-shared-with-deps-<ver>%2B<variant>.zip
#   macOS arm64    <base>/cpu/libtorch-macos-arm64-<ver>.zip            (CPU only)
# No checksums are published beside them: fdl records the sha256 it computed while downloading
# and checks one given with --sha256. ROCm archives are listed for the releases whose matrix
# names a ROCm version (uncertain for libtorch; a 404 says so). Linux aarch64 has no libtorch
# archive on download.pytorch.org: use `fdl libtorch link-python` with an aarch64 torch wheel.
DEFAULT_BASE_URL = "https://download.pytorch.org/libtorch"
MACOS_ARM64 = "macos-arm64"
MIRROR_ENV = "FDL_LIBTORCH_MIRROR"
_ROCM = {"2.13.0": "rocm7.2", "2.12.0": "rocm7.2", "2.11.0": "rocm7.2", "2.10.0": "rocm7.1"}


@dataclass(frozen=True)
class LibtorchArchive:
    """One downloadable libtorch: ``<version>-<variant>`` for a platform."""

    version: str
    variant: str  # "cpu", "cu130", "rocm7.2"
    platform: str
    url: str
    cuda: str | None
    archs: tuple[str, ...]
    experimental: bool = False

    @property
    def name(self) -> str:
        return f"{self.version}-{self.variant}"

    @property
    def min_driver(self) -> str | None:
        """The driver NVIDIA released with this CUDA (full support, PTX JIT included)."""
        if self.cuda is None:
            return None
        from fdl.system.compat import release_driver

        return release_driver(self.cuda, windows=self.platform == WINDOWS_X86_64)


def libtorch_url(version: str, variant: str, platform: str, *, base: str | None = None) -> str:
    base = (base or DEFAULT_BASE_URL).rstrip("/")
    if platform == MACOS_ARM64:
        return f"{base}/cpu/libtorch-macos-arm64-{version}.zip"
    prefix = "libtorch-win-shared-with-deps" if platform == WINDOWS_X86_64 \
        else "libtorch-shared-with-deps"
    return f"{base}/{variant}/{prefix}-{version}%2B{variant}.zip"


def libtorch_archives(*, platform: str = LINUX_X86_64, version: str | None = None,
                      base: str | None = None) -> tuple[LibtorchArchive, ...]:
    """Every archive of the catalog for ``platform`` (newest first), CPU and ROCm included."""
    versions = sorted({b.version for b in OFFICIAL_BUILDS}, key=_version_key, reverse=True)
    archives: list[LibtorchArchive] = []
    for ver in versions if version is None else [version]:
        cuda = [] if platform == MACOS_ARM64 else official_builds(platform=platform, version=ver)
        for build in cuda:
            archives.append(LibtorchArchive(ver, build.variant, platform,
                                            libtorch_url(ver, build.variant, platform, base=base),
                                            build.cuda, build.archs, build.experimental))
        if platform == LINUX_X86_64 and ver in _ROCM:
            archives.append(LibtorchArchive(ver, _ROCM[ver], platform,
                                            libtorch_url(ver, _ROCM[ver], platform, base=base),
                                            None, ()))
        archives.append(LibtorchArchive(ver, "cpu", platform,
                                        libtorch_url(ver, "cpu", platform, base=base), None, ()))
    return tuple(archives)


def find_archive(*, version: str, variant: str, platform: str = LINUX_X86_64,
                 base: str | None = None) -> LibtorchArchive:
    """The catalog entry for ``version``/``variant``; a usage error listing what exists."""
    from fdl.errors import UsageError

    known = libtorch_archives(platform=platform, base=base)
    for archive in known:
        if archive.version == version and archive.variant == variant:
            return archive
    versions = sorted({a.version for a in known}, key=_version_key)
    variants = sorted({a.variant for a in known if a.version == version})
    if not variants:
        raise UsageError(f"libtorch {version} is not in the catalog for {platform}",
                         hint=f"known versions: {', '.join(versions)}; or pass --url")
    raise UsageError(f"libtorch {version} has no variant {variant!r} for {platform}",
                     hint=f"variants of {version}: {', '.join(variants)}")


def split_variant(text: str, *, version: str | None, platform: str = LINUX_X86_64,
                  base: str | None = None) -> LibtorchArchive:
    """``--variant`` as every command takes it: ``2.11.0-cu128`` (a release and its variant:
    what fdl prints), or ``cu128`` with ``--version`` or, without one, the newest release that
    publishes it. A usage error for a release and a ``--version`` that differ, or an unknown
    one (naming what exists)."""
    from fdl.errors import UsageError

    named, sep, variant = text.strip().partition("-")
    if sep and named[:1].isdigit():
        if version is not None and version != named:
            raise UsageError(f"--variant {text} names release {named}, --version {version}",
                             hint="give one of them: --variant 2.11.0-cu128, or --variant "
                                  "cu128 --version 2.11.0")
        return find_archive(version=named, variant=variant, platform=platform, base=base)
    variant = text.strip()
    if version is None:
        newest = next((a.version for a in libtorch_archives(platform=platform, base=base)
                       if a.variant == variant), None)
        version = newest or latest_version()
    return find_archive(version=version, variant=variant, platform=platform, base=base)


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".") if part.isdigit())
