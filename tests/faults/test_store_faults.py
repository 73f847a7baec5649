"""Faults of the libtorch store and the commands around it, with the real `fdl` in a subprocess
and the store on a real filesystem: names that look like paths, broken ``.active`` and
``variant.json`` files, a full disk while activating, bad input on an empty ``FLODL_HOME``, a
``FLODL_HOME`` that is a file, ``fdl libtorch build --jobs 0``.

The rule for bad input: one ``error:`` line and one ``hint:`` line, exit 2, nothing written.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import GPU_FIXTURES, assert_one_error, clean_env, install_variant, run_fdl

from fdl.errors import UsageError

NAMES = ["../../../victim", "precompiled/../../victim", "/etc", "..", ".hidden", "a\\b"]


def fdl(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return run_fdl(*args, env={"FLODL_HOME": str(home),
                               "FDL_GPU_SURVEY": str(GPU_FIXTURES / "none.json"), **env})


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with the bytes of each file (None for directories)."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
            for p in sorted(root.rglob("*"))}


# ---- item 2: names that look like paths -----------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_path_like_names_are_refused_by_activate_remove_and_info(flodl_home, store, name):
    install_variant(store, "2.13.0-cpu")
    store.activate("2.13.0-cpu")
    before = snapshot(flodl_home.parent)
    for command in (["activate", name], ["remove", name, "--force"], ["info", name]):
        proc = fdl(flodl_home, "libtorch", *command)
        assert_one_error(proc, 2, repr(name), "not a libtorch variant name")
    assert snapshot(flodl_home.parent) == before


@pytest.mark.parametrize("name", NAMES)
def test_path_like_names_never_reach_a_path_in_the_library(store, name):
    with pytest.raises(UsageError, match="not a plain directory name"), \
            store.download_lock(name):
        pass
    with pytest.raises(UsageError, match="not a plain directory name"):
        store.install(kind="precompiled", name=name, tree=store.root / "nowhere", meta={})
    assert not store.root.exists()


# ---- item 7: broken .active and variant.json ------------------------------------------------

def _not_utf8(path: Path) -> None:
    path.write_bytes(b"\xff\xfeprecompiled/good\n")


def _a_directory(path: Path) -> None:
    path.mkdir()


def _a_fifo(path: Path) -> None:
    os.mkfifo(path)  # opening it for reading would block: fdl must not


@pytest.mark.parametrize("breaks", [_not_utf8, _a_directory, pytest.param(
    _a_fifo, marks=pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here"))])
def test_a_broken_active_file_is_one_warning_and_nothing_active(flodl_home, store, breaks):
    install_variant(store, "good")
    breaks(store.root / ".active")
    listed = fdl(flodl_home, "libtorch", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)["active"] is None
    assert [v["id"] for v in json.loads(listed.stdout)["variants"]] == ["precompiled/good"]
    (warning,) = [line for line in listed.stderr.splitlines() if line.startswith("warning: ")]
    assert ".active is" in warning and "ignored" in warning
    env = fdl(flodl_home, "libtorch", "env")
    assert_one_error(env, 1, "no libtorch is active", alone=False)  # after the warning
    assert "warning: " in env.stderr and env.stdout == ""
    assert store.active() is None


def test_a_broken_variant_json_is_one_warning_and_skipped(flodl_home, store):
    install_variant(store, "good")
    install_variant(store, "stringy")
    install_variant(store, "garbled")
    meta = store.root / "precompiled" / "stringy" / "variant.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "archs": "sm_86"}))
    (store.root / "precompiled" / "garbled" / "variant.json").write_bytes(b"\x00{not json")
    store.activate("good")
    listed = fdl(flodl_home, "libtorch", "list")
    assert listed.returncode == 0, listed.stderr
    warnings = [line for line in listed.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 2
    assert "precompiled/stringy: variant.json: 'archs' must be a list" in warnings[1]
    assert "precompiled/garbled: variant.json is not valid JSON" in warnings[0]
    assert "precompiled/good" in listed.stdout and "stringy" not in listed.stdout
    env = fdl(flodl_home, "libtorch", "env")
    assert env.returncode == 0 and "precompiled/good" in env.stdout
    # a broken entry is not a variant: activating it is a usage error
    assert_one_error(fdl(flodl_home, "libtorch", "activate", "stringy"), 2, "no libtorch variant")


@pytest.mark.parametrize("case", ["broken-entries", "home-is-a-file"])
def test_diagnose_never_fails_because_of_the_store(flodl_home, store, tmp_path, case):
    home = flodl_home
    if case == "broken-entries":
        install_variant(store, "stringy")
        store.activate("stringy")
        meta = store.root / "precompiled" / "stringy" / "variant.json"
        meta.write_text(json.dumps({**json.loads(meta.read_text()), "archs": "sm_86"}))
        expected = "precompiled/stringy: variant.json: 'archs' must be a list"
    else:
        home = tmp_path / "a-file"
        home.write_text("not a directory")
        expected = "is not a directory"
    proc = fdl(home, "diagnose", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["libtorch"] is None
    warnings = [f["message"] for f in report["findings"] if f["level"] == "warn"]
    assert any(m.startswith("libtorch store: ") and expected in m for m in warnings), warnings


# ---- item 8: a full disk while activating ---------------------------------------------------

def _tiny_file_size_limit() -> None:  # in the child, before exec
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (4, 4))


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
def test_activate_on_a_full_disk_is_one_error_and_active_is_unchanged(flodl_home, store):
    install_variant(store, "a")
    install_variant(store, "b")
    store.activate("a")
    proc = subprocess.run([sys.executable, "-m", "fdl", "libtorch", "activate", "b"],
                          env=clean_env({"FLODL_HOME": str(flodl_home)}), capture_output=True,
                          text=True, timeout=120, preexec_fn=_tiny_file_size_limit)
    assert_one_error(proc, 1, "cannot write", ".active", "File too large",
                     "the active libtorch is unchanged")
    assert (store.root / ".active").read_text() == "precompiled/a\n"
    assert not [p for p in store.root.iterdir() if p.name.startswith(".active.")]


# ---- items 9, 15, 19: bad input writes nothing ----------------------------------------------

BAD_INPUT = {
    "activate-unknown": (["libtorch", "activate", "nope"], {}, "no libtorch variant 'nope'"),
    "remove-unknown": (["libtorch", "remove", "nope"], {}, "no libtorch variant 'nope'"),
    "variant-dotdot": (["libtorch", "download", "--url", "file:///x/libtorch.zip", "--variant",
                        "../x"], {}, "--variant '../x' is not a plain directory name"),
    "url-ftp": (["libtorch", "download", "--url", "ftp://h/libtorch.zip"], {},
                "has scheme 'ftp'"),
    "url-no-host": (["libtorch", "download", "--url", "https:///libtorch.zip"], {},
                    "names no host"),
    "url-and-cpu": (["libtorch", "download", "--url", "https://h/libtorch.zip", "--cpu"], {},
                    "--url fetches exactly that archive"),
    "bad-sha256": (["libtorch", "download", "--cpu", "--sha256", "zz"], {},
                   "--sha256 must be 64 hex digits"),
    "bad-limit": (["libtorch", "download", "--cpu"], {"FDL_MAX_EXTRACT_BYTES": "-5"},
                  "FDL_MAX_EXTRACT_BYTES='-5' is not a size"),
    "bad-allow-http": (["libtorch", "download", "--cpu"], {"FDL_ALLOW_HTTP": "perhaps"},
                       "FDL_ALLOW_HTTP='perhaps'"),
    "http-mirror": (["libtorch", "download", "--cpu"],
                    {"FDL_LIBTORCH_MIRROR": "http://127.0.0.1:9/libtorch"},
                    "refusing to download over plain http"),
    "setup-http-mirror": (["setup", "--dry-run", "--download"],
                          {"FDL_LIBTORCH_MIRROR": "http://127.0.0.1:9/libtorch"},
                          "refusing to download over plain http"),
    "build-jobs-0": (["libtorch", "build", "--jobs", "0", "--archs", "8.6"], {},
                     "--jobs must be a whole number >= 1, got 0"),
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_on_an_empty_home_is_one_error_and_writes_nothing(flodl_home, case):
    args, env, words = BAD_INPUT[case]
    proc = fdl(flodl_home, *args, **env)
    assert_one_error(proc, 2, words)
    assert proc.stdout == ""
    assert not flodl_home.exists()


@pytest.mark.parametrize("what", ["home", "store"])
def test_flodl_home_that_is_a_file_is_a_usage_error(tmp_path, what):
    home = tmp_path / "home"
    if what == "home":
        home.write_text("a file")
    else:
        home.mkdir()
        (home / "libtorch").write_text("a file")
    for args in (["libtorch", "list"], ["libtorch", "env"], ["libtorch", "activate", "x"],
                 ["libtorch", "download", "--cpu"]):
        proc = fdl(home, *args)
        assert_one_error(proc, 2, "cannot hold the libtorch store", "is not a directory",
                         "FLODL_HOME")
