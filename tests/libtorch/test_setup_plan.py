"""fdl setup's plan (pure): which variant, whether to download or activate, the torch wheel."""

from __future__ import annotations

from helpers import GPU_FIXTURES

from fdl.libtorch.catalog import find_archive
from fdl.libtorch.setup_plan import plan_setup
from fdl.system.gpu_fixture import load_survey_fixture
from fdl.system.torchenv import TorchInfo

CPU_TORCH = TorchInfo(installed=True, python="python", version="2.13.0+cpu")
NO_TORCH = TorchInfo(installed=False, python="python")


def cuda_torch(version: str, variant: str) -> TorchInfo:
    archive = find_archive(version=version, variant=variant)
    return TorchInfo(installed=True, python="python", version=f"{version}+{variant}",
                     cuda_version=archive.cuda, arch_list=archive.archs)


def plan(fixture: str, torch: TorchInfo = CPU_TORCH, installed=(), active=None, **kwargs):
    survey = load_survey_fixture(GPU_FIXTURES / f"{fixture}.json")
    return plan_setup(survey=survey, torch=torch, installed=list(installed), active=active,
                      **kwargs)


def test_cpu_host_downloads_the_cpu_variant_and_keeps_the_cpu_wheel():
    result = plan("none", version="2.13.0")
    assert result.action == "download" and result.variant_id == "precompiled/2.13.0-cpu"
    assert result.torch_covers is True and result.pip_command is None


def test_already_installed_is_activated_and_active_is_present():
    wanted = "precompiled/2.13.0-cpu"
    assert plan("none", version="2.13.0", installed=[wanted]).action == "activate"
    assert plan("none", version="2.13.0", installed=[wanted], active=wanted).action == "present"


def test_gpu_host_with_cpu_wheel_gets_the_exact_pip_command():
    result = plan("rtx4090")
    assert result.archive.name == "2.14.0-cu126"
    assert result.torch_covers is False
    assert result.pip_command == ("pip install --force-reinstall 'torch==2.14.0' "
                                  "--index-url https://download.pytorch.org/whl/cu126")


def test_gpu_host_with_a_covering_wheel_needs_no_pip():
    result = plan("rtx4090", torch=cuda_torch("2.13.0", "cu126"))
    assert result.torch_covers is True and result.pip_command is None


def test_mixed_gpus_explain_the_options():
    result = plan("gtx1060_rtx5060ti", torch=NO_TORCH)
    assert result.action == "none" and result.archive is None
    text = "\n".join(result.notes)
    assert "--variant 2.11.0-cu128" in text and "GTX 1060" in text
    assert 'fdl libtorch build --archs "6.1;12.0"' in text and "CUDA 12.8-12.9" in text


def test_variant_option_takes_the_partial_choice():
    result = plan("gtx1060_rtx5060ti", variant="2.11.0-cu128")
    assert result.action == "download" and result.variant_id == "precompiled/2.11.0-cu128"
