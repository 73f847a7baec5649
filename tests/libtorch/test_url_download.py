"""`fdl libtorch download --url`: the variant is named from the archive itself (its
build-version and macros.h), --version/--variant are checked against it, and the sha256 rule for
an already installed variant. Archives are built here and served by a real HTTP server on
127.0.0.1; the library is driven in-process, the CLI in a subprocess."""

from __future__ import annotations

import hashlib
import io
import zipfile

import pytest
from helpers import assert_one_error, libtorch_list, run_fdl

from fdl.errors import FdlError
from fdl.libtorch.archive_facts import ArchiveFacts, name_archive, parse_build_strings
from fdl.libtorch.install import install_archive
from fdl.libtorch.request import DownloadAsk, resolve_download

MACROS_H = r'''#define CAFFE2_BUILD_STRINGS { \
  {"TORCH_VERSION", "2.13.0"}, \
  {"CUDA_FLAGS", R"PYT( -Xfatbin -compress-all -gencode arch=compute_61,code=sm_61 -gencode arch=compute_120,code=sm_120 -gencode arch=compute_120,code=compute_120 --expt-extended-lambda)PYT"}, \
  {"USE_CUDA", "1"}, \
  {"CUDA_VERSION", "12.8"}, \
}
'''


def libtorch_zip(build_version: str | None = "2.13.0+cu128", *, salt: str = "") -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("libtorch/lib/libtorch_cpu.so", b"\x7fELF" + salt.encode())
        archive.writestr("libtorch/include/torch/torch.h", "// stand-in header\n")
        archive.writestr("libtorch/include/caffe2/core/macros.h", MACROS_H)
        archive.writestr("libtorch/share/cmake/Torch/TorchConfig.cmake", "# stand-in\n")
        if build_version is not None:
            archive.writestr("libtorch/build-version", f"{build_version}\n")
    return buffer.getvalue()


def request(url: str, **flags):
    return resolve_download(DownloadAsk(url=url, **flags), base=None).request


def install(store, url: str, **flags):
    return install_archive(store, request(url, **flags), allow_http=True)


def staged_zips(store) -> list[str]:
    return [p.name for p in store.staging().iterdir() if p.suffix in (".zip", ".part")]


# --- pure: what an archive says, and the name it gets -----------------------------------------

def test_cuda_version_and_archs_come_from_macros_h():
    assert parse_build_strings(MACROS_H) == ("12.8", ("sm_61", "sm_120", "compute_120"))
    cpu = '{"CUDA_FLAGS", R"PYT( -Xfatbin)PYT"}, \\\n  {"CUDA_VERSION", ""}, \\'
    assert parse_build_strings(cpu) == (None, ())


@pytest.mark.parametrize(("flags", "name"), [
    ({}, "2.13.0-cu128"),
    ({"version": "2.13.0", "variant": "cu128"}, "2.13.0-cu128"),  # agreeing flags
    ({"variant": "site-build"}, "site-build"),  # not a tag: the name itself
])
def test_the_archive_names_itself(flags, name):
    facts = ArchiveFacts("2.13.0+cu128", "12.8", ("sm_61",))
    got, meta = name_archive(facts, url_name="libtorch", **{"variant": None, "version": None,
                                                             **flags})
    assert got == name
    assert meta == {"version": "2.13.0", "variant": "cu128", "cuda": "12.8", "archs": ["sm_61"],
                    "build_version": "2.13.0+cu128"}  # the archive's facts, whatever the name


@pytest.mark.parametrize(("flags", "needle"), [
    ({"version": "2.12.0"}, "--version 2.12.0 does not match the archive, which is 2.13.0+cu128"),
    ({"variant": "cu126"}, "--variant cu126 does not match the archive, which is 2.13.0+cu128"),
])
def test_flags_that_contradict_the_archive_are_an_error(flags, needle):
    with pytest.raises(FdlError) as caught:
        name_archive(ArchiveFacts("2.13.0+cu128"), url_name=None,
                     **{"variant": None, "version": None, **flags})
    assert caught.value.message.startswith(needle)


def test_an_archive_without_build_version_falls_back_to_flags_then_a_versioned_file_name():
    silent = ArchiveFacts()
    assert name_archive(silent, url_name=None, variant="cpu", version="2.13.0")[0] == "2.13.0-cpu"
    assert name_archive(silent, url_name="2.5.1-cu124", variant=None, version=None)[0] \
        == "2.5.1-cu124"
    with pytest.raises(FdlError) as caught:
        name_archive(silent, url_name="libtorch", variant=None, version=None)
    assert "no libtorch/build-version" in caught.value.message
    assert "--variant NAME" in caught.value.hint


# --- against the local server ------------------------------------------------------------------

