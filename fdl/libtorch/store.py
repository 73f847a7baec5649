"""The on-disk libtorch store: ``$FLODL_HOME/libtorch`` (``fdl.paths.libtorch_root()``).

Layout::

    <root>/precompiled/<version>-<variant>/   an official archive, e.g. 2.13.0-cu130
    <root>/builds/<name>/                     a source build, e.g. sm61-sm120
    <root>/python/<name>/                     symlinks into a torch wheel, e.g. torch-2.13.0+cpu
    <root>/<kind>/<name>/variant.json         version, cuda, archs, source, url, sha256, size,
                                              installed_at (+ whatever the installer adds)
    <root>/.active                            one line: the id ("<kind>/<name>") in use
    <root>/.lock  .staging/  .trash/          lock file, work space beside the variants

Contract: a variant exists when its ``variant.json`` does. ``install`` moves a finished tree into
place and writes the metadata last, so a crash leaves either the old state or an invisible
half-install. Every change (install, activate, remove) runs under ``.lock``; ``.active`` and
``variant.json`` are replaced atomically (temp file + ``os.replace``), so a reader never sees a
torn file. Example::

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
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fdl.errors import FdlError, MissingTorchError, UsageError
from fdl.files import write_atomic

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
        """Every complete variant, ordered by kind (as in KINDS) then name."""
        found = []
        for kind in KINDS:
            folder = self.root / kind
            if not folder.is_dir():
                continue
            for path in sorted(folder.iterdir()):
                meta = _read_meta(path) if not path.name.startswith(".") else None
                if meta is not None:
                    found.append(Variant(kind=kind, name=path.name, path=path, meta=meta))
        return found

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
        installed = ", ".join(v.id for v in variants) or "none"
        raise UsageError(f"no libtorch variant {name!r}; installed: {installed}",
                         hint="`fdl libtorch list` shows what is installed")

    def active(self) -> Variant | None:
        """The variant ``.active`` names; None when there is none or it no longer exists."""
        try:
            active_id = (self.root / ACTIVE_FILE).read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            return None
        return next((v for v in self.variants() if v.id == active_id), None)

    def activate(self, name: str) -> Variant:
        with self.lock():
            variant = self.find(name)
            write_atomic(self.root / ACTIVE_FILE, variant.id + "\n", durable=True)
        return variant

    def remove(self, name: str, *, force: bool = False) -> Variant:
        """Delete a variant. The active one only with ``force``, which also clears ``.active``."""
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

        self.root.mkdir(parents=True, exist_ok=True)
        lock = FileLock(self.root / ".lock")
        try:
            lock.acquire(timeout=self.lock_timeout_s)
        except Timeout as exc:
            raise FdlError(f"the libtorch store {self.root} is locked by another fdl process "
                           f"(waited {self.lock_timeout_s:g} s)",
                           hint="wait for the other install or removal to finish") from exc
        try:
            yield
        finally:
            lock.release()

    def staging(self) -> Path:
        """A work directory on the store's filesystem, so that moving into place is a rename."""
        path = self.root / ".staging"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def install(self, *, kind: str, name: str, tree: Path, meta: dict[str, Any]) -> Variant:
        """Move the libtorch ``tree`` (``lib/`` + ``include/``, or one top folder holding them)
        to ``root/kind/name``, replacing what is there, then write ``variant.json`` last."""
        _check_name(kind=kind, name=name)
        source = _libtorch_tree(Path(tree))
        target = self.root / kind / name
        with self.lock():
            staged = self.staging() / f"{kind}-{name}-{uuid.uuid4().hex[:8]}"
            try:
                shutil.move(str(source), str(staged))  # a rename on the same filesystem
                target.parent.mkdir(parents=True, exist_ok=True)
                if target.exists() or target.is_symlink():
                    self._discard(target)
                os.replace(staged, target)
            finally:
                shutil.rmtree(staged, ignore_errors=True)
            meta = {**meta, "installed_at": datetime.now(timezone.utc).isoformat(
                timespec="seconds")}
            write_atomic(target / META_FILE, json.dumps(meta, indent=2, default=str) + "\n",
                         durable=True)
        if source != Path(tree):
            _remove_if_empty(Path(tree))
        return Variant(kind=kind, name=name, path=target, meta=meta)

    def env(self, variant: Variant, *, shell: str = "bash", platform: str | None = None) -> str:
        """Shell lines that point builds (cmake, cargo's tch/flodl) and the loader at ``variant``."""
        if shell not in SHELLS:
            raise UsageError(f"unknown shell {shell!r}; allowed: {', '.join(SHELLS)}")
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
        trash = self.root / ".trash"
        trash.mkdir(parents=True, exist_ok=True)
        doomed = trash / f"{path.name}-{uuid.uuid4().hex[:8]}"
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def link_python(store: Store, *, python: str | None = None) -> Variant:
    """Register the libtorch inside ``python``'s torch wheel as ``python/torch-<version>``:
    symlinks to the wheel's ``lib``, ``include`` and ``share`` (nothing is downloaded).
    torch is probed in a child interpreter, never imported here."""
    from fdl.system.torchenv import probe_torch

    info = probe_torch(python=python or sys.executable)
    if info.error:
        raise FdlError(f"cannot read the torch of {info.python}: {info.error}",
                       hint="`fdl diagnose` shows the state of the torch install")
    if not info.installed or not info.path:
        raise MissingTorchError("`fdl libtorch link-python`")
    wheel = Path(info.path).resolve()
    missing = [part for part in ("lib", "include", "share/cmake/Torch")
               if not (wheel / part).is_dir()]
    if missing:
        raise FdlError(f"the torch wheel at {wheel} has no {', '.join(missing)}; "
                       "it cannot serve as a libtorch",
                       hint="use `fdl libtorch download` for a standalone libtorch")
    staged = Path(tempfile.mkdtemp(prefix="link-", dir=store.staging()))
    staged.chmod(0o755)
    for part in ("lib", "include", "share"):
        (staged / part).symlink_to(wheel / part, target_is_directory=True)
    meta = {"version": info.version, "cuda": info.cuda_version, "archs": list(info.arch_list),
            "source": "python", "wheel_path": str(wheel), "python": info.python}
    return store.install(kind="python", name=f"torch-{info.version}", tree=staged, meta=meta)


def _read_meta(path: Path) -> dict[str, Any] | None:
    """The variant.json of ``path``; None (not a variant) when absent or unreadable."""
    try:
        meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def _check_name(*, kind: str, name: str) -> None:
    if kind not in KINDS:
        raise UsageError(f"libtorch kind {kind!r} is unknown; allowed: {', '.join(KINDS)}")
    if not name or name.startswith(".") or any(c in name for c in "/\\\0"):
        raise UsageError(f"libtorch variant name {name!r} is not a plain directory name",
                         hint="use letters, digits, '.', '-', '+' and '_', e.g. 2.13.0-cu130")


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
