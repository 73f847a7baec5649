"""fdl.libtorch.extract on archives built here with zipfile: good ones and broken ones (hostile
ones, modes and sizes: tests/faults/test_download_faults.py)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import zipfile

import pytest
from helpers import GUARD_S, clean_env

import fdl.libtorch.extract as extract_mod
from fdl.errors import FdlError
from fdl.libtorch.extract import extract_zip


def _entry(name: str, mode: int) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))
    info.create_system = 3  # unix: external_attr >> 16 is st_mode
    info.external_attr = mode << 16
    return info


def _zip(path, members, *, compression=zipfile.ZIP_DEFLATED):
    """members: (name, data, mode) for files and dirs, (name, "->", target) for symlinks."""
    with zipfile.ZipFile(path, "w", compression=compression) as zf:
        for name, data, extra in members:
            if data == "->":
                zf.writestr(_entry(name, stat.S_IFLNK | 0o777), extra)
            elif name.endswith("/"):
                zf.writestr(_entry(name, stat.S_IFDIR | extra), b"")
            else:
                zf.writestr(_entry(name, stat.S_IFREG | extra), data)
    return path


LIBTORCH = [
    ("libtorch/", b"", 0o755),
    ("libtorch/lib/", b"", 0o755),
    ("libtorch/lib/libc10.so.2", b"\x7fELF c10", 0o755),
    ("libtorch/lib/libc10.so", "->", "libc10.so.2"),
    ("libtorch/bin/protoc", b"#!/bin/sh\n", 0o4755),  # setuid is dropped
    ("libtorch/include/torch/csrc/api/include/torch/torch.h", b"#pragma once\n", 0o644),
    ("libtorch/build-version", b"2.13.0+cu130\n", 0o644),
]


def test_extracts_nested_dirs_modes_and_symlinks(tmp_path):
    archive = _zip(tmp_path / "libtorch.zip", LIBTORCH)
    dest = tmp_path / "tree"
    assert extract_zip(archive, dest) == dest
    lib = dest / "libtorch" / "lib"
    assert (lib / "libc10.so.2").read_bytes() == b"\x7fELF c10"
    assert stat.S_IMODE((lib / "libc10.so.2").stat().st_mode) == 0o755
    assert stat.S_IMODE((dest / "libtorch/bin/protoc").stat().st_mode) == 0o755
    assert stat.S_IMODE((dest / "libtorch/build-version").stat().st_mode) == 0o644
    assert (lib / "libc10.so").is_symlink()
    assert os.readlink(lib / "libc10.so") == "libc10.so.2"
    assert (lib / "libc10.so").read_bytes() == b"\x7fELF c10"
    header = dest / "libtorch/include/torch/csrc/api/include/torch/torch.h"
    assert header.read_bytes() == b"#pragma once\n"


def test_stored_archive_and_names_with_inner_dotdot(tmp_path):
    archive = _zip(tmp_path / "a.zip", [("a/b/../c.txt", b"c", 0o644)],
                   compression=zipfile.ZIP_STORED)
    extract_zip(archive, tmp_path / "tree")
    assert (tmp_path / "tree/a/c.txt").read_bytes() == b"c"


def test_truncated_archive_is_refused(tmp_path):
    good = _zip(tmp_path / "good.zip", LIBTORCH).read_bytes()
    truncated = tmp_path / "truncated.zip"
    truncated.write_bytes(good[: len(good) // 2])
    with pytest.raises(FdlError) as err:
        extract_zip(truncated, tmp_path / "tree")
    assert "corrupt or truncated archive" in err.value.message
    assert not (tmp_path / "tree").exists()


def test_bad_crc_is_refused_and_nothing_is_left(tmp_path):
    payload = b"A" * 4096
    archive = _zip(tmp_path / "a.zip", [("ok.txt", b"fine", 0o644), ("big.bin", payload, 0o644)],
                   compression=zipfile.ZIP_STORED)
    raw = bytearray(archive.read_bytes())
    raw[raw.index(payload) + 100] ^= 0xFF  # same size, different bytes: only the CRC notices
    archive.write_bytes(bytes(raw))
    with pytest.raises(FdlError) as err:
        extract_zip(archive, tmp_path / "tree")
    assert "corrupt or truncated archive" in err.value.message
    assert not (tmp_path / "tree").exists()


def test_existing_dest_is_refused(tmp_path):
    archive = _zip(tmp_path / "a.zip", LIBTORCH)
    dest = tmp_path / "tree"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    with pytest.raises(FdlError) as err:
        extract_zip(archive, dest)
    assert "already exists" in err.value.message
    assert (dest / "keep.txt").read_text() == "mine"


def test_missing_archive(tmp_path):
    with pytest.raises(FdlError, match="archive not found"):
        extract_zip(tmp_path / "nope.zip", tmp_path / "tree")


def test_a_full_disk_mid_extraction_removes_dest(tmp_path):
    """A real full disk: extraction in a child whose file-size limit (RLIMIT_FSIZE) is 64 KiB,
    of an archive whose third file is 256 KiB: two files are written, the third fails as on a
    full disk, and nothing half-extracted is left."""
    archive = _zip(tmp_path / "a.zip", [
        ("libtorch/lib/libc10.so", b"c10", 0o755),
        ("libtorch/include/torch.h", b"#pragma once\n", 0o644),
        ("libtorch/lib/libtorch_cpu.so", bytes(1 << 18), 0o755),
    ])
    dest = tmp_path / "tree"
    script = textwrap.dedent(f"""
        import json, resource, signal
        from pathlib import Path
        from fdl.errors import FdlError
        from fdl.libtorch.extract import extract_zip
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
        try:
            extract_zip(Path({str(archive)!r}), Path({str(dest)!r}))
        except FdlError as exc:
            print(json.dumps([exc.message, exc.hint]))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=GUARD_S, env=clean_env())
    assert proc.returncode == 0 and proc.stdout, proc.stderr
    message, hint = json.loads(proc.stdout)
    assert message.startswith(f"cannot extract {archive} into {dest}: ") and "too large" in message
    assert hint == "check free space and permissions there"
    assert not dest.exists()


def test_ctrl_c_mid_extraction_removes_dest(tmp_path, monkeypatch):
    archive = _zip(tmp_path / "a.zip", LIBTORCH)
    real_write = extract_mod._write_file
    written = []

    def write_then_interrupt(zf, member, path, **kwargs):
        real_write(zf, member, path, **kwargs)
        written.append(path)
        if len(written) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(extract_mod, "_write_file", write_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        extract_zip(archive, tmp_path / "tree")
    assert len(written) == 2
    assert not (tmp_path / "tree").exists()
