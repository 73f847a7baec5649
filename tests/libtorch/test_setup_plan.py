"""fdl setup's plan (pure): which variant, whether to download or activate, the torch wheel
and the exact argv that installs it."""

from __future__ import annotations

import shlex

from helpers import GPU_FIXTURES

from fdl.libtorch.catalog import find_archive
from fdl.libtorch.request import DownloadAsk, resolve_download
from fdl.libtorch.setup_plan import plan_setup
from fdl.system.gpu_fixture import load_survey_fixture
from fdl.system.torchenv import TorchInfo

CPU_TORCH = TorchInfo(installed=True, python="/venv/bin/python", version="2.13.0+cpu")
NO_TORCH = TorchInfo(installed=False, python="/venv/bin/python")


def cuda_torch(version: str, variant: str) -> TorchInfo:
    archive = find_archive(version=version, variant=variant)
    return TorchInfo(installed=True, python="/venv/bin/python", version=f"{version}+{variant}",
                     cuda_version=archive.cuda, arch_list=archive.archs)


def plan(fixture: str, torch: TorchInfo = CPU_TORCH, installed=(), active=None, **kwargs):
    survey = load_survey_fixture(GPU_FIXTURES / f"{fixture}.json")
    return plan_setup(survey=survey, torch=torch, installed=list(installed), active=active,
                      **kwargs)


def test_cpu_host_downloads_the_cpu_variant_and_keeps_the_cpu_wheel():
    result = plan("none", version="2.13.0")
    assert result.action == "download" and result.variant_id == "precompiled/2.13.0-cpu"
    assert result.torch_covers is True
    assert result.torch_install is None and result.pip_argv is None


def test_the_download_is_the_request_fdl_libtorch_download_makes():
    result = plan("none", version="2.13.0")
    asked = resolve_download(DownloadAsk(cpu=True, version="2.13.0"), base=None)
    assert result.download_request == asked.request
    assert plan("none", version="2.13.0", installed=[result.variant_id]).download_request is None


def test_already_installed_is_activated_and_active_is_present():
    wanted = "precompiled/2.13.0-cpu"
    assert plan("none", version="2.13.0", installed=[wanted]).action == "activate"
    assert plan("none", version="2.13.0", installed=[wanted], active=wanted).action == "present"


def test_gpu_host_with_cpu_wheel_gets_the_exact_pip_command():
    result = plan("rtx4090")
    assert result.archive.name == "2.14.0-cu126"
    assert result.torch_covers is False
    assert str(result.torch_install) == ("pip install --force-reinstall 'torch==2.14.0' "
                                         "--index-url https://download.pytorch.org/whl/cu126")
    # what runs: the shown words, by the interpreter whose torch was found wanting
    assert result.pip_argv == ("/venv/bin/python", "-m", "pip", "install", "--force-reinstall",
                               "torch==2.14.0", "--index-url",
                               "https://download.pytorch.org/whl/cu126")
    assert shlex.split(str(result.torch_install)) == list(result.pip_argv[2:])


def test_gpu_host_with_a_covering_wheel_needs_no_pip():
    result = plan("rtx4090", torch=cuda_torch("2.13.0", "cu126"))
    assert result.torch_covers is True
    assert result.torch_install is None and result.pip_argv is None


def test_cpu_host_with_a_cuda_wheel_or_none_gets_the_cpu_wheel():
    for torch, covers in ((cuda_torch("2.13.0", "cu126"), True), (NO_TORCH, None)):
        result = plan("none", torch=torch, version="2.13.0")
        assert result.torch_covers is covers
        assert result.pip_argv == ("/venv/bin/python", "-m", "pip", "install", "torch",
                                   "--index-url", "https://download.pytorch.org/whl/cpu")
        assert str(result.torch_install) == shlex.join(result.pip_argv[2:])


def test_a_source_build_is_shown_and_never_run():
    result = plan("gtx1060_rtx5060ti", torch=NO_TORCH)
    shown = str(result.torch_install)
    assert shown.startswith('TORCH_CUDA_ARCH_LIST="6.1;12.0" USE_CUDA=1 python -m pip install '
                            "--no-build-isolation -v .  # in a checkout of the release: git "
                            "clone --recursive --branch v2.14.0 ")  # pinned to a tag
    assert shown.endswith("2-6 hours of compiling and tens of GB of disk")
    assert result.pip_argv is None and not result.torch_install.is_wheel
    command, _, _ = shown.partition("  #")
    assert shlex.split(command) == ["TORCH_CUDA_ARCH_LIST=6.1;12.0", "USE_CUDA=1",
                                    *result.torch_install.argv]


