"""The engine's settings, resolved once per worker: ``FDL_*`` (set by ``fdl run`` from its flags,
the user's environment or fdl.toml) > the value the script passed > the default.

``FDL_SOURCES`` (JSON, written by the launcher) says where each ``FDL_*`` value came from, so
``config.json`` can record ``flag`` / ``env`` / ``file:<path>`` rather than just ``env``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fdl.errors import UsageError
from fdl.launch.settings import ENV_NAMES, PARSERS, SOURCES_ENV, Setting

DEFAULTS: dict[str, Any] = {"policy": "cadence", "backend": "auto", "epochs": 5,
                            "batch_size": 64, "seed": 42, "simulate_slowdown": None,
                            "checkpoint_every": None}
# Relative distance of a replica from the average above which the divergence guard counts a
# round as diverging (three rounds in a row halve the anchor). FDL_DIVERGENCE_THRESHOLD
# overrides it.
DIVERGENCE_THRESHOLD = 0.5
# Wanted sync time / compute time per round: the anchor grows above it, shrinks below half of
# it (FDL_OVERHEAD_TARGET overrides it).
OVERHEAD_TARGET = 0.05


@dataclass(frozen=True)
class EngineConfig:
    policy: str
    backend: str
    epochs: int
    batch_size: int
    seed: int
    simulate_slowdown: tuple[float, ...] | None
    checkpoint_every: str | None  # "N" epochs or "<seconds>s" (settings.parse_checkpoint_every)
    max_grad_norm: float | None
    run_dir: Path | None
    divergence_threshold: float
    overhead_target: float
    sources: dict[str, str]

    def to_dict(self) -> dict[str, Any]:
        return {key: {"value": getattr(self, key), "source": self.sources.get(key, "script")}
                for key in DEFAULTS}


def resolve_config(*, script: Mapping[str, Any], env: Mapping[str, str] | None = None,
                   max_grad_norm: float | None = None) -> EngineConfig:
    """``script`` holds the Trainer's arguments (a value equal to the default counts as
    default). Raises UsageError for any value that cannot be used."""
    env = os.environ if env is None else env
    launcher_sources = _launcher_sources(env)
    settings: dict[str, Setting] = {}
    for key, default in DEFAULTS.items():
        raw_env = env.get(ENV_NAMES[key])
        if raw_env:
            settings[key] = Setting(_parse(key, raw_env, ENV_NAMES[key]),
                                    launcher_sources.get(key, "env"))
        elif script.get(key) is not None and script.get(key) != default:
            settings[key] = Setting(_parse(key, script[key], key), "script")
        else:
            settings[key] = Setting(default if default is None else _parse(key, default, key),
                                    "default")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise UsageError(f"max_grad_norm must be > 0 or None, got {max_grad_norm!r}")
    run_dir = env.get("FDL_RUN_DIR")
    return EngineConfig(
        **{key: setting.value for key, setting in settings.items()},
        max_grad_norm=max_grad_norm,
        run_dir=Path(run_dir) if run_dir else None,
        divergence_threshold=_threshold(env.get("FDL_DIVERGENCE_THRESHOLD"),
                                        "FDL_DIVERGENCE_THRESHOLD", DIVERGENCE_THRESHOLD),
        overhead_target=_threshold(env.get("FDL_OVERHEAD_TARGET"), "FDL_OVERHEAD_TARGET",
                                   OVERHEAD_TARGET, positive=True),
        sources={key: setting.source for key, setting in settings.items()},
    )


def _parse(key: str, value: Any, name: str) -> Any:
    parser: Callable[[Any], Any] = PARSERS[key]
    try:
        return parser(value)
    except UsageError as exc:
        raise UsageError(f"{name}: {exc.message}", hint=exc.hint) from exc


def _threshold(raw: str | None, name: str, default: float, *, positive: bool = False) -> float:
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value > 0 if positive else value >= 0) or value == float("inf"):
        raise UsageError(f"{name} must be a finite number {'>' if positive else '>='} 0, "
                         f"got {raw!r}")
    return value


def _launcher_sources(env: Mapping[str, str]) -> dict[str, str]:
    try:
        sources = json.loads(env.get(SOURCES_ENV, "{}"))
    except json.JSONDecodeError:
        return {}
    return sources if isinstance(sources, dict) else {}
