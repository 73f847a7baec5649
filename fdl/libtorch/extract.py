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
* unix permission bits (``external_attr >> 16``) are kept without group/other write and
  without setuid/setgid/sticky (a ``0777`` member lands ``0755``); members without bits get
  ``0644`` (files) or ``0755`` (directories), whatever the umask; directories always stay
  owner-writable so the store can remove them later;
* size: the sum of the members' declared sizes must stay within ``max_bytes`` (default 32 GiB,
  ``FDL_MAX_EXTRACT_BYTES``; a CUDA libtorch unpacks to a few GiB), checked before anything is
  written, and every member is counted as it is written, so one that inflates beyond its
  declared size is refused before it gets past its share;
* a name used twice, or a member below something the archive makes a file or a symlink, is
  refused before anything is written;
* on any failure, Ctrl-C included, ``dest`` is removed: nothing half-extracted is left.

Example::

    extract_zip(staging / "libtorch.zip", staging / "libtorch.tree",
                max_bytes=max_extract_bytes())
"""

from __future__ import annotations

import os
import posixpath
import re
import shutil
import stat
import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from fdl.errors import ConfigError, FdlError

MAX_EXTRACT_ENV = "FDL_MAX_EXTRACT_BYTES"
DEFAULT_MAX_EXTRACT_BYTES = 32 << 30
_DRIVE = re.compile(r"^[A-Za-z]:")
_SIZE = re.compile(r"(\d+)\s*([KMGT]?)(I?B)?", re.IGNORECASE)
_ROOT = "/extraction-root"  # stands for dest while names are checked, as plain strings
_COPY_BYTES = 1 << 20
_MAX_LINK_BYTES = 4096  # a symlink target is read into memory: keep that small
_KEEP = 0o755  # permission bits kept from the archive: no group/other write, no set-id/sticky


@dataclass(frozen=True)
class _Member:
    info: zipfile.ZipInfo
    relpath: str  # normalised, "/"-separated, inside dest
    mode: int  # permission bits to set: the archive's, made safe (see _KEEP), or a default
    kind: str  # "file", "dir" or "symlink"
    link_target: str = ""


def max_extract_bytes(env: Mapping[str, str] | None = None) -> int:
    """The extraction limit: ``FDL_MAX_EXTRACT_BYTES`` (bytes, or with K/M/G/T: powers of 1024,
    e.g. ``64G``), else 32 GiB. A value that is not a positive size is a ``ConfigError``."""
    value = (os.environ if env is None else env).get(MAX_EXTRACT_ENV, "").strip()
    if not value:
        return DEFAULT_MAX_EXTRACT_BYTES
    match = _SIZE.fullmatch(value)
    size = int(match[1]) << 10 * " KMGT".index(match[2].upper() or " ") if match else 0
    if size <= 0:
        raise ConfigError(f"{MAX_EXTRACT_ENV}={value!r} is not a size; allowed: a whole number "
                          "of bytes above 0, optionally with K, M, G or T (powers of 1024), "
                          "e.g. 64G",
                          hint=f"unset it for the default ({_human(DEFAULT_MAX_EXTRACT_BYTES)})")
    return size


def extract_zip(archive: Path, dest: Path, *,
                max_bytes: int = DEFAULT_MAX_EXTRACT_BYTES) -> Path:
    """Extract ``archive`` into ``dest``, which must not exist yet; returns ``dest``.

    Raises ``FdlError`` for a corrupt archive, an unsafe member, an archive whose members
    exceed ``max_bytes`` in all, or an existing ``dest``.
    """
    if dest.exists() or dest.is_symlink():
        raise FdlError(f"cannot extract into {dest}: it already exists",
                       hint="remove it, or extract into a new directory")
    try:
        with zipfile.ZipFile(archive) as zf:
            members = [_plan_member(zf, info, archive=archive) for info in zf.infolist()]
            _check_layout(members, archive=archive)
            budget = _Budget(archive, limit=max_bytes,
                             declared=sum(m.info.file_size for m in members))
            dest.mkdir(parents=True)
            try:
                _extract_all(zf, members, dest, archive=archive, budget=budget)
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


class _Budget:
    """The bytes an archive may still write: its declared total, checked against the limit up
    front, and each member's declared size, enforced while it is written."""

    def __init__(self, archive: Path, *, limit: int, declared: int):
        if declared > limit:
            raise FdlError(f"archive {archive} would unpack to {_human(declared)} ({declared} "
                           f"bytes), more than the limit of {_human(limit)}; nothing was "
                           "extracted",
                           hint=f"a libtorch unpacks to a few GiB; if this archive is genuine, "
                                f"raise the limit, e.g. {MAX_EXTRACT_ENV}=64G")
        self.archive = archive

    def copy(self, src, out, *, member: _Member) -> None:
        """Copy ``src`` to ``out``, refusing the member once it exceeds its declared size."""
        allowed = member.info.file_size
        while chunk := src.read(min(_COPY_BYTES, allowed + 1)):
            allowed -= len(chunk)
            if allowed < 0:
                raise _unsafe(self.archive, member.info.filename,
                              f"it inflates beyond its declared {member.info.file_size} bytes")
            out.write(chunk)


