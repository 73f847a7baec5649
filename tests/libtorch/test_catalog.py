"""The libtorch catalog's URLs and the choice of variant for each GPU fixture (pure)."""

from __future__ import annotations

import pytest
from helpers import GPU_FIXTURES

from fdl.errors import UsageError
from fdl.libtorch.catalog import (
    LINUX_X86_64,
    MACOS_ARM64,
    WINDOWS_X86_64,
    find_archive,
    libtorch_archives,
    libtorch_url,
)
from fdl.libtorch.resolve import resolve_variant
from fdl.system.gpu_fixture import load_survey_fixture


@pytest.mark.parametrize(("version", "variant", "platform", "url"), [
    ("2.13.0", "cu130", LINUX_X86_64,
     "https://download.pytorch.org/libtorch/cu130/libtorch-shared-with-deps-2.13.0%2Bcu130.zip"),
    ("2.13.0", "cpu", LINUX_X86_64,
     "https://download.pytorch.org/libtorch/cpu/libtorch-shared-with-deps-2.13.0%2Bcpu.zip"),
    ("2.11.0", "cu128", WINDOWS_X86_64,
     "https://download.pytorch.org/libtorch/cu128/libtorch-win-shared-with-deps-2.11.0%2Bcu128.zip"),
    ("2.14.0", "cpu", MACOS_ARM64,
     "https://download.pytorch.org/libtorch/cpu/libtorch-macos-arm64-2.14.0.zip"),
])
def test_official_url_patterns(version, variant, platform, url):
    assert libtorch_url(version, variant, platform) == url


def test_mirror_replaces_the_base():
    url = libtorch_url("2.13.0", "cu126", LINUX_X86_64, base="http://mirror.local/lt/")
    assert url == "http://mirror.local/lt/cu126/libtorch-shared-with-deps-2.13.0%2Bcu126.zip"


def test_catalog_covers_three_stable_versions_with_cpu_cuda_and_rocm():
    archives = libtorch_archives()
    versions = {a.version for a in archives}
    assert {"2.14.0", "2.13.0", "2.12.0"} <= versions
    for version in ("2.14.0", "2.13.0", "2.12.0"):
        variants = {a.variant for a in archives if a.version == version}
        assert "cpu" in variants and "cu126" in variants and "cu130" in variants
    assert any(a.variant.startswith("rocm") for a in archives)
    assert {a.variant for a in libtorch_archives(platform=MACOS_ARM64)} == {"cpu"}


def test_archive_min_driver_and_arch_list():
    archive = find_archive(version="2.13.0", variant="cu130")
    assert archive.min_driver == "580.65.06"
    assert "sm_120" in archive.archs and "compute_120" in archive.archs
    assert find_archive(version="2.13.0", variant="cu130",
                        platform=WINDOWS_X86_64).min_driver == "580.88"
    assert find_archive(version="2.13.0", variant="cpu").min_driver is None


def test_unknown_version_or_variant_lists_what_exists():
    with pytest.raises(UsageError, match="not in the catalog") as err:
        find_archive(version="1.0.0", variant="cpu")
    assert "2.13.0" in err.value.hint
    with pytest.raises(UsageError, match="no variant 'cu999'") as err:
        find_archive(version="2.13.0", variant="cu999")
    assert "cu130" in err.value.hint


def resolve(fixture: str, **kwargs):
    return resolve_variant(load_survey_fixture(GPU_FIXTURES / f"{fixture}.json"), **kwargs)


def test_cpu_host_gets_the_cpu_variant():
    result = resolve("none", version="2.13.0")
    assert result.archive.name == "2.13.0-cpu"


def test_rtx4090_on_driver_570_gets_cu126():
    assert resolve("rtx4090").archive.name == "2.14.0-cu126"
    assert resolve("rtx4090", version="2.11.0").archive.name == "2.11.0-cu128"


def test_h100_on_driver_580_gets_cu130():
    assert resolve("h100").archive.name == "2.14.0-cu130"


def test_pascal_plus_blackwell_has_no_official_variant():
    result = resolve("gtx1060_rtx5060ti")
    assert result.archive is None
    assert result.best_partial.name == "2.11.0-cu128"
    assert result.left_out == ("NVIDIA GeForce GTX 1060 6GB",)
    assert result.source_arch_list == "6.1;12.0"
    assert result.source_cuda == ("12.8", "12.9")
    assert "no official libtorch covers" in result.reason


def test_old_driver_names_the_driver_to_install():
    result = resolve("old_driver_rtx5060ti")
    assert result.archive is None
    assert result.driver_needed == "570.26"
    assert "570.26" in result.reason
