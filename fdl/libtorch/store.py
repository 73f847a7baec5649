"""The on-disk libtorch store: ``$FLODL_HOME/libtorch`` (``fdl.paths.libtorch_root()``).

Layout::

    <root>/precompiled/<version>-<variant>/   an official archive, e.g. 2.13.0-cu130
    <root>/builds/<name>/                     a source build, e.g. sm61-sm120
    <root>/python/<name>/                     symlinks into a torch wheel, e.g. torch-2.13.0+cpu
    <root>/<kind>/<name>/variant.json         version, cuda, archs, source, url, sha256, size,
                                              installed_at (+ whatever the installer adds)
    <root>/.active                            one line: the id ("<kind>/<name>") in use
    <root>/.lock  .staging/  .trash/          lock file, work space beside the variants
    <root>/.staging/<name>.lock               held while <name> downloads (download_lock);
                                              deleted when the download ends

Contract: a variant exists when its ``variant.json`` does. ``install`` moves a finished tree into
place and writes the metadata last, so a crash leaves either the old state or an invisible
half-install. Every change (install, activate, remove) runs under ``.lock``; ``.active`` and
``variant.json`` are replaced atomically (temp file + ``os.replace``), so a reader never sees a
torn file; a write that fails (disk full) raises ``FdlError`` and leaves the old file. Names are
checked (``fdl.libtorch.validate``) before any path is built from them. A broken entry (an
``.active`` or ``variant.json`` that cannot be read or is not what fdl writes) is skipped by
``variants``/``active``/``find`` and named, one line each, by ``problems``. Example::

    >>> store = Store(libtorch_root())
    >>> store.activate("2.13.0-cu130").id
    'precompiled/2.13.0-cu130'
    >>> print(store.env(store.active(), shell="bash"))
    export LIBTORCH=/home/me/.flodl/libtorch/precompiled/2.13.0-cu130
    ...
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fdl.errors import FdlError, UsageError, os_failure
from fdl.files import write_atomic
from fdl.libtorch.validate import (
    NAME_RULE,
    check_variant_name,
    is_variant_name,
    read_active_id,
    scan_kinds,
)

KINDS = ("precompiled", "builds", "python")
SHELLS = ("bash", "zsh", "fish", "powershell")
META_FILE = "variant.json"
ACTIVE_FILE = ".active"


@dataclass(frozen=True)
class Variant:
    """One installed libtorch: ``path`` holds its ``lib/``, ``include/`` and ``share/``."""

    kind: str
    name: str
    path: Path
    meta: dict[str, Any]

    @property
    def id(self) -> str:
        return f"{self.kind}/{self.name}"


@dataclass(frozen=True)
class Store:
    """The store under ``root``; nothing is read or created until a method needs it."""

    root: Path
    lock_timeout_s: float = 60.0

    def variants(self) -> list[Variant]:
        """Every complete variant, ordered by kind (as in KINDS) then name; broken entries are
        skipped (``problems`` names them)."""
        return self._scan()[0]

    def _scan(self) -> tuple[list[Variant], list[str]]:
        found, problems = scan_kinds(self.root, KINDS)
        return [Variant(kind=k, name=p.name, path=p, meta=m) for k, p, m in found], problems

    def problems(self) -> list[str]:
        """One line per entry the other methods skip: a ``variant.json`` that cannot be read or
        is not what fdl writes, an unreadable ``.active``, an ``.active`` naming no variant."""
        variants, problems = self._scan()
        active_id, why = read_active_id(self.root / ACTIVE_FILE)
        if why:
            problems.append(why)
        elif active_id is not None and active_id not in {v.id for v in variants} and not any(
                problem.startswith(f"{active_id}:") for problem in problems):  # said already
            problems.append(f"{ACTIVE_FILE} names {active_id!r}, which is not installed: "
                            "no libtorch is active")
        return problems

    def find(self, name: str) -> Variant:
        """The variant named ``kind/name``, or ``name`` alone when only one kind has it."""
        variants = self.variants()
        matches = [v for v in variants if name in (v.id, v.name)]
        if len(matches) == 1:
            return matches[0]
        if matches:
            ids = ", ".join(v.id for v in matches)
            raise UsageError(f"libtorch name {name!r} is ambiguous: {ids}",
                             hint=f"name it with its kind, e.g. `{matches[0].id}`")
        kind, slash, plain = name.partition("/")
        if not (is_variant_name(name) or (slash and kind in KINDS and is_variant_name(plain))):
            raise UsageError(f"{name!r} is not a libtorch variant name; allowed: NAME or "
                             f"KIND/NAME with KIND one of {', '.join(KINDS)} and NAME of "
                             f"{NAME_RULE}",
                             hint="`fdl libtorch list` shows what is installed")
        installed = ", ".join(v.id for v in variants) or "none"
        raise UsageError(f"no libtorch variant {name!r}; installed: {installed}",
                         hint="`fdl libtorch list` shows what is installed")

    def active(self) -> Variant | None:
        """The variant ``.active`` names; None when there is none, it no longer exists or
        ``.active`` cannot be read (``problems`` says why)."""
        active_id, _ = read_active_id(self.root / ACTIVE_FILE)
        if active_id is None:
            return None
        return next((v for v in self.variants() if v.id == active_id), None)

    def activate(self, name: str) -> Variant:
        """Make ``name`` the active variant. ``.active`` is replaced atomically: when it cannot
        be written (disk full), ``FdlError`` is raised and the previous one stays."""
        self.find(name)  # an unknown name fails here, before the lock creates anything
        with self.lock():
            variant = self.find(name)
            self._write(self.root / ACTIVE_FILE, variant.id + "\n",
                        unchanged="the active libtorch is unchanged")
        return variant

    def remove(self, name: str, *, force: bool = False) -> Variant:
        """Delete a variant. The active one only with ``force``, which also clears ``.active``."""
        self.find(name)  # an unknown name fails here, before the lock creates anything
        with self.lock():
            variant = self.find(name)
            active = self.active()
            is_active = active is not None and active.id == variant.id
            if is_active and not force:
                raise UsageError(f"{variant.id} is the active libtorch; not removing it",
                                 hint=f"activate another one first, or pass --force: "
                                      f"`fdl libtorch remove {variant.id} --force`")
            self._discard(variant.path)
            if is_active:
                (self.root / ACTIVE_FILE).unlink(missing_ok=True)
        return variant

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Hold ``root/.lock`` (not re-entrant: never nest two ``lock()`` blocks)."""
        from filelock import FileLock, Timeout

        self._mkdir(self.root)
        lock = FileLock(self.root / ".lock")
        try:
            lock.acquire(timeout=self.lock_timeout_s)
        except Timeout as exc:
            raise FdlError(f"the libtorch store {self.root} is locked by another fdl process "
                           f"(waited {self.lock_timeout_s:g} s)",
                           hint="wait for the other install or removal to finish") from exc
        except OSError as exc:  # a read-only store, a lock file fdl may not open
            raise os_failure(exc, doing="cannot lock the libtorch store to change it") from exc
        try:
            yield
        finally:
            lock.release()

    @contextmanager
    def download_lock(self, name: str, *,
                      on_wait: Callable[[], None] | None = None) -> Iterator[None]:
        """Hold ``.staging/<name>.lock`` while ``name`` is downloaded and installed.

        A second download of the same variant waits here for as long as the first runs (Ctrl-C
        ends the wait), calling ``on_wait`` once first, instead of writing into the same staging
        file; it then finds the first one's install. The store lock is not held meanwhile, so
        other commands are not blocked by a long download.

        The lock file is deleted when the block ends, however it ends (installed, failed,
        Ctrl-C), while it is still held: a waiter that then locks the deleted file sees it
        unlinked and starts over on a new one (filelock >= 3.20.4 checks), so nothing is left
        in ``.staging`` and no two holders ever meet."""
        from filelock import FileLock, Timeout

        name = check_variant_name(name)  # before the name becomes a path
        path = self.staging() / f"{name}.lock"
        lock = FileLock(path)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            if on_wait is not None:
                on_wait()
            lock.acquire()
        except OSError as exc:
            raise os_failure(exc, doing=f"cannot lock the download of {name}") from exc
        try:
            yield
        finally:
            with suppress(OSError):
                path.unlink()
            lock.release()

    def partial_downloads(self) -> list[tuple[Path, int]]:
        """``(path, bytes)`` of each interrupted download kept in ``.staging`` to be resumed."""
        found = []
        with suppress(OSError):
            for path in sorted((self.root / ".staging").glob("*.zip.part")):
                with suppress(OSError):
                    found.append((path, path.stat().st_size))
        return found

    def staging(self) -> Path:
        """A work directory on the store's filesystem, so that moving into place is a rename."""
        return self._mkdir(self.root / ".staging")

    def install(self, *, kind: str, name: str, tree: Path, meta: dict[str, Any]) -> Variant:
        """Move the libtorch ``tree`` (``lib/`` + ``include/``, or one top folder holding them)
        to ``root/kind/name``, replacing what is there, then write ``variant.json`` last."""
        _check_kind(kind)
        check_variant_name(name)
        source = _libtorch_tree(Path(tree))
        target = self.root / kind / name
        meta = {**meta, "installed_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        with self.lock():
            staged = self.staging() / f"{kind}-{name}-{uuid.uuid4().hex[:8]}"
            try:
                shutil.move(str(source), str(staged))  # a rename on the same filesystem
                target.parent.mkdir(parents=True, exist_ok=True)
                if target.exists() or target.is_symlink():
                    self._discard(target)
                os.replace(staged, target)
            except OSError as exc:
                raise FdlError(f"cannot install {kind}/{name} into {self.root}: "
                               f"{exc.strerror or exc}",
                               hint="check free space and permissions there") from exc
            finally:
                shutil.rmtree(staged, ignore_errors=True)
            try:
                self._write(target / META_FILE, json.dumps(meta, indent=2, default=str) + "\n",
                            unchanged="nothing was installed")
            except FdlError:
                self._discard(target)  # no variant.json: invisible, but gigabytes
                raise
        if source != Path(tree):
            _remove_if_empty(Path(tree))
        return Variant(kind=kind, name=name, path=target, meta=meta)

    def env(self, variant: Variant, *, shell: str = "bash", platform: str | None = None) -> str:
        """Shell lines that point builds (cmake, cargo's tch/flodl) and the loader at
        ``variant``."""
        if shell not in SHELLS:
            raise UsageError(f"unknown shell {shell!r}; allowed: {', '.join(SHELLS)}",
                             hint="e.g. fdl libtorch env --shell fish")
        platform = platform or sys.platform
        path, lib = str(variant.path), str(variant.path / "lib")
        loader = ("DYLD_LIBRARY_PATH" if platform == "darwin"
                  else "PATH" if platform in ("win32", "cygwin") else "LD_LIBRARY_PATH")
        sep = ";" if platform in ("win32", "cygwin") else ":"
        settings = [("LIBTORCH", path, False), ("LIBTORCH_PATH", path, False),
                    (loader, lib, True), ("CMAKE_PREFIX_PATH", path, True)]
        return "".join(_render(shell, name=n, value=v, prepend=p, sep=sep) + "\n"
                       for n, v, p in settings)

    def _discard(self, path: Path) -> None:
        """Rename ``path`` into ``.trash`` (one atomic step out of sight), then delete it.
        Symlinks are removed, never followed: a python variant's wheel stays untouched."""
        trash = self._mkdir(self.root / ".trash")
        doomed = trash / f"{path.name}-{uuid.uuid4().hex[:8]}"
        try:
            os.replace(path, doomed)
        except OSError as exc:
            raise FdlError(f"cannot remove {path}: {exc.strerror or exc}",
                           hint="check the permissions there") from exc
        shutil.rmtree(doomed, ignore_errors=True)

    def _write(self, path: Path, text: str, *, unchanged: str) -> None:
        try:
            write_atomic(path, text, durable=True)
        except OSError as exc:
            raise FdlError(f"cannot write {path}: {exc.strerror or exc}",
                           hint=f"free some space or fix the permissions there; {unchanged}"
                           ) from exc

    def _mkdir(self, path: Path) -> Path:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise FdlError(f"cannot create {path}: {exc.strerror or exc}",
                           hint="check FLODL_HOME and the permissions there") from exc
        return path


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise UsageError(f"libtorch kind {kind!r} is unknown; allowed: {', '.join(KINDS)}")


def _libtorch_tree(tree: Path) -> Path:
    """``tree`` itself when it holds ``lib/`` and ``include/``, else its single top folder."""
    def is_libtorch(path: Path) -> bool:
        return (path / "lib").is_dir() and (path / "include").is_dir()

    if is_libtorch(tree):
        return tree
    entries = list(tree.iterdir()) if tree.is_dir() else []
    if len(entries) == 1 and entries[0].is_dir() and is_libtorch(entries[0]):
        return entries[0]
    raise FdlError(f"{tree} is not a libtorch tree: expected lib/ and include/ in it or in "
                   "its single top folder (libtorch/)")


def _remove_if_empty(path: Path) -> None:
    with suppress(OSError):
        path.rmdir()


def _render(shell: str, *, name: str, value: str, prepend: bool, sep: str) -> str:
    """One ``name=value`` line for ``shell``; ``prepend`` keeps the current value after it."""
    if shell == "fish":
        # fish splits variables named *PATH on ':' itself; a list element per directory.
        quoted = "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
        return f"set -gx {name} {quoted}" + (f" ${name}" if prepend else "")
    if shell == "powershell":
        quoted = "'" + value.replace("'", "''") + "'"
        tail = f" + $(if ($env:{name}) {{ '{sep}' + $env:{name} }} else {{ '' }})"
        return f"$env:{name} = {quoted}" + (tail if prepend else "")
    tail = f'"${{{name}:+{sep}${name}}}"'  # bash and zsh: no stray separator when unset
    return f"export {name}={shlex.quote(value)}" + (tail if prepend else "")