def test_mixed_gpus_explain_the_options():
    result = plan("gtx1060_rtx5060ti", torch=NO_TORCH)
    assert result.action == "none" and result.archive is None
    text = "\n".join(result.notes)
    assert "--variant 2.11.0-cu128" in text and "GTX 1060" in text
    assert 'fdl libtorch build --archs "6.1;12.0"' in text and "CUDA 12.8-12.9" in text


def test_variant_option_takes_the_partial_choice():
    result = plan("gtx1060_rtx5060ti", variant="2.11.0-cu128")
    assert result.action == "download" and result.variant_id == "precompiled/2.11.0-cu128"


# --- link the wheel's libtorch, or download -------------------------------------------------

LINKABLE_CPU = TorchInfo(installed=True, python="/venv/bin/python", version="2.13.0+cpu",
                         libtorch=True)
SM61_SM120 = TorchInfo(installed=True, python="/venv/bin/python", version="2.13.0+cu128",
                       cuda_version="12.8", arch_list=("sm_61", "sm_120"), libtorch=True)


def test_a_wheel_covering_every_gpu_is_linked_not_downloaded():
    result = plan("gtx1060_rtx5060ti", torch=SM61_SM120)
    assert (result.action, result.source) == ("link", "wheel")
    assert result.variant_id == "python/torch-2.13.0+cu128" and result.download_request is None
    assert result.link_python == "/venv/bin/python"
    assert result.why == ("the installed torch 2.13.0+cu128 wheel covers NVIDIA GeForce RTX 5060 "
                          "Ti (sm_120) and NVIDIA GeForce GTX 1060 6GB (sm_61): linking its "
                          "libtorch (0 bytes) instead of a source build")
    # a covering wheel that ships no lib/, include/ (cuda_torch's) is not linked
    assert plan("rtx4090", torch=cuda_torch("2.13.0", "cu126")).action == "download"


def test_a_wheel_missing_one_gpu_downloads_and_names_the_gpu():
    sm120_only = TorchInfo(installed=True, python="/venv/bin/python", version="2.13.0+cu128",
                           cuda_version="12.8", arch_list=("sm_120",), libtorch=True)
    result = plan("gtx1060_rtx5060ti", torch=sm120_only, variant="2.11.0-cu128")
    assert (result.action, result.source) == ("download", "archive")
    assert result.notes[-1].startswith("the installed torch 2.13.0+cu128 wheel does not cover "
                                       "NVIDIA GeForce GTX 1060 6GB (sm_61): downloading")


def test_no_gpu_and_a_cpu_wheel_links_and_says_instead_of_what():
    result = plan("none", torch=LINKABLE_CPU, version="2.13.0")
    assert result.action == "link" and result.variant_id == "python/torch-2.13.0+cpu"
    assert result.why.endswith("covers this CPU-only host: linking its libtorch (0 bytes) "
                               "instead of downloading 2.13.0-cpu")
    linked = "python/torch-2.13.0+cpu"
    assert plan("none", torch=LINKABLE_CPU, installed=[linked]).action == "activate"
    assert plan("none", torch=LINKABLE_CPU, installed=[linked], active=linked).action == "present"


def test_download_flag_variant_or_other_version_download_anyway():
    for kwargs, flag in (({"download": True}, "--download"),
                         ({"variant": "2.13.0-cpu"}, "--variant"),
                         ({"version": "2.14.0"}, "--version 2.14.0")):
        result = plan("none", torch=LINKABLE_CPU, **kwargs)
        assert result.action == "download" and result.link_id is None, kwargs
        assert result.download_request is not None and result.notes[-1].startswith(flag)


def test_no_torch_broken_torch_or_no_headers_downloads():
    broken = TorchInfo(installed=True, python="/venv/bin/python", error="import failed")
    headerless = TorchInfo(installed=True, python="/venv/bin/python", version="2.13.0+cpu")
    for torch, why in ((NO_TORCH, "no usable torch wheel"), (broken, "no usable torch wheel"),
                       (headerless, "the installed torch 2.13.0+cpu wheel ships no libtorch")):
        result = plan("none", torch=torch, version="2.13.0")
        assert result.action == "download" and result.variant_id == "precompiled/2.13.0-cpu"
        assert result.notes[-1].startswith(why)