def test_a_url_ending_in_libtorch_zip_is_named_from_build_version(http_server, store):
    data = libtorch_zip()
    http_server.files["site/libtorch.zip"] = data
    variant = install(store, http_server.url("site/libtorch.zip"))
    assert variant.id == "precompiled/2.13.0-cu128"
    assert (variant.meta["version"], variant.meta["cuda"], variant.meta["archs"]) == (
        "2.13.0", "12.8", ["sm_61", "sm_120", "compute_120"])
    assert variant.meta["sha256"] == hashlib.sha256(data).hexdigest()
    assert store.active().id == variant.id and staged_zips(store) == []


@pytest.mark.parametrize(("flags", "needle"), [
    ({"version": "2.12.0"}, "--version 2.12.0 does not match"),
    ({"variant": "cu126"}, "--variant cu126 does not match"),
])
def test_a_mismatching_flag_installs_nothing(http_server, store, flags, needle):
    http_server.files["libtorch.zip"] = libtorch_zip()
    with pytest.raises(FdlError) as caught:
        install(store, http_server.url("libtorch.zip"), **flags)
    assert needle in caught.value.message
    assert store.variants() == [] and staged_zips(store) == []


def test_an_archive_that_does_not_say_its_version_needs_a_name(http_server, store):
    http_server.files["libtorch.zip"] = libtorch_zip(None)
    with pytest.raises(FdlError, match="no libtorch/build-version"):
        install(store, http_server.url("libtorch.zip"))
    named = install(store, http_server.url("libtorch.zip"), variant="site-build")
    assert named.id == "precompiled/site-build" and named.meta["cuda"] == "12.8"


def test_the_same_url_again_fetches_nothing(http_server, store):
    http_server.files["libtorch.zip"] = data = libtorch_zip()
    url = http_server.url("libtorch.zip")
    first = install(store, url)
    again = install(store, url, sha256=hashlib.sha256(data).hexdigest())
    assert again.id == first.id and len(http_server.requests) == 1


def test_a_different_sha256_is_verified_and_a_different_archive_refused(http_server, store):
    http_server.files["libtorch.zip"] = old = libtorch_zip()
    url = http_server.url("libtorch.zip")
    installed = install(store, url)
    old_sha = hashlib.sha256(old).hexdigest()
    # the server now serves another build of the same version: its digest is asked for
    http_server.files["libtorch.zip"] = new = libtorch_zip(salt="rebuilt")
    new_sha = hashlib.sha256(new).hexdigest()
    with pytest.raises(FdlError) as caught:
        install(store, url, sha256=new_sha)
    assert len(http_server.requests) == 2  # fetched again, not "already installed"
    assert old_sha in caught.value.message and new_sha in caught.value.message
    assert "nothing was replaced" in caught.value.message
    assert "fdl libtorch remove 2.13.0-cu128" in caught.value.hint
    (kept,) = store.variants()
    assert kept.meta["sha256"] == old_sha and kept.path == installed.path
    assert staged_zips(store) == []
    # a digest the served archive does not have: the download's own mismatch error
    wrong = "0" * 64
    with pytest.raises(FdlError) as caught:
        install(store, url, sha256=wrong)
    assert wrong in caught.value.message and new_sha in caught.value.message
    assert store.variants()[0].meta["sha256"] == old_sha


def test_the_cli_names_and_refuses_the_same_way(http_server, mirror_env):
    http_server.files["site/libtorch.zip"] = data = libtorch_zip()
    url = http_server.url("site/libtorch.zip")
    dry = run_fdl("libtorch", "download", "--url", url, "--dry-run", env=mirror_env)
    assert dry.returncode == 0 and "named from the archive's build-version" in dry.stdout
    proc = run_fdl("libtorch", "download", "--url", url, "--version", "2.13.0", env=mirror_env)
    assert proc.returncode == 0, proc.stderr
    assert libtorch_list(mirror_env)["active"] == "precompiled/2.13.0-cu128"
    same = run_fdl("libtorch", "download", "--url", url, "--sha256",
                   hashlib.sha256(data).hexdigest(), env=mirror_env)
    assert same.returncode == 0 and "precompiled/2.13.0-cu128 is already installed" in same.stderr
    http_server.files["site/libtorch.zip"] = new = libtorch_zip(salt="rebuilt")
    refused = run_fdl("libtorch", "download", "--url", url, "--sha256",
                      hashlib.sha256(new).hexdigest(), env=mirror_env)
    assert_one_error(refused, 1, hashlib.sha256(data).hexdigest(),
                     hashlib.sha256(new).hexdigest(), "nothing was replaced", alone=False)
    bad = run_fdl("libtorch", "download", "--url", url, "--version", "2.12.0", env=mirror_env)
    assert_one_error(bad, 1, "--version 2.12.0 does not match", alone=False)
