"""Extract a zip archive safely into a fresh directory (the caller renames it into place).

Guarantees:

* every member name is checked before anything is written: an absolute path, a drive letter
  or a ``..`` that leaves ``dest`` is refused, and so is a symlink whose target would;
* regular files and directories are written first, symlinks last, so no file is ever written
  through a link; once all links exist, each is resolved for real (``os.path.realpath``) and
  one that reaches outside ``dest`` through other links is refused too;
* a corrupt or truncated archive is refused: a missing central directory at open, a bad CRC as
  each member is read (``zipfile`` checks it at the end of every member, so the archive is read
  once, not once to ``testzip()`` and again to extract);
* unix permission bits (``external_attr >> 16``) are kept, without setuid/setgid/sticky;
  directories always stay owner-writable so the store can remove them later;
* on any failure, Ctrl-C included, ``dest`` is removed: nothing half-extracted is left.

Example::

    extract_zip(staging / "libtorch.zip", staging / "libtorch.tree")
"""

from __future__ import annotations

import os
import posixpath
import re
import shutil
import stat
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from fdl.errors import FdlError

_DRIVE = re.compile(r"^[A-Za-z]:")
_ROOT = "/extraction-root"  # stands for dest while names are checked, as plain strings
_COPY_BYTES = 1 << 20


@dataclass(frozen=True)
class _Member:
    info: zipfile.ZipInfo
    relpath: str  # normalised, "/"-separated, inside dest
    mode: int  # unix permission bits, 0 when the archive carries none
    kind: str  # "file", "dir" or "symlink"
    link_target: str = ""


def extract_zip(archive: Path, dest: Path) -> Path:
    """Extract ``archive`` into ``dest``, which must not exist yet; returns ``dest``.

    Raises ``FdlError`` for a corrupt archive, an unsafe member or an existing ``dest``.
    """
    if dest.exists() or dest.is_symlink():
        raise FdlError(f"cannot extract into {dest}: it already exists",
                       hint="remove it, or extract into a new directory")
    try:
        with zipfile.ZipFile(archive) as zf:
            members = [_plan_member(zf, info, archive=archive) for info in zf.infolist()]
            dest.mkdir(parents=True)
            try:
                _extract_all(zf, members, dest, archive=archive)
            except BaseException:
                shutil.rmtree(dest, ignore_errors=True)
                raise
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as exc:
        raise _corrupt(archive, exc) from exc
    except FileNotFoundError as exc:
        if not archive.exists():
            raise FdlError(f"archive not found: {archive}") from exc
        raise FdlError(f"cannot extract {archive}: {exc}") from exc
    except OSError as exc:
        raise FdlError(f"cannot extract {archive} into {dest}: {exc}",
                       hint="check free space and permissions there") from exc
    return dest


def _corrupt(archive: Path, exc: BaseException) -> FdlError:
    return FdlError(f"corrupt or truncated archive {archive}: {exc}",
                    hint="delete it and download again (a mirror may serve a damaged copy)")


def _unsafe(archive: Path, name: str, why: str) -> FdlError:
    return FdlError(f"unsafe member {name!r} in {archive}: {why}; nothing was extracted",
                    hint="the archive is damaged or malicious; get it from a trusted source")


def _plan_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, *, archive: Path) -> _Member:
    name = info.filename
    if name.startswith(("/", "\\")) or _DRIVE.match(name):
        raise _unsafe(archive, name, "absolute path")
    relpath = _inside("", name.replace("\\", "/"))
    if relpath is None:
        raise _unsafe(archive, name, "path leaves the extraction directory")
    if info.flag_bits & 0x1:
        raise FdlError(f"cannot extract {archive}: member {name!r} is encrypted")
    mode = info.external_attr >> 16
    if info.is_dir():
        return _Member(info, relpath, mode & 0o777, "dir")
    if not stat.S_ISLNK(mode):
        return _Member(info, relpath, mode & 0o777, "file")
    target = zf.read(info).decode("utf-8", errors="surrogateescape")
    if target.startswith(("/", "\\")) or _DRIVE.match(target) or "\0" in target:
        raise _unsafe(archive, name, f"symlink to absolute path {target!r}")
    if _inside(posixpath.dirname(relpath), target) is None:
        raise _unsafe(archive, name, f"symlink target {target!r} leaves the extraction directory")
    return _Member(info, relpath, 0, "symlink", target)


def _inside(base: str, path: str) -> str | None:
    """``base/path`` normalised relative to the extraction root, or None if it leaves it."""
    joined = posixpath.normpath(posixpath.join(_ROOT, base, path))
    if joined == _ROOT:
        return "."
    return joined[len(_ROOT) + 1:] if joined.startswith(_ROOT + "/") else None


def _extract_all(zf: zipfile.ZipFile, members: list[_Member], dest: Path, *,
                 archive: Path) -> None:
    for member in members:
        if member.kind == "dir":
            (dest / member.relpath).mkdir(parents=True, exist_ok=True)
        elif member.kind == "file":
            _write_file(zf, member, dest / member.relpath)
    links = [m for m in members if m.kind == "symlink"]
    for member in links:
        path = dest / member.relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(member.link_target, path)
    root = os.path.realpath(dest)
    for member in links:  # a chain of links may leave dest even though each looks inside
        real = os.path.realpath(dest / member.relpath)
        if real != root and not real.startswith(root + os.sep):
            raise _unsafe(archive, member.info.filename,
                          f"symlink resolves outside the extraction directory ({real})")
    for member in sorted(members, key=lambda m: m.relpath.count("/"), reverse=True):
        if member.kind == "dir" and member.mode:  # deepest first, after their contents
            os.chmod(dest / member.relpath, member.mode | stat.S_IRWXU)


def _write_file(zf: zipfile.ZipFile, member: _Member, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # "xb": a duplicate member or a path through something unexpected fails, never overwrites
    with zf.open(member.info) as src, open(path, "xb") as out:
        shutil.copyfileobj(src, out, _COPY_BYTES)
    if member.mode:
        os.chmod(path, member.mode)
