"""What `fdl libtorch download`'s flags fetch (fdl/libtorch/request.py, pure): the catalog entry
they name, the archive a URL names, the variant every GPU needs, and the usage errors."""

from __future__ import annotations

import pytest
from helpers import GPU_FIXTURES

from fdl.errors import FdlError, UsageError
from fdl.libtorch.archive_facts import name_from_url
from fdl.libtorch.catalog import find_archive, latest_version
from fdl.libtorch.request import DownloadAsk, archive_request, resolve_download
from fdl.system.gpu_fixture import load_survey_fixture

ORG = "https://download.pytorch.org/libtorch"
SHA = "0123456789abcdef" * 4


def resolve(survey: str | None = None, base: str | None = None, **flags):
    gpus = load_survey_fixture(GPU_FIXTURES / f"{survey}.json") if survey else None
    return resolve_download(DownloadAsk(**flags), base=base, survey=gpus)


def usage_error(**flags) -> UsageError:
    with pytest.raises(UsageError) as caught:
        resolve(**flags)
    assert caught.value.exit_code == 2
    return caught.value


def test_cpu_takes_the_catalog_entry_with_its_metadata():
    choice = resolve(cpu=True, version="2.13.0")
    assert choice.request.name == "2.13.0-cpu"
    assert choice.request.url == f"{ORG}/cpu/libtorch-shared-with-deps-2.13.0%2Bcpu.zip"
    assert choice.request.sha256 is None
    assert choice.request.meta == {"version": "2.13.0", "variant": "cpu", "cuda": None,
                                   "archs": [], "platform": "linux-x86_64", "min_driver": None}
    assert choice.reason == "2.13.0-cpu as asked"


def test_cuda_names_the_cu_variant_and_version_defaults_to_the_newest():
    choice = resolve(cuda="12.6")
    archive = find_archive(version=latest_version(), variant="cu126")
    assert choice.request.name == f"{latest_version()}-cu126"
    assert choice.request.url == archive.url
    assert (choice.request.meta["cuda"], choice.request.meta["archs"]) == ("12.6",
                                                                           list(archive.archs))


def test_variant_and_sha256_are_kept_and_the_mirror_replaces_the_host():
    choice = resolve(variant="cu130", version="2.13.0", sha256=SHA.upper(),
                     base="https://mirror.example/torch")
    assert choice.request.url == ("https://mirror.example/torch/cu130/"
                                  "libtorch-shared-with-deps-2.13.0%2Bcu130.zip")
    assert choice.request.sha256 == SHA.upper()


def test_setup_and_download_make_the_same_request_for_a_catalog_entry():
    archive = find_archive(version="2.13.0", variant="cu130")
    assert archive_request(archive) == resolve(variant="cu130", version="2.13.0").request


@pytest.mark.parametrize("flags", [{"cpu": True, "cuda": "12.6"},
                                   {"cpu": True, "variant": "cu130"},
                                   {"cuda": "12.6", "variant": "cu130"}])
def test_two_ways_to_pick_from_the_catalog_are_refused(flags):
    assert usage_error(**flags).message == "choose one of --cpu, --cuda, --variant"


@pytest.mark.parametrize("sha256", ["abc", SHA[:-1], SHA[:-1] + "g", SHA + "0"])
def test_sha256_must_be_64_hex_digits(sha256):
    assert usage_error(cpu=True, sha256=sha256).message == (
        f"--sha256 must be 64 hex digits, got {sha256!r}")


def test_unknown_version_or_variant_is_a_usage_error_listing_what_exists():
    error = usage_error(cpu=True, version="1.0.0")
    assert error.message == "libtorch 1.0.0 is not in the catalog for linux-x86_64"
    assert "2.13.0" in error.hint
    error = usage_error(variant="cu999", version="2.13.0")
    assert "'cu999'" in error.message and "cu130" in error.hint


@pytest.mark.parametrize("flags", [{"cpu": True}, {"cuda": "12.6"}])
def test_url_takes_no_catalog_flag(flags):
    error = usage_error(url="https://site.example/libtorch.zip", **flags)
    assert error.message.startswith("--url fetches exactly that archive")


def test_a_url_is_named_from_its_archive_with_the_flags_to_check_against():
    choice = resolve(url="https://site.example/a/libtorch.zip", variant="site-build", sha256=SHA,
                     version="2.13.0")
    request = choice.request
    assert (request.name, request.url, request.sha256) == (
        None, "https://site.example/a/libtorch.zip", SHA)
    assert (request.version, request.variant) == ("2.13.0", "site-build")
    assert choice.reason == ("fetching https://site.example/a/libtorch.zip "
                             "(named from its build-version)")


