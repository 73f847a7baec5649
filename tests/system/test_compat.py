"""CUDA compatibility rules: cubins, PTX, drivers, source-build toolkit ranges."""

from __future__ import annotations

import pytest

from fdl.errors import UsageError
from fdl.system.compat import (
    CudaArch,
    driver_verdict,
    gpu_driver_verdict,
    kernel_verdict,
    parse_arch_list,
    release_driver,
    source_build_cuda_range,
    torch_cuda_arch_list,
    version_tuple,
)

CU126 = parse_arch_list(["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"])
CU130 = parse_arch_list("7.5;8.0;8.6;9.0;10.0;12.0+PTX")


@pytest.mark.parametrize(("text", "expected"), [
    ("sm_61", CudaArch(6, 1)),
    ("sm_120", CudaArch(12, 0)),
    ("sm_100", CudaArch(10, 0)),
    ("compute_120", CudaArch(12, 0, ptx=True)),
    ("sm_90a", CudaArch(9, 0, suffix="a")),
    ("sm_100f", CudaArch(10, 0, suffix="f")),
    ("6.1", CudaArch(6, 1)),
    (" 12.0 ", CudaArch(12, 0)),
])
def test_parse_arch(text, expected):
    assert CudaArch.parse(text) == expected


@pytest.mark.parametrize("bad", ["", "sm61", "gfx90a", "12", "sm_", "compute_x"])
def test_parse_arch_rejects_garbage_with_usage_error(bad):
    with pytest.raises(UsageError, match="not a CUDA architecture"):
        CudaArch.parse(bad)


def test_arch_list_plus_ptx_adds_the_ptx_twin_and_round_trips():
    archs = parse_arch_list("6.1;12.0+PTX")
    assert [str(a) for a in archs] == ["sm_61", "sm_120", "compute_120"]
    assert [str(a) for a in parse_arch_list("7.5 8.0,8.6")] == ["sm_75", "sm_80", "sm_86"]
    assert torch_cuda_arch_list([(12, 0), (6, 1), (6, 1)]) == "6.1;12.0"


@pytest.mark.parametrize(("cc", "archs", "status", "via"), [
    ((6, 1), CU126, "ok", "sm_60"),        # same major, lower minor cubin runs
    ((8, 9), CU126, "ok", "sm_86"),        # Ada runs Ampere 8.6 cubins
    ((9, 0), CU126, "ok", "sm_90"),
    ((12, 0), CU126, "missing", None),     # sm_90 cubin never runs on a newer major
    ((3, 7), CU126, "missing", None),      # nothing runs on an older arch
    ((6, 1), CU130, "missing", None),      # Pascal dropped
    ((12, 0), CU130, "ok", "sm_120"),
    ((12, 1), CU130, "ok", "sm_120"),
    ((10, 3), CU130, "ok", "sm_100"),
    ((11, 0), CU130, "missing", None),     # compute_120 PTX cannot JIT for an older 11.0
    ((8, 0), parse_arch_list(["sm_90a"]), "missing", None),
    ((9, 0), parse_arch_list(["sm_90a"]), "ok", "sm_90a"),
    ((10, 3), parse_arch_list(["sm_100a"]), "missing", None),  # arch-specific: exact only
    ((10, 3), parse_arch_list(["sm_100f"]), "ok", "sm_100f"),  # family-specific: same major
    ((12, 0), parse_arch_list(["sm_80", "compute_80"]), "ptx-jit", "compute_80"),
    ((7, 5), parse_arch_list(["compute_80"]), "missing", None),
    ((8, 6), (), "missing", None),
])
def test_kernel_verdict(cc, archs, status, via):
    verdict = kernel_verdict(cc, archs)
    assert (verdict.status, verdict.via) == (status, via)
    assert verdict.runs == (status != "missing")
    assert verdict.reason


def test_missing_kernel_reason_names_the_gpu_arch_and_the_build():
    reason = kernel_verdict((6, 1), CU130).reason
    assert "sm_61" in reason and "sm_120" in reason and "compute_120" in reason
    assert "CPU-only" in kernel_verdict((8, 6), ()).reason


def test_prefers_the_highest_matching_cubin():
    assert kernel_verdict((8, 9), parse_arch_list("8.0;8.6")).via == "sm_86"


def test_version_tuple():
    assert version_tuple("570.86.15") == (570, 86, 15)
    assert version_tuple("12.8") == (12, 8)
    assert version_tuple("2.13.0+cpu") == (2, 13, 0)


@pytest.mark.parametrize(("driver", "cuda_driver", "runtime", "status", "needed"), [
    ("570.86.15", "12.8", "12.8", "ok", None),
    ("570.86.15", "12.8", "12.6", "ok", None),
    ("570.86.15", None, "12.8", "ok", None),            # decided by the release-driver table
    ("570.86.15", "12.8", "13.0", "too-old", "580.65.06"),
    ("550.144.03", "12.4", "12.8", "minor-compat", "570.26"),
    ("525.60.13", "12.0", "12.6", "minor-compat", "560.28.03"),
    ("515.65.01", "11.7", "12.1", "too-old", "530.30.02"),
    ("470.256.02", "11.4", "11.8", "minor-compat", "520.61.05"),
    (None, None, "12.8", "no-driver", "570.26"),
])
def test_driver_verdict(driver, cuda_driver, runtime, status, needed):
    verdict = driver_verdict(driver_version=driver, cuda_driver_version=cuda_driver,
                             runtime_cuda=runtime)
    assert verdict.status == status
    assert verdict.needed == needed
    assert verdict.runs == (status in ("ok", "minor-compat"))


def test_windows_uses_windows_driver_numbers():
    assert release_driver("12.8", windows=True) == "570.65"
    assert driver_verdict(driver_version="566.36", cuda_driver_version="12.7",
                          runtime_cuda="13.0", windows=True).needed == "580.88"


def test_gpu_needs_a_driver_that_knows_its_architecture():
    too_old = gpu_driver_verdict((12, 0), driver_version="550.144.03")
    assert too_old.status == "too-old" and too_old.needed == "570.26"
    assert "Blackwell" in too_old.reason
    assert gpu_driver_verdict((12, 0), driver_version="570.86.15").status == "ok"
    assert gpu_driver_verdict((6, 1), driver_version="470.256.02").status == "ok"


@pytest.mark.parametrize(("ccs", "expected"), [
    ([(6, 1), (12, 0)], ("12.8", "12.9")),    # CUDA 13 dropped Pascal; Blackwell needs 12.8
    ([(8, 9)], ("11.8", None)),
    ([(7, 0), (9, 0)], ("11.8", "12.9")),
    ([(5, 0), (11, 0)], None),                # no single toolkit builds both
])
def test_source_build_cuda_range(ccs, expected):
    assert source_build_cuda_range(ccs) == expected
