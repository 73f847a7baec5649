"""Put a rendered project on disk, all or nothing.

Every file is first written into a staging folder beside the target (same filesystem, so the
moves are renames). A new target is the staging folder renamed into place. An existing, empty
or ``--force``d target receives the files one by one; a file it already had is kept aside until
every move has succeeded, so a failure half-way puts the old files back. Either way, on any
error the staging folder and any folder created here are removed and the target is as it was.
With ``force`` only the files of the template are replaced; other files are left alone.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from fdl.errors import FdlError, UsageError


@dataclass(frozen=True)
class WriteResult:
    target: Path
    files: tuple[str, ...]  # relative paths, as given
    replaced: tuple[str, ...]  # files that existed before (``force``)


def check_target(target: Path, *, force: bool) -> None:
    """UsageError unless ``target`` is missing, an empty folder, or a folder and ``force``."""
    check_name_lengths(target)
    for ancestor in [target, *target.parents]:
        if ancestor.exists() and not ancestor.is_dir():
            raise UsageError(f"cannot create the project at {target}: {ancestor} is a file, "
                             "not a folder", hint="pick another path")
        if ancestor.exists():
            break
    if target.is_dir() and any(target.iterdir()) and not force:
        raise UsageError(f"{target} already exists and is not empty",
                         hint="pick another name, or pass --force to overwrite the files that "
                              "fdl init writes (other files are kept)")


# _make_staging's folder is ".<name>.fdl-init-<8 hex digits>": 19 bytes more than the name.
_STAGING_SUFFIX, _STAGING_TOKEN_BYTES = ".fdl-init-", 4
_STAGING_EXTRA = 1 + len(_STAGING_SUFFIX) + 2 * _STAGING_TOKEN_BYTES
_NAME_MAX = 255  # bytes per name on Linux and macOS filesystems, where pathconf cannot say


def check_name_lengths(target: Path) -> None:
    """UsageError when a name in ``target`` is longer than its filesystem allows (the nearest
    existing folder's ``PC_NAME_MAX``; the project's own name less the room its staging folder
    takes), before any path is touched: the OS would answer "File name too long" from deep
    inside."""
    existing = Path(target.anchor)
    for index, part in enumerate(target.parts[1:], start=1):
        limit = _name_max(existing)
        last = index == len(target.parts) - 1
        allowed = limit - _STAGING_EXTRA if last else limit
        size = len(os.fsencode(part))
        if size > allowed:
            what = "the project's name" if last else f"the folder name {part[:24]}..."
            room = f", less {_STAGING_EXTRA} for fdl init's staging folder" if last else ""
            raise UsageError(f"cannot create the project at {target}: {what} is {size} bytes "
                             f"long; at most {allowed} are allowed here ({limit} per name on "
                             f"{existing}'s filesystem{room})", hint="pick a shorter name")
        if (existing / part).is_dir():
            existing = existing / part


def _name_max(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return _NAME_MAX


def write_project(target: Path, files: Mapping[str, str | bytes], *,
                  force: bool) -> WriteResult:
    """Write ``files`` ({relative path: text, or bytes as they are}) under ``target``; FdlError
    (exit 1) on I/O errors."""
    check_target(target, force=force)
    created = _missing_folders(target.parent)
    staging: Path | None = None
    succeeded = False
    try:
        for folder in created:
            folder.mkdir()
        staging = _make_staging(target)
        for relative, content in files.items():
            path = staging / "new" / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                path.write_bytes(content)
            else:
                path.write_text(content, encoding="utf-8", newline="\n")
        if target.exists():
            replaced = _merge(staging, target, list(files))
        else:
            os.rename(staging / "new", target)
            replaced = []
        succeeded = True
    except OSError as exc:
        raise FdlError(f"cannot write the project at {target}: {_describe(exc, staging, target)}",
                       hint="check the path and its permissions; nothing was written") from exc
    finally:  # Ctrl-C too
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if not succeeded:
            for folder in reversed(created):
                _remove_empty(folder)
    return WriteResult(target, tuple(files), tuple(replaced))


def _missing_folders(folder: Path) -> list[Path]:
    """``folder`` and the ancestors of it that do not exist yet, outermost first."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    return missing[::-1]


def _make_staging(target: Path) -> Path:
    # os.mkdir (not tempfile.mkdtemp, whose folders are 0700) so the renamed project gets the
    # user's usual permissions.
    staging = target.with_name(
        f".{target.name}{_STAGING_SUFFIX}{secrets.token_hex(_STAGING_TOKEN_BYTES)}")
    staging.mkdir()
    (staging / "new").mkdir()
    (staging / "old").mkdir()
    return staging


def _merge(staging: Path, target: Path, relatives: list[str]) -> list[str]:
    """Move each staged file into ``target``; undo every move if one fails."""
    moved: list[tuple[str, bool]] = []  # (relative path, whether an old file was kept aside)
    created: list[Path] = []
    try:
        for relative in relatives:
            dest = target / relative
            created += _missing_folders(dest.parent)
            dest.parent.mkdir(parents=True, exist_ok=True)
            if dest.is_dir() and not dest.is_symlink():  # never trade a folder for a file
                raise IsADirectoryError(errno.EISDIR, "a folder is in the way", str(dest))
            existed = dest.exists() or dest.is_symlink()
            if existed:
                aside = staging / "old" / relative
                aside.parent.mkdir(parents=True, exist_ok=True)
                os.rename(dest, aside)
            moved.append((relative, existed))
            os.rename(staging / "new" / relative, dest)
    except OSError:
        _undo(staging, target, moved, created)
        raise
    return [relative for relative, existed in moved if existed]


def _undo(staging: Path, target: Path, moved: list[tuple[str, bool]], created: list[Path]) -> None:
    for relative, existed in reversed(moved):
        dest = target / relative
        if dest.is_file() and not (staging / "new" / relative).exists():
            dest.unlink()
        if existed:
            os.rename(staging / "old" / relative, dest)
    for folder in reversed(created):
        _remove_empty(folder)


def _remove_empty(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not empty (someone else's files): leave it
        folder.rmdir()


def _describe(exc: OSError, staging: Path | None, target: Path) -> str:
    """The OS's reason and file, named where the file was going rather than its staging place."""
    where = "" if exc.filename is None else str(exc.filename)
    if staging is not None:
        where = where.replace(str(staging / "new"), str(target))
    reason = exc.strerror or str(exc)
    return f"{reason} ({where})" if where else reason
