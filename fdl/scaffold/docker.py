"""The torch wheel and CUDA base image of the Dockerfile that ``fdl init`` writes.

Chosen once, when the project is rendered, by the rules of ``fdl setup`` and ``fdl diagnose``
(:func:`fdl.libtorch.coverage.advise_builds`): the official build recommended for this host's
GPUs, so the image runs here. A host without a GPU (a laptop, a CI runner) gets
``DEFAULT_VARIANT`` of the newest release in the catalog; when no official build covers every
GPU, the one covering the most. The base image is NVIDIA's CUDA runtime image for the wheel's
CUDA version: the wheel brings its own CUDA libraries, and the base sets what the NVIDIA
container toolkit reads (NVIDIA_VISIBLE_DEVICES, and NVIDIA_REQUIRE_CUDA, which turns a host
driver too old for that CUDA into a clear error at ``docker run``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fdl.libtorch.catalog import OfficialBuild, latest_version, official_builds
from fdl.libtorch.coverage import BuildCoverage, advise_builds
from fdl.system.gpus import GpuSurvey, probe_gpus

# CUDA X.Y of a torch wheel -> the nvidia/cuda runtime image tag X.Y.Z (the last patch release
# published for ubuntu22.04). Every CUDA version in fdl.libtorch.catalog needs an entry (tested).
CUDA_IMAGE_TAGS = {"12.6": "12.6.3", "12.8": "12.8.1", "13.0": "13.0.0", "13.2": "13.2.0"}
# No GPU to decide by: CUDA 13.0 is the newest CUDA that every release since 2.12 ships as a
# stable build, and it covers Turing through Blackwell.
DEFAULT_VARIANT = "cu130"


@dataclass(frozen=True)
class TorchImage:
    """What the Dockerfile installs, and why (one line, shown by ``fdl init`` and in the file)."""

    torch_version: str
    variant: str
    cuda: str
    index_url: str
    reason: str

    @property
    def base_image(self) -> str:
        return f"nvidia/cuda:{CUDA_IMAGE_TAGS[self.cuda]}-runtime-ubuntu22.04"


def probe_torch_image(*, env: Mapping[str, str] | None = None) -> TorchImage:
    """Survey this host's GPUs (``FDL_GPU_SURVEY`` and ``CUDA_VISIBLE_DEVICES`` honoured)."""
    return choose_torch_image(probe_gpus(env=env))


def choose_torch_image(survey: GpuSurvey) -> TorchImage:
    """The recommended build for ``survey``'s GPUs, else the best partial one, else the default."""
    if not survey.gpus:
        return _image(default_build(), "no GPU found here: the newest stable CUDA build")
    advice = advise_builds(survey)
    names = ", ".join(f"{gpu.name} ({gpu.arch})" for gpu in survey.gpus)
    if advice.recommended is not None:
        return _image(_build_of(advice.recommended), f"covers every GPU here: {names}")
    if advice.best_partial is not None:
        missing = ", ".join(f"{gpu.name} ({gpu.arch})" for gpu in advice.best_partial.missing)
        return _image(_build_of(advice.best_partial),
                      f"no official build covers every GPU here; this one misses {missing} "
                      "(`fdl setup` plans a source build)")
    return _image(default_build(), "no official build runs on this host's GPUs "
                                   "(`fdl diagnose` says why): the newest stable CUDA build")


def default_build() -> OfficialBuild:
    stable = [build for build in official_builds(version=latest_version())
              if not build.experimental]
    return next((build for build in stable if build.variant == DEFAULT_VARIANT), stable[0])


def _build_of(coverage: BuildCoverage) -> OfficialBuild:
    return next(build for build in official_builds() if build.label == coverage.label)


def _image(build: OfficialBuild, reason: str) -> TorchImage:
    return TorchImage(build.version, build.variant, build.cuda, build.wheel_index_url, reason)
