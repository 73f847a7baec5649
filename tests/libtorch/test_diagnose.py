"""The diagnose report's verdicts for each GPU fixture and several torch wheels (pure logic).

The torch wheels here are described as data (TorchInfo): CUDA wheels cannot be installed on this
CPU-only machine, and the report must judge them all the same.
"""

from __future__ import annotations

import dataclasses

import pytest
from helpers import GPU_FIXTURES

from fdl.libtorch.catalog import official_builds
from fdl.libtorch.diagnose import build_report
from fdl.system.gpu_fixture import load_survey_fixture
from fdl.system.host import HostInfo, NetInterface, ToolVersion
from fdl.system.torchenv import TorchInfo

HOST = HostInfo(
    cpu_model="Test CPU", physical_cores=8, logical_cores=16, ram_mib=65536, os_name="Linux",
    os_release="Debian 12", kernel="6.1.0", machine="x86_64", python_version="3.11.7",
    python_executable="/usr/bin/python3", wsl=False, container=None,
    tools=(ToolVersion("nvcc", "12.8", "/usr/local/cuda/bin/nvcc"),),
    interfaces=(NetInterface("lo", ("127.0.0.1",), ("::1",), True, True),),
)
CPU_TORCH = TorchInfo(installed=True, python="python", version="2.13.0+cpu", gloo_available=True)
NO_TORCH = TorchInfo(installed=False, python="python")
CU126 = official_builds(version="2.13.0")[1]
CU130 = official_builds(version="2.13.0")[0]


def cuda_torch(build) -> TorchInfo:
    return TorchInfo(installed=True, python="python", version=f"{build.version}+{build.variant}",
                     cuda_version=build.cuda, arch_list=build.archs, gloo_available=True,
                     nccl_available=True, cuda_available=True, device_count=1)


def report(fixture: str, torch: TorchInfo, host: HostInfo = HOST):
    survey = load_survey_fixture(GPU_FIXTURES / f"{fixture}.json")
    return build_report(host=host, survey=survey, torch=torch, context={})


def test_catalog_order_is_what_the_tests_assume():
    assert (CU130.variant, CU126.variant) == ("cu130", "cu126")


def test_cpu_host_with_cpu_torch_is_ok():
    result = report("none", CPU_TORCH)
    assert result.verdict.level == "ok"
    assert "train on the CPU" in result.verdict.message
    assert not result.gpus_uncovered


def test_cpu_host_without_torch_suggests_the_cpu_wheel():
    result = report("none", NO_TORCH)
    assert result.verdict.level == "warn"
    assert "whl/cpu" in result.verdict.command


def test_cuda_wheel_on_cpu_host_warns_about_bf16_autodetection():
    result = report("none", dataclasses.replace(cuda_torch(CU126), cuda_available=False))
    warn = [f for f in result.findings if "bf16" in f.message]
    assert warn and warn[0].level == "warn" and "whl/cpu" in warn[0].command


def test_mixed_pascal_blackwell_no_official_build_covers_both():
    result = report("gtx1060_rtx5060ti", NO_TORCH)
    advice = result.advice
    assert advice.covering == ()
    assert advice.source_arch_list == "6.1;12.0"
    assert advice.source_cuda == ("12.8", "12.9")
    # The best partial build keeps the faster Blackwell card and leaves the GTX 1060 out.
    assert [g.name for g in advice.best_partial.missing] == ["NVIDIA GeForce GTX 1060 6GB"]
    finding = next(f for f in result.findings if "no official torch build covers" in f.message)
    assert 'TORCH_CUDA_ARCH_LIST="6.1;12.0"' in finding.message
    assert "CUDA 12.8-12.9" in finding.message
    assert 'TORCH_CUDA_ARCH_LIST="6.1;12.0"' in finding.command
    assert result.verdict.command == "fdl setup --dry-run"  # the environment per card first
    assert "fdl's option: two environments, same torch 2.11.0" in result.verdict.message


@pytest.mark.parametrize(("build", "missing"), [
    (CU126, ["NVIDIA GeForce RTX 5060 Ti"]),
    (CU130, ["NVIDIA GeForce GTX 1060 6GB"]),
])
def test_mixed_gpus_each_official_wheel_misses_one(build, missing):
    result = report("gtx1060_rtx5060ti", cuda_torch(build))
    assert result.verdict.level == "error"
    assert [g.name for g in result.torch_coverage.missing] == missing
    assert result.gpus_uncovered
    # the verdict names fdl's way (an environment per card), the finding the source build
    assert result.verdict.command == "fdl setup --dry-run"
    assert result.verdict.message.endswith(
        "fdl's option: two environments, same torch 2.11.0: cu128 for GPU 0, cu126 for GPU 1")
    finding = next(f for f in result.findings if "no official torch build covers" in f.message)
    assert "6.1;12.0" in finding.command


