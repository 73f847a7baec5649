"""``fdl.toml``, or else ``[tool.fdl]`` in ``pyproject.toml``, in the working directory: the file
source of the run settings (:mod:`fdl.settings` owns the keys, their parsers and precedence).

A config file that is there but cannot be used is an error, never skipped: a directory named
``fdl.toml``, TOML that does not parse, a ``tool`` or ``tool.fdl`` that is not a table, an unknown
key or a value of the wrong type (a usage error naming the file and the key).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fdl import readback
from fdl.errors import ConfigError, UsageError
from fdl.settings import BY_NAME, FILE_KEYS, parse_from


def load_config_file(cwd: Path) -> tuple[dict[str, Any], Path | None]:
    """The settings table of ``fdl.toml`` (or ``[tool.fdl]``) in ``cwd``, parsed, and its path."""
    candidate = cwd / "fdl.toml"
    if _present(candidate):
        return _validated(_read_toml(candidate), candidate), candidate
    pyproject = cwd / "pyproject.toml"
    if _present(pyproject):
        table = _tool_fdl(_read_toml(pyproject), pyproject)
        if table is not None:
            return _validated(table, pyproject, prefix="tool.fdl."), pyproject
    return {}, None


def _present(path: Path) -> bool:
    return path.exists() or path.is_symlink()


def _tool_fdl(document: dict[str, Any], path: Path) -> dict[str, Any] | None:
    tool = document.get("tool")
    if tool is not None and not isinstance(tool, dict):
        raise ConfigError(f"{path}: tool must be a table, got {tool!r}",
                          hint="fdl reads its settings from a [tool.fdl] table")
    table = None if tool is None else tool.get("fdl")
    if table is not None and not isinstance(table, dict):
        raise ConfigError(f"{path}: tool.fdl must be a table, got {table!r}",
                          hint='write a [tool.fdl] table with one setting a line, e.g. '
                               'policy = "async"')
    return table


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    if not path.is_file():
        raise ConfigError(f"{path} is not a file",
                          hint=f"fdl run reads its settings from {path.name}; remove or rename it")
    try:
        text = readback.read_text(path, limit=readback.SMALL_BYTES, follow=True)
        return tomllib.loads(text.removeprefix("\ufeff"))  # an editor's UTF-8 byte-order mark
    except RecursionError:  # tomllib recurses once per level of nesting
        raise ConfigError(f"cannot read {path}: nested too deep",
                          hint=f"fix {path.name} (TOML), or remove it") from None
    except (OSError, ValueError) as exc:  # ReadBackError, TOMLDecodeError are ValueErrors
        raise ConfigError(f"cannot read {path}: {exc}",
                          hint=f"fix {path.name} (TOML), or remove it") from None


def _validated(table: dict[str, Any], path: Path, prefix: str = "") -> dict[str, Any]:
    values = {}
    for key, raw in table.items():
        if key not in FILE_KEYS:
            raise ConfigError(f"unknown key {prefix + key!r} in {path}",
                              hint=f"known keys: {', '.join(sorted(FILE_KEYS))}")
        try:
            values[key] = parse_from(BY_NAME[key], raw, origin=f"{path}: {prefix}{key}")
        except UsageError as exc:
            raise ConfigError(exc.message, hint=exc.hint) from exc
    return values
