"""The wheel of the running fdl that `fdl init` writes into a project: what it holds, that its
RECORD is true, that it is the same bytes each time, and failures that write nothing."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from io import BytesIO
from pathlib import Path

import pytest

from fdl.errors import FdlError
from fdl.scaffold import create_project
from fdl.scaffold import fdl_wheel as fdl_wheel_module
from fdl.scaffold.fdl_wheel import build_fdl_wheel
from fdl.version import __version__

PACKAGE = Path(fdl_wheel_module.__file__).resolve().parents[1]  # the fdl that runs the tests
DIST_INFO = f"fdl-{__version__}.dist-info"


def entries(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(BytesIO(data)) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def test_the_wheel_holds_the_running_package_and_its_metadata():
    wheel = build_fdl_wheel()
    assert (wheel.version, wheel.source) == (__version__, PACKAGE)
    assert wheel.path == f"wheels/fdl-{__version__}-py3-none-any.whl"
    files = entries(wheel.data)
    package = sorted(name for name in files if not name.startswith(DIST_INFO))
    on_disk = sorted(f"fdl/{path.relative_to(PACKAGE).as_posix()}"
                     for path in PACKAGE.rglob("*") if path.is_file()
                     and "__pycache__" not in path.parts and path.suffix != ".pyc")
    assert package == on_disk
    assert "fdl/scaffold/templates/common/Dockerfile.tmpl" in files  # package data too
    assert files["fdl/version.py"] == (PACKAGE / "version.py").read_bytes()
    meta = files[f"{DIST_INFO}/METADATA"].decode()
    assert f"\nVersion: {__version__}\n" in meta and "Requires-Dist: torch" in meta
    assert "fdl = fdl.cli.main:main" in files[f"{DIST_INFO}/entry_points.txt"].decode()
    assert "Tag: py3-none-any\n" in files[f"{DIST_INFO}/WHEEL"].decode()


def test_record_lists_every_entry_with_its_hash_and_size():
    files = entries(build_fdl_wheel().data)
    record = files.pop(f"{DIST_INFO}/RECORD").decode().splitlines()
    assert record[-1] == f"{DIST_INFO}/RECORD,,"
    rows = dict(line.split(",", 1) for line in record[:-1])
    assert set(rows) == set(files)
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert rows[name] == f"sha256={digest},{len(data)}", name


def test_the_same_files_give_the_same_bytes():
    assert build_fdl_wheel().data == build_fdl_wheel().data


def no_distribution(name):
    return []


class OtherFdl:
    version = "9.9.9"

    def read_text(self, name):
        return "Metadata-Version: 2.1\nName: fdl\nVersion: 9.9.9\n"


@pytest.mark.parametrize(("distribution", "message"), [
    (no_distribution, "cannot package fdl for the project: fdl runs without an installed "
                      "distribution"),
    (lambda name: [OtherFdl()], f"cannot package fdl for the project: the fdl running is "
                              f"{__version__}, the one installed is 9.9.9"),
])
def test_fdl_that_cannot_be_packed_is_one_error_and_writes_nothing(tmp_path, monkeypatch,
                                                                   distribution, message):
    monkeypatch.setattr(fdl_wheel_module.metadata, "distributions",
                        lambda name: distribution(name))
    with pytest.raises(FdlError) as info:
        create_project(tmp_path / "demo", docker=False)
    assert info.value.message.startswith(message) and "\n" not in info.value.message
    assert info.value.exit_code == 1 and "nothing was written" in info.value.hint
    assert list(tmp_path.iterdir()) == []


def test_an_unreadable_package_file_is_one_error_and_writes_nothing(tmp_path, monkeypatch):
    real = Path.read_bytes

    def read_bytes(self):
        if self.name == "version.py":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    with pytest.raises(FdlError) as info:
        create_project(tmp_path / "demo", docker=False)
    assert info.value.message == ("cannot package fdl for the project: Permission denied "
                                  f"({PACKAGE / 'version.py'})")
    assert list(tmp_path.iterdir()) == []