@pytest.mark.parametrize("variant", ["../escape", "a/b", ".hidden", ""])
def test_url_with_a_variant_that_is_no_plain_name_is_refused(variant):
    assert "--variant" in usage_error(url="https://site.example/libtorch.zip",
                                      variant=variant).message


@pytest.mark.parametrize(("url", "name"), [
    (f"{ORG}/cpu/libtorch-shared-with-deps-2.13.0%2Bcpu.zip", "2.13.0-cpu"),
    (f"{ORG}/cu130/libtorch-win-shared-with-deps-2.13.0%2Bcu130.zip", "2.13.0-cu130"),
    ("https://m.example/libtorch-cxx11-abi-shared-with-deps-2.5.1%2Bcu124.zip", "2.5.1-cu124"),
    ("https://m.example/libtorch-site.zip?token=1", "site"),
    ("https://m.example/builds/", "custom"),
])
def test_the_name_a_url_gives(url, name):
    assert name_from_url(url) == name


def test_a_url_whose_file_name_is_no_plain_name_asks_for_variant():
    with pytest.raises(UsageError) as caught:
        name_from_url("https://m.example/libtorch-a%20b.zip")
    assert "'a b'" in caught.value.message and "--variant NAME" in caught.value.hint


@pytest.mark.parametrize(("flags", "needs"), [
    ({}, True), ({"version": "2.13.0", "sha256": SHA}, True), ({"cpu": True}, False),
    ({"cuda": "12.6"}, False), ({"variant": "cu130"}, False), ({"url": "https://x/y.zip"}, False),
])
def test_the_survey_is_needed_only_when_no_flag_names_the_archive(flags, needs):
    assert DownloadAsk(**flags).needs_survey is needs


@pytest.mark.parametrize(("fixture", "name"), [("none", "2.13.0-cpu"), ("rtx4090", "2.13.0-cu126"),
                                               ("h100", "2.13.0-cu130")])
def test_no_flag_takes_the_variant_covering_every_gpu(fixture, name):
    choice = resolve(fixture, version="2.13.0", sha256=SHA)
    assert (choice.request.name, choice.request.sha256) == (name, SHA)
    assert choice.reason.startswith("auto: ")


def test_gpus_no_official_variant_covers_fail_with_the_options():
    with pytest.raises(FdlError) as caught:
        resolve("gtx1060_rtx5060ti", version="2.13.0")
    error = caught.value
    assert error.exit_code == 1 and not isinstance(error, UsageError)
    assert error.message.startswith("no official libtorch covers")
    assert error.hint.startswith("--variant 2.13.0-cu126 (covers the most; leaves out")
    assert '; or fdl libtorch build --archs "6.1;12.0" (one libtorch for every GPU' in error.hint
    assert error.hint.endswith("one environment per card: fdl setup --dry-run)")


def test_without_a_version_download_offers_what_setup_offers():
    """One answer: the best partial variant over every release, named as --variant takes it
    in both commands (fdl setup's plan says 2.11.0-cu128 for this host too)."""
    from fdl.libtorch.setup_plan import plan_setup
    from fdl.system.torchenv import TorchInfo

    with pytest.raises(FdlError) as caught:
        resolve("gtx1060_rtx5060ti")
    assert caught.value.hint.startswith("--variant 2.11.0-cu128 (covers the most; leaves out "
                                        "NVIDIA GeForce GTX 1060 6GB)")
    survey = load_survey_fixture(GPU_FIXTURES / "gtx1060_rtx5060ti.json")
    plan = plan_setup(survey=survey, torch=TorchInfo(installed=False, python="python"),
                      installed=[], active=None)
    assert any("fdl setup --variant 2.11.0-cu128" in note for note in plan.notes)
    assert resolve(variant="2.11.0-cu128").request.name == "2.11.0-cu128"
    assert resolve(variant="cu128").request.name == "2.11.0-cu128"  # the newest that has it
    assert resolve(variant="cu128", version="2.10.0").request.name == "2.10.0-cu128"
    with pytest.raises(UsageError, match=r"names release 2\.11\.0, --version 2\.10\.0"):
        resolve(variant="2.11.0-cu128", version="2.10.0")
