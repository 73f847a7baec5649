"""Faults of libtorch (and dataset) downloads and extraction, against real parts: `fdl` in a
subprocess, a real HTTP server on 127.0.0.1 (``http_server`` in tests/conftest.py) that cuts,
pauses and redirects on request, a real TLS server for the https -> http redirect, archives built
here with zipfile.

Covered: names that would become paths outside the store, plain http (URL, mirror, redirect,
datasets), archive modes, the extraction size cap, two concurrent downloads of one variant, the
archive left by a failed extraction, a cut connection, a wrong sha256, zip-slip, escaping
symlinks, Ctrl-C in-process and SIGINT to a real `fdl libtorch download`.
"""

from __future__ import annotations

import hashlib
import io
import os
import queue
import signal
import ssl
import stat
import subprocess
import sys
import threading
import zipfile
from contextlib import AbstractContextManager, ExitStack
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from helpers import (
    GUARD_S,
    assert_one_error,
    clean_env,
    libtorch_list,
    run_fdl,
    self_signed_cert,
    started,
    wait_until,
)

from fdl.download.fetch import download
from fdl.errors import FdlError, UsageError
from fdl.libtorch.extract import extract_zip

CPU_PATH = "cpu/libtorch-shared-with-deps-{v}%2Bcpu.zip"
DATA = bytes(range(256)) * (3 * 4096 + 7)  # ~3 MiB, not a multiple of any chunk size
DIGEST = hashlib.sha256(DATA).hexdigest()
FAST = {"backoff_s": 0.01, "chunk_size": 1 << 16, "allow_http": True}  # 127.0.0.1: opted in


# ---- archives -------------------------------------------------------------------------------

def _entry(name: str, mode: int, compression: int) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))
    info.create_system = 3  # unix: external_attr >> 16 is st_mode
    info.external_attr = mode << 16
    info.compress_type = compression  # writestr(ZipInfo) takes it from here
    return info