def _human(size: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            return f"{size / (1 << shift):.1f} {unit}"
    return f"{size} bytes"


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
        return _Member(info, relpath, (mode & _KEEP or 0o755) | stat.S_IRWXU, "dir")
    if not stat.S_ISLNK(mode):
        return _Member(info, relpath, mode & _KEEP or 0o644, "file")
    if info.file_size > _MAX_LINK_BYTES:
        raise _unsafe(archive, name, f"symlink target of {info.file_size} bytes")
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


def _check_layout(members: list[_Member], *, archive: Path) -> None:
    """Refuse a name used twice, and a member below a file or symlink of the archive (it would
    be written through the link, or fail half-way)."""
    seen: dict[str, str] = {}
    for member in members:
        if member.relpath == ".":
            continue
        if seen.get(member.relpath, "dir") != "dir" or (member.relpath in seen
                                                        and member.kind != "dir"):
            raise _unsafe(archive, member.info.filename, "its path appears twice")
        seen[member.relpath] = member.kind
    for member in members:
        parent = posixpath.dirname(member.relpath)
        while parent:
            if seen.get(parent, "dir") != "dir":
                raise _unsafe(archive, member.info.filename,
                              f"it lies below {parent!r}, a {seen[parent]} in the archive")
            parent = posixpath.dirname(parent)


def _extract_all(zf: zipfile.ZipFile, members: list[_Member], dest: Path, *,
                 archive: Path, budget: _Budget) -> None:
    for member in members:
        if member.kind == "dir":
            (dest / member.relpath).mkdir(parents=True, exist_ok=True)
        elif member.kind == "file":
            _write_file(zf, member, dest / member.relpath, budget=budget)
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
    _set_dir_modes(dest, {m.relpath: m.mode for m in members if m.kind == "dir"})


def _set_dir_modes(dest: Path, modes: dict[str, int]) -> None:
    """Every directory gets its (safe) archive mode or 0755, deepest first, after its contents:
    also those made implicitly for a member's parents, whatever the umask made them."""
    for top, dirnames, _ in os.walk(dest, topdown=False):
        for name in dirnames:
            path = os.path.join(top, name)
            if not os.path.islink(path):
                relpath = os.path.relpath(path, dest).replace(os.sep, "/")
                os.chmod(path, modes.get(relpath, 0o755))
    os.chmod(dest, modes.get(".", 0o755))


def _write_file(zf: zipfile.ZipFile, member: _Member, path: Path, *, budget: _Budget) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # "xb": a path through something unexpected fails, never overwrites
    with zf.open(member.info) as src, open(path, "xb") as out:
        budget.copy(src, out, member=member)
    os.chmod(path, member.mode)
