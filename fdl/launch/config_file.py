"""Run settings with provenance: ``fdl run`` flag > ``FDL_*`` env > fdl.toml > script > default.

Every setting a run uses is resolved here, once, into a :class:`Setting` that remembers where
its value came from; the run directory's ``config.json`` records both. Config files:

* ``fdl.toml`` in the working directory (top-level keys), or else
* ``[tool.fdl]`` in ``pyproject.toml``.

Keys (and their ``FDL_*`` variables): ``policy`` (``FDL_POLICY``), ``backend``
(``FDL_BACKEND``), ``epochs`` (``FDL_EPOCHS``), ``batch_size`` (``FDL_BATCH_SIZE``), ``seed``
(``FDL_SEED``), ``simulate_slowdown`` (``FDL_SLOWDOWN``, e.g. ``1,2.5``), ``run_dir``
(``FDL_RUN_DIR``), ``nproc_per_node`` (``FDL_NPROC_PER_NODE``), ``max_restarts``
(``FDL_MAX_RESTARTS``), ``checkpoint_every`` (``FDL_CHECKPOINT_EVERY``: ``N`` epochs, or a time
such as ``10m``, ``90s``, ``2h``). An unknown key or a value of the wrong type is a usage error naming the
file and the key.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fdl.errors import ConfigError, UsageError

POLICIES = ("sync", "cadence", "async")
BACKENDS = ("auto", "nccl", "cpu")

# The settings the engine reads in every worker; fdl run passes them as FDL_* variables.
ENGINE_KEYS = ("policy", "backend", "epochs", "batch_size", "seed", "simulate_slowdown",
               "checkpoint_every")
SOURCES_ENV = "FDL_SOURCES"  # JSON {key: source} so workers can record provenance


@dataclass(frozen=True)
class Setting:
    value: Any
    source: str  # "flag" | "env" | "file:<path>" | "script" | "default"


def parse_policy(text: str) -> str:
    value = str(text).strip().lower()
    if value not in POLICIES:
        raise UsageError(f"unknown policy {text!r}", hint=f"use one of: {', '.join(POLICIES)}")
    return value


def parse_backend(text: str) -> str:
    value = str(text).strip().lower()
    if value not in BACKENDS:
        raise UsageError(f"unknown backend {text!r}", hint=f"use one of: {', '.join(BACKENDS)}")
    return value


def parse_positive_int(name: str) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        try:
            number = int(str(value).strip()) if not isinstance(value, bool) else None
        except ValueError:
            number = None
        if number is None or number <= 0:
            raise UsageError(f"{name} must be a positive integer, got {value!r}",
                             hint=f"give {name} a whole number >= 1")
        return number

    return parse


def parse_non_negative_int(name: str) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        try:
            number = int(str(value).strip()) if not isinstance(value, bool) else -1
        except ValueError:
            number = -1
        if number < 0:
            raise UsageError(f"{name} must be an integer >= 0, got {value!r}",
                             hint=f"give {name} a whole number >= 0")
        return number

    return parse


def parse_slowdown(value: Any) -> tuple[float, ...]:
    """``"1,2.5"`` or ``[1, 2.5]`` -> ``(1.0, 2.5)``; every factor a number > 0."""
    items = value.split(",") if isinstance(value, str) else value
    try:
        factors = tuple(float(item) for item in items)
    except (TypeError, ValueError):
        factors = ()
    if not factors or any(not 0 < f < math.inf for f in factors):  # rejects nan and inf too
        raise UsageError(
            f"malformed simulate_slowdown {value!r}",
            hint="give one factor > 0 per worker, comma-separated, e.g. --simulate-slowdown 1,2.5",
        )
    return factors


TIME_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_checkpoint_every(value: Any) -> str:
    """``3`` (every 3 epochs) or a time ``10m`` / ``90s`` / ``1.5h``, in canonical text: ``"3"``
    or ``"600s"`` (what workers receive in ``FDL_CHECKPOINT_EVERY``)."""
    text = str(value).strip().lower() if not isinstance(value, bool) else ""
    number, unit = (text[:-1], text[-1]) if text[-1:] in TIME_UNITS else (text, "")
    try:
        amount = float(number) if unit else int(number)
    except ValueError:
        amount = 0
    if not 0 < amount < math.inf:
        raise UsageError(f"checkpoint_every must be a number of epochs or a time, got {value!r}",
                         hint="e.g. --checkpoint-every 2 (epochs) or --checkpoint-every 10m "
                              "(units s, m, h)")
    return f"{amount * TIME_UNITS[unit]:g}s" if unit else str(amount)


def parse_nproc(value: Any) -> int | str:
    text = str(value).strip().lower()
    if text in ("auto", "gpu", "cpu"):
        return text
    return parse_positive_int("--nproc-per-node")(value) if text.lstrip("-").isdigit() else _bad_nproc(value)


def _bad_nproc(value: Any) -> int:
    raise UsageError(f"--nproc-per-node must be a positive integer, 'auto', 'gpu' or 'cpu', "
                     f"got {value!r}", hint="e.g. --nproc-per-node 2, or auto for one worker "
                                            "per GPU")


def parse_run_dir(value: Any) -> str:
    if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
        raise UsageError(f"run_dir must be a non-empty path, got {value!r}",
                         hint="e.g. --run-dir runs/first")
    return str(value)


PARSERS: dict[str, Callable[[Any], Any]] = {
    "policy": parse_policy,
    "backend": parse_backend,
    "epochs": parse_positive_int("epochs"),
    "batch_size": parse_positive_int("batch_size"),
    "seed": parse_non_negative_int("seed"),
    "simulate_slowdown": parse_slowdown,
    "run_dir": parse_run_dir,
    "nproc_per_node": parse_nproc,
    "max_restarts": parse_non_negative_int("max_restarts"),
    "checkpoint_every": parse_checkpoint_every,
}
ENV_NAMES = {key: f"FDL_{key.upper()}" for key in PARSERS}
ENV_NAMES["simulate_slowdown"] = "FDL_SLOWDOWN"


def load_config_file(cwd: Path) -> tuple[dict[str, Any], Path | None]:
    """The raw settings table of ``fdl.toml`` (or ``[tool.fdl]``) in ``cwd``, validated.

    A config file that is there but cannot be used is an error, never skipped: a directory
    named ``fdl.toml``, TOML that does not parse, a ``tool`` or ``tool.fdl`` that is not a
    table."""
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
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}",
                          hint=f"fix {path.name} (TOML), or remove it") from exc


def _validated(table: dict[str, Any], path: Path, prefix: str = "") -> dict[str, Any]:
    values = {}
    for key, raw in table.items():
        if key not in PARSERS:
            raise ConfigError(f"unknown key {prefix + key!r} in {path}",
                              hint=f"known keys: {', '.join(sorted(PARSERS))}")
        try:
            values[key] = PARSERS[key](raw)
        except UsageError as exc:
            raise ConfigError(f"{path}: {prefix}{key}: {exc.message}", hint=exc.hint) from exc
    return values


def resolve(*, flags: Mapping[str, Any], env: Mapping[str, str], file_values: Mapping[str, Any],
            file_path: Path | None, defaults: Mapping[str, Any]) -> dict[str, Setting]:
    """Each key of ``defaults`` resolved: flag > env > file > default. Flags of None are unset."""
    resolved = {}
    for key, default in defaults.items():
        if flags.get(key) is not None:
            resolved[key] = Setting(PARSERS[key](flags[key]), "flag")
        elif env.get(ENV_NAMES[key]):
            resolved[key] = Setting(_from_env(key, env[ENV_NAMES[key]]), "env")
        elif key in file_values:
            resolved[key] = Setting(file_values[key], f"file:{file_path}")
        else:
            resolved[key] = Setting(default, "default")
    return resolved


def _from_env(key: str, raw: str) -> Any:
    try:
        return PARSERS[key](raw)
    except UsageError as exc:
        raise ConfigError(f"{ENV_NAMES[key]}: {exc.message}", hint=exc.hint) from exc


def worker_env(settings: Mapping[str, Setting]) -> dict[str, str]:
    """FDL_* variables for the workers: every engine setting not left at its default."""
    env = {}
    for key in ENGINE_KEYS:
        setting = settings.get(key)
        if setting is None or setting.source == "default":
            continue
        value = setting.value
        env[ENV_NAMES[key]] = ",".join(f"{v:g}" for v in value) if key == "simulate_slowdown" \
            else str(value)
    env[SOURCES_ENV] = json.dumps({k: s.source for k, s in settings.items() if k in ENGINE_KEYS})
    return env
