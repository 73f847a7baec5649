"""The engine's settings, resolved once per worker: ``FDL_*`` (set by ``fdl run`` from its flags,
the user's environment or fdl.toml) > the value the script passed > the default.

Which settings exist, their defaults, parsers and variables: :mod:`fdl.settings` (the contract).
``FDL_SOURCES`` (JSON, written by the launcher) says where each ``FDL_*`` value came from, so
``config.json`` can record ``flag`` / ``env`` / ``file:<path>`` rather than just ``env``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fdl.engine.policies import Policy, policy_named
from fdl.errors import UsageError
from fdl.settings import RUN_DIR_ENV, check_outer, resolve_engine_settings


@dataclass(frozen=True)
class EngineConfig:
    policy: Policy  # looked up once, here, from the setting's name
    backend: str
    epochs: int
    batch_size: int
    seed: int
    simulate_slowdown: tuple[float, ...] | None
    checkpoint_every: str | None  # "N" epochs or "<seconds>s" (settings.parse_checkpoint_every)
    tensorboard: str | None  # "on" or a directory (fdl.engine.tensorboard.log_dir)
    # What an average sends: "fp32", or "bf16", "int8" or "int4" (fdl.engine.averaging and
    # fdl.engine.wire: displacements, error fed back).
    average_dtype: str
    # The outer optimizer on each average's displacement: "none" or "nesterov", with its
    # learning rate and momentum (fdl.engine.outer).
    outer_optimizer: str
    outer_lr: float
    outer_momentum: float
    # Seconds a collective waits for a peer; None: fdl.engine.collectives.group_timeout decides.
    collective_timeout: float | None
    # One choice for every rank, or one per rank; fdl.engine.precision says which rank trains in
    # which and what "auto" becomes on its device.
    precision: tuple[str, ...]
    # None (each rank computes its batch at once), or one choice for every rank or one per
    # rank: a micro-batch size or "auto" (fdl.engine.micro_batches).
    micro_batch_size: tuple[int | str, ...] | None
    # Training budgets: None is no limit (settings.parse_budget); max_time in seconds.
    max_steps: int | None
    max_samples: int | None
    max_time: float | None
    # Relative distance of a replica from the average above which the divergence guard counts
    # a round as diverging (three rounds in a row halve the anchor).
    divergence_threshold: float
    # Wanted sync time / compute time per round: the anchor grows above it, shrinks below half.
    overhead_target: float
    max_grad_norm: float | None
    run_dir: Path | None
    sources: dict[str, str]

    def to_dict(self) -> dict[str, Any]:
        """Every setting with its source, as config.json's ``engine`` section records them."""
        return {key: {"value": plain(getattr(self, key)), "source": source}
                for key, source in self.sources.items()}


def resolve_config(*, script: Mapping[str, Any], env: Mapping[str, str] | None = None,
                   max_grad_norm: float | None = None) -> EngineConfig:
    """``script`` holds the Trainer's arguments (a value equal to the default counts as
    default). Raises UsageError for any value that cannot be used."""
    env = os.environ if env is None else env
    settings = resolve_engine_settings(script=script, env=env)
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise UsageError(f"max_grad_norm must be > 0 or None, got {max_grad_norm!r}")
    run_dir = env.get(RUN_DIR_ENV)
    values = {key: setting.value for key, setting in settings.items()}
    check_outer(values["policy"], values["outer_optimizer"])
    return EngineConfig(
        **{**values, "policy": policy_named(values["policy"])},
        max_grad_norm=max_grad_norm,
        run_dir=Path(run_dir) if run_dir else None,
        sources={key: setting.source for key, setting in settings.items()},
    )


def plain(value: Any) -> Any:
    """A setting's value as JSON holds it (a policy by its name)."""
    return value.name if isinstance(value, Policy) else value
