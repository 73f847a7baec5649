"""What the libtorch store accepts from outside: variant names, ``variant.json``, ``.active``.

Every name is checked here *before* a path is built from it: a name from ``--variant``, from the
last segment of a ``--url`` or from a catalog entry becomes ``<store>/.staging/<name>.zip`` and
``<store>/precompiled/<name>``, so ``../../victim`` must never get that far. The files the store
reads back are checked too, so that one broken entry (an ``.active`` that is not UTF-8, a
``variant.json`` whose ``archs`` is a string) is reported in one line and skipped, instead of
breaking ``fdl libtorch list``, ``env`` or ``fdl diagnose``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from fdl import readback
from fdl.errors import UsageError

NAME_RULE = "letters, digits, '.', '-', '+' and '_', starting with a letter or digit, " \
            "at most 100 characters"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,99}")
_CUDA = re.compile(r"\d+(\.\d+)*")
_ARCH = re.compile(r"[A-Za-z0-9_.+:-]{1,40}")
_TEXT_KEYS = ("version", "cuda", "source", "url", "sha256", "installed_at", "variant",
              "platform", "min_driver")


def is_variant_name(name: str) -> bool:
    """True when ``name`` can be a directory of the store (no separator, no leading dot)."""
    return bool(_NAME.fullmatch(name))


def check_variant_name(name: str, *, what: str = "libtorch variant name") -> str:
    """``name`` itself, or ``UsageError`` (exit 2) naming it and what is allowed."""
    if not is_variant_name(name):
        raise UsageError(f"{what} {name!r} is not a plain directory name; allowed: {NAME_RULE}",
                         hint="e.g. 2.13.0-cu130 or site-build")
    return name


def read_small_text(path: Path) -> str:
    """The UTF-8 text of the regular file ``path`` (at most 1 MiB), read with
    :mod:`fdl.readback` (links to a regular file are followed: the store's own ``.active`` may
    be one in older stores).

    Raises ``FileNotFoundError`` when it does not exist, ``ValueError`` (with the reason as its
    message) when it is not a regular file, too large or not UTF-8, ``OSError`` when it cannot
    be read. A FIFO is never read (it would block)."""
    try:
        return readback.read_text(path, limit=readback.SMALL_BYTES, follow=True)
    except readback.ReadBackError as exc:  # "is a FIFO, ...": the callers say "NAME is ..."
        raise ValueError(exc.problem.removeprefix("is ")) from None


def read_meta(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """``(meta, None)`` for a good ``path/variant.json``; ``(None, why)`` for a broken one;
    ``(None, None)`` when there is none (a half-install: not a variant, nothing to report)."""
    try:
        meta = readback.parse_json(read_small_text(path / "variant.json"))
    except (FileNotFoundError, NotADirectoryError):  # nothing there, or a stray file
        return None, None
    except json.JSONDecodeError as exc:
        return None, f"variant.json is not valid JSON ({exc.msg}, line {exc.lineno})"
    except ValueError as exc:
        return None, f"variant.json is {exc}"
    except OSError as exc:
        return None, f"variant.json cannot be read ({exc.strerror or exc})"
    why = meta_problem(meta)
    return (None, why) if why else (meta, None)


def meta_problem(meta: Any) -> str | None:
    """Why ``meta`` cannot be a variant's metadata, or None when it can."""
    if not isinstance(meta, dict):
        return f"variant.json holds {type(meta).__name__}, not an object"
    for key in _TEXT_KEYS:
        if meta.get(key) is not None and not isinstance(meta[key], str):
            return f"variant.json: {key!r} must be a string, got {_short(meta[key])}"
    size = meta.get("size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
        return f"variant.json: 'size' must be a whole number of bytes, got {_short(size)}"
    if meta.get("cuda") is not None and not _CUDA.fullmatch(meta["cuda"]):
        return f"variant.json: 'cuda' must be a version like 12.6, got {_short(meta['cuda'])}"
    return _archs_problem(meta.get("archs"))


def _archs_problem(archs: Any) -> str | None:
    # A list of arch names; CUDA ones (sm_86, compute_120) or others (a ROCm wheel's gfx90a):
    # what reads them for CUDA coverage takes the CUDA ones.
    if archs is None:
        return None
    if not isinstance(archs, list) or not all(isinstance(a, str) and _ARCH.fullmatch(a)
                                              for a in archs):
        return f"variant.json: 'archs' must be a list like [\"sm_86\"], got {_short(archs)}"
    return None


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def scan_kinds(root: Path, kinds: tuple[str, ...]
               ) -> tuple[list[tuple[str, Path, dict[str, Any]]], list[str]]:
    """``([(kind, path, meta), ...], problems)`` for ``root/<kind>/<name>/variant.json``,
    ordered by kind then name; a broken entry is one line in ``problems`` and is left out."""
    found, problems = [], []
    for kind in kinds:
        folder = root / kind
        try:
            entries = sorted(folder.iterdir()) if folder.is_dir() else []
        except OSError as exc:
            problems.append(f"{kind}/ cannot be listed ({exc.strerror or exc}): skipped")
            continue
        for path in entries:
            if path.name.startswith("."):
                continue
            meta, why = read_meta(path)
            if meta is not None:
                found.append((kind, path, meta))
            elif why:
                problems.append(f"{kind}/{path.name}: {why}: skipped")
    return found, problems


def read_active_id(path: Path) -> tuple[str | None, str | None]:
    """``(the id in the .active file at path or None, why it cannot be read or None)``."""
    try:
        return read_small_text(path).strip() or None, None
    except FileNotFoundError:
        return None, None
    except ValueError as exc:
        why = str(exc)
    except OSError as exc:
        why = f"unreadable ({exc.strerror or exc})"
    return None, (f"{path.name} is {why}: ignored, no libtorch is active "
                  "(`fdl libtorch activate NAME` replaces it)")