def make_zip(members, *, compression=zipfile.ZIP_STORED) -> bytes:
    """members: (name, data, mode) for files and dirs (name ends with /), (name, "->", target)
    for symlinks."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=compression) as zf:
        for name, data, extra in members:
            if data == "->":
                zf.writestr(_entry(name, stat.S_IFLNK | 0o777, compression), extra)
            elif name.endswith("/"):
                zf.writestr(_entry(name, stat.S_IFDIR | extra, compression), b"")
            else:
                zf.writestr(_entry(name, stat.S_IFREG | extra, compression), data)
    return buffer.getvalue()


LIBTORCH = [
    ("libtorch/", b"", 0o755),
    ("libtorch/lib/", b"", 0o755),
    ("libtorch/lib/libc10.so.2", b"\x7fELF c10", 0o755),
    ("libtorch/lib/libc10.so", "->", "libc10.so.2"),
    ("libtorch/include/torch/torch.h", b"#pragma once\n", 0o644),
    ("libtorch/build-version", b"2.13.0+cpu\n", 0o644),
]


def libtorch_zip(*extra, pad: int = 0) -> bytes:
    """A stand-in libtorch archive (+ ``extra`` members, + ``pad`` bytes in one library)."""
    return make_zip([*LIBTORCH, ("libtorch/lib/libtorch_cpu.so", bytes(64 + pad), 0o755),
                     *extra])


# ---- the CLI against the local server -------------------------------------------------------

def staging_names(env: dict[str, str]) -> list[str]:
    staging = Path(env["FLODL_HOME"]) / "libtorch" / ".staging"
    return sorted(p.name for p in staging.iterdir()) if staging.is_dir() else []


def popen_fdl(env: dict[str, str], *args: str) -> AbstractContextManager[subprocess.Popen]:
    """``fdl`` as a terminal starts it: with SIGINT's default disposition. A pytest started in
    the background by a non-interactive shell ignores SIGINT, children inherit an ignored
    signal, and the Ctrl-C test then saw its SIGINT ignored and the download finish. A context
    manager (helpers.started): whatever still runs on the way out is killed."""
    return started([sys.executable, "-m", "fdl", *args], env=clean_env(env),
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                   preexec_fn=_default_sigint)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# ---- item 2: names become paths before they are checked -------------------------------------

@pytest.mark.parametrize("how", ["variant", "url"])
def test_a_name_with_dotdot_writes_and_deletes_nothing_outside_the_home(http_server,
                                                                      mirror_env, tmp_path, how):
    home = tmp_path / "a" / "b" / "c" / "home"
    env = {**mirror_env, "FLODL_HOME": str(home)}
    victim = home.parent / "victim.tree"  # <staging>/../../../victim.tree
    victim.mkdir(parents=True)
    (victim / "precious").write_text("mine")
    http_server.files["site/libtorch.zip"] = http_server.files["site/..%2F..%2F..%2Fvictim.zip"] \
        = libtorch_zip()
    if how == "variant":
        args = ["--url", http_server.url("site/libtorch.zip"), "--variant", "../../../victim"]
    else:
        args = ["--url", http_server.url("site/..%2F..%2F..%2Fvictim.zip")]
    proc = run_fdl("libtorch", "download", *args, env=env)
    if how == "variant":
        assert_one_error(proc, 2, "../../../victim", "not a plain directory name", "--variant")
        assert not home.exists() and http_server.requests == []
    else:  # the URL's file name names nothing: the archive's build-version does
        assert proc.returncode == 0, proc.stderr
        assert [p.name for p in (home / "libtorch" / "precompiled").iterdir()] == ["2.13.0-cpu"]
    assert (victim / "precious").read_text() == "mine"
    assert sorted(p.name for p in home.parent.iterdir()) == ["home", "victim.tree"][
        how == "variant":]  # no victim.zip


# ---- item 4: plain http, archive modes, the size cap ----------------------------------------

@pytest.mark.parametrize("command", [
    ["libtorch", "download", "--url", "{url}", "--variant", "site"],
    ["libtorch", "download", "--cpu", "--version", "2.13.0"],  # the mirror is http
    ["setup", "--yes", "--download"],
])
def test_plain_http_is_refused_without_the_opt_in(http_server, mirror_env, command):
    from fdl.libtorch.catalog import latest_version

    for path in ("site/libtorch.zip", CPU_PATH.format(v="2.13.0"),
                 CPU_PATH.format(v=latest_version())):  # what would be installed, over http
        http_server.files[path] = libtorch_zip()
    env = {k: v for k, v in mirror_env.items() if k != "FDL_ALLOW_HTTP"}
    args = [a.replace("{url}", http_server.url("site/libtorch.zip")) for a in command]
    proc = run_fdl(*args, env=env)
    assert_one_error(proc, 2, "refusing to download over plain http: http://127.0.0.1",
                     "--allow-http", "FDL_ALLOW_HTTP=1")
    assert http_server.requests == [] and not Path(env["FLODL_HOME"]).exists()


def test_allow_http_flag_and_a_bad_allow_http_value(http_server, mirror_env):
    http_server.files["site/libtorch.zip"] = libtorch_zip()
    url = http_server.url("site/libtorch.zip")
    bad = run_fdl("libtorch", "download", "--url", url, "--variant", "site",
                  env={**mirror_env, "FDL_ALLOW_HTTP": "sure"})
    assert_one_error(bad, 2, "FDL_ALLOW_HTTP='sure'", "allowed: 1, true, yes, 0, false, no")
    assert not Path(mirror_env["FLODL_HOME"]).exists()
    opted_in = {k: v for k, v in mirror_env.items() if k != "FDL_ALLOW_HTTP"}
    proc = run_fdl("libtorch", "download", "--url", url, "--variant", "site", "--allow-http",
                   env=opted_in)
    assert proc.returncode == 0, proc.stderr
    assert libtorch_list(mirror_env)["active"] == "precompiled/site"


@pytest.fixture
def https_redirect(tmp_path, http_server, monkeypatch):
    """A real TLS server on 127.0.0.1 (self-signed certificate, trusted through SSL_CERT_FILE)
    that answers every GET with a 302 to the same path on the plain-http ``http_server``."""
    cert, key = self_signed_cert(tmp_path)

    class Redirect(BaseHTTPRequestHandler):
        def log_message(self, format, *args):
            pass

        def do_GET(self):
            self.send_response(302)
            self.send_header("Location", http_server.url(self.path))
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def test_https_redirecting_to_http_is_refused_unless_opted_in(http_server, https_redirect,
                                                              tmp_path):
    from fdl.bench import fetch

    data = libtorch_zip()
    http_server.files["libtorch.zip"] = data
    dest = tmp_path / "store" / "libtorch.zip"
    with pytest.raises(FdlError) as err:
        download(https_redirect + "libtorch.zip", dest)
    assert err.value.message == ("refusing a redirect to plain http: "
                                 + http_server.url("libtorch.zip"))
    assert "FDL_ALLOW_HTTP=1" in err.value.hint
    with pytest.raises(FdlError, match="refusing a redirect to plain http"):  # datasets too
        fetch.download([https_redirect + "libtorch.zip"], tmp_path / "data.bin",
                       expected="sha256:" + hashlib.sha256(data).hexdigest(), progress=None)
    assert http_server.requests == []  # the http hop was never requested
    assert not dest.exists() and not (tmp_path / "data.bin").exists()

    result = download(https_redirect + "libtorch.zip", dest, allow_http=True)  # opted in
    assert result.path.read_bytes() == data


def test_dataset_download_over_plain_http_is_refused_before_any_request(http_server,
                                                                        tmp_path):
    from fdl.bench import fetch

    http_server.files["input.txt"] = b"text"
    with pytest.raises(UsageError) as err:
        fetch.download([http_server.url("input.txt")], tmp_path / "input.txt",
                       expected="sha256:" + hashlib.sha256(b"text").hexdigest(), progress=None)
    assert "plain http" in err.value.message and "FDL_ALLOW_HTTP=1" in err.value.hint
    assert http_server.requests == [] and list(tmp_path.iterdir()) == []


def test_extracted_modes_lose_group_and_other_write_and_set_id_bits(tmp_path):
    archive = tmp_path / "modes.zip"
    archive.write_bytes(make_zip([
        ("open/", b"", 0o777), ("setgid/", b"", 0o2775), ("sticky/", b"", 0o1777),
        ("open/anyone.so", b"x", 0o777), ("setuid", b"x", 0o4777), ("setgid/f", b"x", 0o2664),
        ("plain.h", b"x", 0o644), ("readonly", b"x", 0o444), ("no-mode", b"x", 0),
        ("implicit/parent/file", b"x", 0o644),  # its directories are not members
    ]))
    old_umask = os.umask(0)  # whatever the umask, nothing lands group/other-writable
    try:
        dest = extract_zip(archive, tmp_path / "tree")
    finally:
        os.umask(old_umask)
    modes = {str(p.relative_to(dest)): stat.S_IMODE(p.lstat().st_mode) for p in dest.rglob("*")}
    assert modes == {"open": 0o755, "setgid": 0o755, "sticky": 0o755, "open/anyone.so": 0o755,
                     "setuid": 0o755, "setgid/f": 0o644, "plain.h": 0o644, "readonly": 0o444,
                     "no-mode": 0o644, "implicit": 0o755, "implicit/parent": 0o755,
                     "implicit/parent/file": 0o644}
    assert stat.S_IMODE(dest.stat().st_mode) == 0o755


def test_an_archive_declaring_more_than_the_limit_is_refused_before_writing(tmp_path):
    archive = tmp_path / "bomb.zip"  # 16 MiB of zeros deflate to a few KiB
    archive.write_bytes(make_zip([*LIBTORCH, ("libtorch/lib/zeros.so", bytes(16 << 20), 0o644)],
                                 compression=zipfile.ZIP_DEFLATED))
    assert archive.stat().st_size < 100_000
    with pytest.raises(FdlError) as err:
        extract_zip(archive, tmp_path / "tree", max_bytes=8 << 20)
    assert "would unpack to 16.0 MiB" in err.value.message
    assert "limit of 8.0 MiB" in err.value.message and "FDL_MAX_EXTRACT_BYTES" in err.value.hint
    assert not (tmp_path / "tree").exists()
    extract_zip(archive, tmp_path / "tree", max_bytes=17 << 20)  # within the limit: fine


def test_a_member_inflating_beyond_its_declared_size_gets_no_further(tmp_path):
    payload = bytes(1 << 20)
    raw = bytearray(make_zip([("libtorch/lib/liar.so", payload, 0o644)],
                             compression=zipfile.ZIP_DEFLATED))
    declared = 100  # the local header and the central directory both say 100 bytes
    for header, offset in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):
        at = raw.index(header) + offset
        assert int.from_bytes(raw[at:at + 4], "little") == len(payload)
        raw[at:at + 4] = declared.to_bytes(4, "little")
    archive = tmp_path / "liar.zip"
    archive.write_bytes(bytes(raw))
    with pytest.raises(FdlError):
        extract_zip(archive, tmp_path / "tree", max_bytes=1000)
    assert not (tmp_path / "tree").exists()


def test_a_download_larger_than_the_limit_is_refused_and_not_kept(http_server, tmp_path):
    http_server.files["libtorch.zip"] = DATA
    dest = tmp_path / "libtorch.zip"
    with pytest.raises(FdlError) as err:  # announced by Content-Length: the body is not read
        download(http_server.url("libtorch.zip"), dest, max_bytes=1 << 20, **FAST)
    assert err.value.message.startswith(f"refusing a download of more than {1 << 20} bytes")
    assert "FDL_MAX_EXTRACT_BYTES" in err.value.hint
    source = tmp_path / "local.zip"
    source.write_bytes(DATA)
    with pytest.raises(FdlError, match="refusing a download of more than"):
        download(source.as_uri(), dest, max_bytes=1 << 20, **FAST)
    assert len(http_server.requests) == 1  # never retried
    assert sorted(p.name for p in tmp_path.iterdir()) == ["local.zip"]  # no .part kept


@pytest.mark.parametrize("limit, valid", [("64K", True), ("lots", False), ("0", False)])
def test_the_extraction_limit_is_read_from_the_environment(http_server, mirror_env, limit,
                                                           valid):
    http_server.files[CPU_PATH.format(v="2.13.0")] = make_zip(  # ~2 KiB that unpack to 1 MiB
        [*LIBTORCH, ("libtorch/lib/zeros.so", bytes(1 << 20), 0o644)],
        compression=zipfile.ZIP_DEFLATED)
    proc = run_fdl("libtorch", "download", "--cpu", "--version", "2.13.0",
                   env={**mirror_env, "FDL_MAX_EXTRACT_BYTES": limit})
    if valid:  # the archive is downloaded, refused, and not kept
        assert_one_error(proc, 1, "would unpack to", "limit of 64.0 KiB", "FDL_MAX_EXTRACT_BYTES",
                         alone=False)  # after the progress bar
        assert staging_names(mirror_env) == []
    else:  # refused before anything is fetched or written
        assert_one_error(proc, 2, f"FDL_MAX_EXTRACT_BYTES={limit!r} is not a size")
        assert http_server.requests == [] and not Path(mirror_env["FLODL_HOME"]).exists()
    assert libtorch_list(mirror_env)["variants"] == []


# ---- item 5: two concurrent downloads of one variant ----------------------------------------

def _lines(stream, into: queue.Queue) -> None:
    for line in stream:
        into.put(line)
    into.put(None)


def test_two_concurrent_downloads_of_one_variant_make_one_install(http_server, mirror_env):
    data = libtorch_zip(pad=1 << 20)
    http_server.files[CPU_PATH.format(v="2.13.0")] = data
    hold = http_server.Act(pause_after=0)  # the first answer waits after its headers
    http_server.script.append(hold)
    args = ["libtorch", "download", "--cpu", "--version", "2.13.0"]
    part = Path(mirror_env["FLODL_HOME"]) / "libtorch" / ".staging" / "2.13.0-cpu.zip.part"
    with ExitStack() as running:
        first = running.enter_context(popen_fdl(mirror_env, *args))
        try:
            wait_until(part.exists, "the first download's staging file", proc=first)
            second = running.enter_context(popen_fdl(mirror_env, *args))
            lines: queue.Queue = queue.Queue()
            threading.Thread(target=_lines, args=(second.stderr, lines), daemon=True).start()
            seen = []
            while not any("waiting for another fdl process" in line for line in seen):
                line = lines.get(timeout=GUARD_S)
                assert line is not None, f"the second download never waited: {''.join(seen)}"
                seen.append(line)
        finally:
            hold.release.set()
        out_first = first.communicate(timeout=GUARD_S)
        assert second.wait(timeout=GUARD_S) == 0, "".join(seen)
        assert first.returncode == 0, out_first[1]
    doc = libtorch_list(mirror_env)
    assert doc["active"] == "precompiled/2.13.0-cpu" and len(doc["variants"]) == 1
    assert doc["variants"][0]["sha256"] == hashlib.sha256(data).hexdigest()
    assert Path(doc["variants"][0]["path"], "lib", "libtorch_cpu.so").is_file()
    assert len(http_server.requests) == 1  # the second reused the first one's install
    assert staging_names(mirror_env) == []


# ---- item 6 and the archive faults: nothing kept after a failed extraction ------------------

def _truncated() -> bytes:
    good = libtorch_zip()
    return good[:len(good) // 2]


def _bad_crc() -> bytes:
    payload = bytes(range(256)) * 64
    raw = bytearray(libtorch_zip(("libtorch/lib/big.so", payload, 0o644)))
    raw[raw.index(payload) + 100] ^= 0xFF  # same size, different bytes: only the CRC notices
    return bytes(raw)


@pytest.mark.parametrize("archive, words", [
    (_truncated, ["corrupt or truncated archive"]),
    (_bad_crc, ["corrupt or truncated archive", "CRC"]),
    (lambda: libtorch_zip(("../../escaped.txt", b"outside", 0o644)),
     ["unsafe member '../../escaped.txt'", "leaves the extraction directory"]),
    (lambda: libtorch_zip(("libtorch/etc", "->", "/etc")), ["symlink to absolute path"]),
], ids=["truncated", "bad-crc", "zip-slip", "symlink"])
def test_a_failed_extraction_installs_nothing_and_keeps_no_archive(http_server, mirror_env,
                                                                   tmp_path, archive, words):
    http_server.files[CPU_PATH.format(v="2.13.0")] = archive()
    proc = run_fdl("libtorch", "download", "--cpu", "--version", "2.13.0", env=mirror_env)
    assert_one_error(proc, 1, *words, alone=False)  # after the progress bar
    assert libtorch_list(mirror_env) == {"schema": 1, "active": None, "variants": []}
    assert staging_names(mirror_env) == []  # no .zip, .part, .tree or lock
    assert not (tmp_path / "escaped.txt").exists()
    assert not (Path(mirror_env["FLODL_HOME"]) / "escaped.txt").exists()


@pytest.mark.filterwarnings("ignore:Duplicate name")  # zipfile warns while building one
@pytest.mark.parametrize("name, why", [
    ("../evil.txt", "leaves the extraction directory"),
    ("libtorch/../../evil.txt", "leaves the extraction directory"),
    ("/tmp/evil.txt", "absolute path"),
    ("C:/evil.txt", "absolute path"),
    ("..\\evil.txt", "leaves the extraction directory"),
    ("libtorch/lib/libc10.so.2", "appears twice"),
    ("libtorch/lib/libc10.so/x", "lies below 'libtorch/lib/libc10.so', a symlink"),
])
def test_zip_slip_member_is_refused_and_nothing_is_left(tmp_path, name, why):
    archive = tmp_path / "bad.zip"
    archive.write_bytes(libtorch_zip((name, b"pwned", 0o644)))
    dest = tmp_path / "tree"
    with pytest.raises(FdlError) as err:
        extract_zip(archive, dest)
    assert "unsafe member" in err.value.message and why in err.value.message
    assert not dest.exists()
    assert not (tmp_path / "evil.txt").exists()


@pytest.mark.parametrize("links", [
    [("libtorch/lib/up", "->", "../../..")],
    [("libtorch/etc", "->", "/etc")],
    # each link looks inside on its own; followed for real, s2 -> x/y/s1/.. -> dest/.. (outside)
    [("x/y/s1", "->", "../.."), ("s2", "->", "x/y/s1/..")],
    [("s2", "->", "x/y/s1/.."), ("x/y/s1", "->", "../..")],  # the same, in the other order
    [("libtorch/long", "->", "a/" * 3000)],  # read into memory: refused by its size
])
def test_symlink_escaping_dest_is_refused(tmp_path, links):
    archive = tmp_path / "bad.zip"
    archive.write_bytes(libtorch_zip(*links))
    dest = tmp_path / "tree"
    with pytest.raises(FdlError) as err:
        extract_zip(archive, dest)
    assert "symlink" in err.value.message
    assert not dest.exists()


# ---- a cut connection, a wrong sha256 -------------------------------------------------------

def test_resume_after_the_server_cuts_the_connection(http_server, tmp_path):
    http_server.files["libtorch.zip"] = DATA
    http_server.script.append(http_server.Act(cut_after=1 << 20))
    dest = tmp_path / "libtorch.zip"
    result = download(http_server.url("libtorch.zip"), dest, expected=DIGEST, **FAST)
    assert result.resumed is True
    assert dest.read_bytes() == DATA and result.sha256 == DIGEST
    assert [r["range"] for r in http_server.requests] == [None, f"bytes={1 << 20}-"]


def test_checksum_mismatch_deletes_the_part_and_names_both_digests(http_server, tmp_path):
    http_server.files["libtorch.zip"] = DATA
    dest = tmp_path / "libtorch.zip"
    wrong = "0" * 64
    with pytest.raises(FdlError) as err:
        download(http_server.url("libtorch.zip"), dest, expected=wrong, **FAST)
    assert wrong in err.value.message and DIGEST in err.value.message
    assert not dest.exists() and not dest.with_name(dest.name + ".part").exists()


def test_checksum_mismatch_installs_nothing(http_server, mirror_env):
    http_server.files[CPU_PATH.format(v="2.13.0")] = libtorch_zip()
    proc = run_fdl("libtorch", "download", "--cpu", "--version", "2.13.0", "--sha256", "0" * 64,
                   env=mirror_env)
    assert_one_error(proc, 1, "checksum mismatch", "sha256", alone=False)  # after the progress
    assert libtorch_list(mirror_env) == {"schema": 1, "active": None, "variants": []}
    assert staging_names(mirror_env) == []


# ---- Ctrl-C ---------------------------------------------------------------------------------

def test_ctrl_c_during_download_leaves_the_previous_file_intact(http_server, tmp_path):
    http_server.files["libtorch.zip"] = DATA
    dest = tmp_path / "libtorch.zip"
    dest.write_bytes(b"the previous archive")

    def interrupt(done, total):
        if done > 1 << 20:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        download(http_server.url("libtorch.zip"), dest, progress=interrupt, **FAST)
    assert dest.read_bytes() == b"the previous archive"
    kept = dest.with_name(dest.name + ".part").read_bytes()
    assert 0 < len(kept) < len(DATA) and DATA.startswith(kept)

    result = download(http_server.url("libtorch.zip"), dest, expected=DIGEST, **FAST)
    assert result.resumed is True and dest.read_bytes() == DATA
    assert http_server.requests[-1]["range"] == f"bytes={len(kept)}-"


def test_sigint_mid_download_exits_130_installs_nothing_and_the_rerun_resumes(http_server,
                                                                              mirror_env):
    http_server.files[CPU_PATH.format(v="2.13.0")] = libtorch_zip()
    first = run_fdl("libtorch", "download", "--cpu", "--version", "2.13.0", env=mirror_env)
    assert first.returncode == 0, first.stderr
    data = libtorch_zip(pad=4 << 20)
    http_server.files[CPU_PATH.format(v="2.12.0")] = data
    hold = http_server.Act(pause_after=2 << 20)  # 2 MiB, then the server waits
    http_server.script.append(hold)
    part = Path(mirror_env["FLODL_HOME"]) / "libtorch" / ".staging" / "2.12.0-cpu.zip.part"
    with popen_fdl(mirror_env, "libtorch", "download", "--cpu", "--version", "2.12.0") as proc:
        try:
            wait_until(lambda: part.exists() and part.stat().st_size >= 1 << 20,
                       "the download's staging file to hold 1 MiB", proc=proc)
            proc.send_signal(signal.SIGINT)
            _, stderr = proc.communicate(timeout=GUARD_S)
        finally:
            hold.release.set()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == "interrupted"
    doc = libtorch_list(mirror_env)
    assert doc["active"] == "precompiled/2.13.0-cpu"
    assert [v["id"] for v in doc["variants"]] == ["precompiled/2.13.0-cpu"]
    kept = part.stat().st_size
    assert 0 < kept < len(data)
    assert staging_names(mirror_env) == ["2.12.0-cpu.zip.part"]  # kept to resume; no lock
    shown = run_fdl("libtorch", "list", env=mirror_env)
    assert f"partial download: {part}" in shown.stderr

    rerun = run_fdl("libtorch", "download", "--cpu", "--version", "2.12.0", env=mirror_env)
    assert rerun.returncode == 0, rerun.stderr
    assert http_server.requests[-1]["range"] == f"bytes={kept}-"
    doc = libtorch_list(mirror_env)
    assert doc["active"] == "precompiled/2.12.0-cpu"
    entry = next(v for v in doc["variants"] if v["id"] == "precompiled/2.12.0-cpu")
    assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert staging_names(mirror_env) == []