def test_rtx4090_cpu_wheel_is_an_error_with_the_right_install_command():
    result = report("rtx4090", CPU_TORCH)
    assert result.verdict.level == "error"
    assert "CPU-only build" in result.verdict.message
    # Driver 570 supports CUDA 12.8, not 13.0: the newest build it runs fully is cu126.
    assert result.advice.recommended.label == "torch 2.14.0+cu126"
    assert result.verdict.command == ("pip install --force-reinstall 'torch==2.14.0' "
                                      "--index-url https://download.pytorch.org/whl/cu126")


def test_rtx4090_with_cu126_wheel_is_ok():
    result = report("rtx4090", cuda_torch(CU126))
    assert result.verdict.level == "ok"
    assert result.torch_coverage.gpus[0].kernel.via == "sm_86"
    assert not result.gpus_uncovered


def test_h100_with_a_cuda13_driver_gets_a_cuda13_build():
    result = report("h100", NO_TORCH)
    assert result.advice.recommended.label == "torch 2.14.0+cu130"
    assert "whl/cu130" in result.verdict.command


def test_cu130_wheel_on_a_cuda12_driver_is_an_error_naming_the_driver():
    result = report("rtx4090", cuda_torch(CU130))
    assert result.verdict.level == "error"
    assert "580.65.06" in result.verdict.command


def test_driver_too_old_for_blackwell():
    result = report("old_driver_rtx5060ti", CPU_TORCH)
    assert result.verdict.level == "error"
    assert "570.26" in result.verdict.message
    assert result.verdict.command == "install NVIDIA driver >= 570.26"
    assert result.advice.covering == ()
    assert result.advice.driver_needed == "570.26"


def test_a_multi_homed_host_is_told_what_fdl_run_picks_from_the_routes():
    """Not the alphabetically first interface (docker0 before enp4s0): fdl run picks the one
    that routes to the endpoint, which `fdl diagnose --peer` shows; a dual-stack interface is
    both families, not IPv4."""
    interfaces = (*HOST.interfaces,
                  NetInterface("docker0", ("172.17.0.1",), (), True, False),
                  NetInterface("enp4s0", ("192.168.1.20",), ("fe80::1",), True, False),
                  NetInterface("tailscale0", ("100.64.0.2",), ("fd7a::2",), True, False))
    host = dataclasses.replace(HOST, interfaces=interfaces, default_route_interface="enp4s0")
    finding = next(f for f in report("none", CPU_TORCH, host).findings
                   if "several network interfaces" in f.message)
    assert finding.command == "fdl diagnose --peer NODE0:29400"
    assert "(docker0 (IPv4), enp4s0 (IPv4), tailscale0 (IPv4+IPv6))" in finding.message
    assert "the job uses the endpoint's address family" in finding.message
    assert finding.message.endswith("; the default route leaves by enp4s0")
    assert "export GLOO_SOCKET_IFNAME" not in (finding.command or "")


def test_nvcc_major_mismatch_is_noted():
    result = report("h100", cuda_torch(CU130))
    assert any("nvcc 12.8" in f.message for f in result.findings)


def test_json_document_shape():
    doc = report("gtx1060_rtx5060ti", cuda_torch(CU130)).to_dict()
    assert doc["schema"] == 1
    assert [d["arch"] for d in doc["gpus"]["devices"]] == ["sm_120", "sm_61"]
    assert [g["status"] for g in doc["torch"]["coverage"]["gpus"]] == ["ok", "missing"]
    assert doc["compatibility"]["source_build"] == {
        "torch_cuda_arch_list": "6.1;12.0", "cuda_min": "12.8", "cuda_max": "12.9"}
    assert doc["verdict"]["level"] == "error"


def test_a_cuda_host_is_told_that_backend_cpu_averages_through_the_host():
    """--backend cpu is how GPU workers average (gloo, host memory), not a CPU run: CPU
    workers are --nproc-per-node cpu, which hides the GPUs from them."""
    result = report("rtx4090", cuda_torch(CU126))
    texts = [finding.message for finding in result.findings]
    advice = next(t for t in texts if t.startswith("torch sees CUDA"))
    assert "a CPU run (fdl run --backend cpu)" not in advice
    assert "--nproc-per-node cpu" in advice and "--backend cpu is how GPU workers average" in advice


def test_a_gpu_pair_without_peer_access_is_reported_with_what_fdl_run_does():
    """Two GeForce cards whose driver refuses peer access (the probe's answer, as data): one
    warning for that pair, none for a pair that has it, and the JSON carries every pair."""
    torch = dataclasses.replace(cuda_torch(CU130), device_count=3,
                                peer_access=((0, 1, False), (0, 2, True), (1, 2, True)))
    result = report("rtx4090", torch)
    peer = [f for f in result.findings if "peer-to-peer" in f.message]
    assert len(peer) == 1 and peer[0].level == "warn"
    assert peer[0].message.startswith("GPUs 0 and 1 have no peer-to-peer access")
    assert "NCCL_P2P_DISABLE=1" in peer[0].message
    assert [list(pair) for pair in result.to_dict()["torch"]["peer_access"]] == [
        [0, 1, False], [0, 2, True], [1, 2, True]]
    assert not [f for f in report("rtx4090", cuda_torch(CU130)).findings
                if "peer-to-peer" in f.message]
