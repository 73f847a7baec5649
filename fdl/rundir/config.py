"""``config.json``: what a run was asked to do. ``fdl run`` writes it before any worker starts
(the fdl version, the launch spec: script, arguments, devices, rendezvous, every setting with its
value and source, the worker environment); the engine's rank 0 adds its ``engine`` section (every
engine setting as resolved in the workers, with its source, and the backend the group agreed on).
``fdl run --resume``, ``fdl report`` and ``fdl compare`` read it back (docs/run.md "Run
directory").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fdl import readback
from fdl.errors import UsageError
from fdl.files import write_json_atomic
from fdl.rundir.fields import is_int, read_json, show

FILE = "config.json"
VERSION_KEY = "fdl_version"  # what marks a directory as holding an fdl run


def write_config(run_dir: Path, spec: dict[str, Any], *, fdl_version: str) -> Path:
    """The launcher's config.json: the launch spec and the fdl version that wrote it."""
    return write_json_atomic(run_dir / FILE, {VERSION_KEY: fdl_version, **spec})


def merge_engine(run_dir: Path, engine: dict[str, Any]) -> None:
    """Add the engine's resolved settings (with sources) to the launcher's config.json; a
    config.json that is absent or unreadable (a script run without fdl run's directory) gets
    the engine's part alone."""
    path = run_dir / FILE
    try:
        document = readback.read_json(path)
    except (OSError, ValueError):
        document = {}
    if not isinstance(document, dict):
        document = {}
    document["engine"] = engine
    write_json_atomic(path, document)


def read_config(run_dir: Path, *, hint: str, missing_ok: bool = True) -> dict[str, Any]:
    """config.json as an object ({} when there is none and ``missing_ok``); a UsageError naming
    the file when it cannot be read or does not hold an object (``hint`` says what the caller
    needs it for)."""
    path = run_dir / FILE
    if missing_ok and not path.exists():
        return {}
    document = read_json(path, hint=hint)
    if not isinstance(document, dict):
        raise UsageError(f"{path} holds {show(document)}, not a JSON object", hint=hint)
    return document


def holds_a_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` has a config.json as fdl run writes it (an object with the version)."""
    try:
        document = readback.read_json(run_dir / FILE)
    except (OSError, ValueError):
        return False
    return isinstance(document, dict) and VERSION_KEY in document


def engine_value(config: dict[str, Any], name: str, *, run_dir: Path, hint: str) -> Any:
    """The value the engine ran ``name`` with (its ``engine`` section), None when absent."""
    engine = config.get("engine", {})
    if not isinstance(engine, dict):
        raise UsageError(f"{run_dir / FILE}: engine is {show(engine)}, expected an object",
                         hint=hint)
    entry = engine.get(name)
    return entry.get("value") if isinstance(entry, dict) else entry


def batch_size(config: dict[str, Any], *, run_dir: Path, hint: str) -> int:
    """The run's batch size from config.json's engine section; 1 when it has none."""
    value = engine_value(config, "batch_size", run_dir=run_dir, hint=hint)
    if value is None:
        return 1
    if not is_int(value) or value < 1:
        raise UsageError(f"{run_dir / FILE}: engine.batch_size is {show(value)}, expected a "
                         "positive integer", hint=hint)
    return value


def launch_settings(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The launcher's ``settings`` section ({name: {"value", "source"}}), entries that are not
    objects left out."""
    settings = config.get("settings", {})
    if not isinstance(settings, dict):
        return {}
    return {name: entry for name, entry in settings.items() if isinstance(entry, dict)}


def unread_engine_settings(config: dict[str, Any]) -> list[tuple[str, str]]:
    """The engine settings the launcher's part of ``config`` says were given (a flag, an
    ``FDL_*`` variable, a config file) when the run has no ``engine`` section, each as
    ``(name, source)`` in the settings' order: the engine adds that section as it starts, so
    without one the script never used fdl's engine and nothing read them (a plain DDP
    script run with ``--policy``). Empty when the engine ran."""
    from fdl.settings import SETTINGS

    if "engine" in config:
        return []
    given = launch_settings(config)
    return [(spec.name, given[spec.name]["source"]) for spec in SETTINGS
            if spec.engine and spec.name in given
            and given[spec.name].get("source") not in (None, "default")]


# What makes a run the run of one launch: the fields of the spec a rerun must find unchanged.
_IDENTITY = ("script", "args", "module", "nproc_per_node")


def launch_identity(spec: dict[str, Any]) -> dict[str, Any]:
    """What config.json must hold for a run to be this launch's (``spec``: a launch spec's
    ``to_dict()``): script, arguments, workers and every setting's value, as read back from
    JSON (tuples become lists)."""
    wanted = {key: spec[key] for key in _IDENTITY}
    wanted["settings"] = {name: entry["value"] for name, entry in spec["settings"].items()}
    return json.loads(json.dumps(wanted))


def matches_launch(config: dict[str, Any], *, identity: dict[str, Any]) -> bool:
    """Whether config.json (``config``) is the run of the launch ``identity`` describes."""
    settings = config.get("settings")
    if not isinstance(settings, dict):
        return False
    found = {key: config.get(key) for key in _IDENTITY}
    found["settings"] = {name: settings[name].get("value") if isinstance(settings.get(name), dict)
                         else None for name in identity["settings"]}
    return found == dict(identity)
