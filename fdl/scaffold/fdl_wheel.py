"""The wheel of the running fdl that ``fdl init`` puts in the project's ``wheels/`` folder.

No package index has fdl, so a project that says ``fdl[torch]`` installs only where fdl already
is. Instead the project carries the fdl that wrote it: ``wheels/fdl-<version>-py3-none-any.whl``,
which its Makefile, README and Dockerfile install (torch still comes from PyTorch's index).

The wheel is packed here, in memory, from the files that are running: the ``fdl`` package
folder (a checkout for an editable install, site-packages otherwise; ``__pycache__``, compiled
and hidden files left out) and the installed distribution's ``METADATA`` and
``entry_points.txt`` (the dependencies and the ``fdl`` command). A wheel is a zip of those plus
``WHEEL`` and ``RECORD`` (PEP 427), so this needs no network, no pip, setuptools or build
backend in fdl's environment, and writes nothing into a checkout (``pip wheel`` of the source
would: ``build/`` and ``fdl.egg-info``, and it needs setuptools where fdl runs, which a venv
of Python 3.12 does not have). It takes a fraction of a second. Entries are sorted and dated
1980-01-01, so the same files give the same bytes.
"""

from __future__ import annotations

import base64
import hashlib
import io
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from fdl import version
from fdl.errors import FdlError

WHEEL_FOLDER = "wheels"
_TAG = "py3-none-any"  # pure Python: fdl ships no compiled code
_DATE = (1980, 1, 1, 0, 0, 0)  # the earliest a zip can hold: reproducible bytes
_LEFT_OUT = frozenset({"__pycache__"})
_LEFT_OUT_SUFFIXES = (".pyc", ".pyo")


@dataclass(frozen=True)
class FdlWheel:
    """The running fdl as a wheel: its version, its bytes, and the folder it was packed from."""

    version: str
    data: bytes
    source: Path

    @property
    def filename(self) -> str:
        return f"fdl-{self.version.replace('-', '_')}-{_TAG}.whl"

    @property
    def path(self) -> str:
        """Where it goes in the project (forward slashes: also the Dockerfile's and pip's)."""
        return f"{WHEEL_FOLDER}/{self.filename}"


def build_fdl_wheel() -> FdlWheel:
    """Pack the running fdl; FdlError (exit 1) when its files or metadata cannot be read."""
    package = Path(version.__file__).resolve().parent
    try:
        dist_info = _dist_info_files(version.__version__)
        files = {f"fdl/{relative}": (package / relative).read_bytes()
                 for relative in _package_files(package)}
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise FdlError(f"cannot package fdl for the project: {exc.strerror or exc}{where}",
                       hint="check that fdl's installed files are readable; nothing was "
                            "written") from exc
    data = _zip(files, dist_info, f"fdl-{version.__version__.replace('-', '_')}.dist-info")
    return FdlWheel(version.__version__, data, package)


def _dist_info_files(running: str) -> dict[str, bytes]:
    """METADATA and entry_points.txt of the installed fdl, checked to be the running one's."""
    # An editable install leaves fdl.egg-info in the checkout, found first from there; its
    # PKG-INFO is the same core metadata as a dist-info's METADATA.
    found = [(dist, dist.read_text("METADATA") or dist.read_text("PKG-INFO"))
             for dist in metadata.distributions(name="fdl")]
    dist, text = next(((d, t) for d, t in found if t), (None, None))
    if dist is None or text is None:
        raise FdlError("cannot package fdl for the project: fdl runs without an installed "
                       "distribution (its METADATA is what the project's wheel needs)",
                       hint="install fdl (pip install -e <checkout>) and run fdl init again; "
                            "nothing was written")
    if dist.version != running:
        raise FdlError(f"cannot package fdl for the project: the fdl running is {running}, "
                       f"the one installed is {dist.version}",
                       hint="reinstall fdl (pip install -e <checkout>) and run fdl init again; "
                            "nothing was written")
    files = {"METADATA": text.encode("utf-8")}
    entry_points = dist.read_text("entry_points.txt")
    if entry_points:
        files["entry_points.txt"] = entry_points.encode("utf-8")
    files["WHEEL"] = (f"Wheel-Version: 1.0\nGenerator: fdl init (fdl {running})\n"
                      f"Root-Is-Purelib: true\nTag: {_TAG}\n").encode()
    return files


def _package_files(package: Path) -> list[str]:
    """Every file of the package, relative and sorted, without caches and hidden files."""
    found = []
    for path in package.rglob("*"):
        parts = path.relative_to(package).parts
        if (path.is_file() and not path.name.endswith(_LEFT_OUT_SUFFIXES)
                and not any(part in _LEFT_OUT or part.startswith(".") for part in parts)):
            found.append("/".join(parts))
    return sorted(found)


def _zip(files: dict[str, bytes], dist_info: dict[str, bytes], dist_folder: str) -> bytes:
    """The wheel's bytes: ``files``, then the dist-info folder with RECORD last (PEP 427)."""
    entries = {**files, **{f"{dist_folder}/{name}": data for name, data in dist_info.items()}}
    record = [f"{name},sha256={_digest(data)},{len(data)}" for name, data in entries.items()]
    record.append(f"{dist_folder}/RECORD,,")
    entries[f"{dist_folder}/RECORD"] = ("\n".join(record) + "\n").encode("utf-8")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in entries.items():
            info = zipfile.ZipInfo(name, date_time=_DATE)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, data)
    return buffer.getvalue()


def _digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode("ascii")
