"""The Dockerfile's torch wheel and base image, decided from the GPU survey as `fdl setup` does."""

from __future__ import annotations

from helpers import GPU_FIXTURES

from fdl.libtorch.catalog import OFFICIAL_BUILDS, latest_version
from fdl.libtorch.coverage import advise_builds
from fdl.libtorch.diagnose import install_command
from fdl.scaffold.docker import CUDA_IMAGE_TAGS, probe_torch_image
from fdl.system.gpus import probe_gpus


def image_for(fixture: str):
    return probe_torch_image(env={"FDL_GPU_SURVEY": str(GPU_FIXTURES / f"{fixture}.json")})


def test_no_gpu_gets_cu130_of_the_newest_release():
    image = image_for("none")
    assert (image.torch_version, image.variant) == (latest_version(), "cu130")
    assert image.index_url == "https://download.pytorch.org/whl/cu130"
    assert image.base_image == "nvidia/cuda:13.0.0-runtime-ubuntu22.04"
    assert image.reason.startswith("no GPU found here")


def test_a_gpu_gets_the_wheel_fdl_setup_recommends():
    for fixture, base in (("rtx4090", "12.6.3"), ("h100", "13.0.0")):
        image = image_for(fixture)
        survey = probe_gpus(env={"FDL_GPU_SURVEY": str(GPU_FIXTURES / f"{fixture}.json")})
        command = install_command(advise_builds(survey))
        assert f"'torch=={image.torch_version}' --index-url {image.index_url}" in command
        assert image.base_image == f"nvidia/cuda:{base}-runtime-ubuntu22.04"
        assert image.reason.startswith("covers every GPU here")


def test_mixed_gpus_no_build_covers_get_the_best_partial_and_say_what_is_missing():
    image = image_for("gtx1060_rtx5060ti")
    assert (image.torch_version, image.variant) == ("2.11.0", "cu128")
    assert image.base_image == "nvidia/cuda:12.8.1-runtime-ubuntu22.04"
    assert "GTX 1060 6GB (sm_61)" in image.reason and "fdl setup" in image.reason


def test_a_driver_too_old_for_every_build_falls_back_to_the_default():
    image = image_for("old_driver_rtx5060ti")
    assert image.variant == "cu130" and "fdl diagnose" in image.reason


def test_every_cuda_version_in_the_catalog_has_a_base_image():
    assert {build.cuda for build in OFFICIAL_BUILDS} <= set(CUDA_IMAGE_TAGS)
