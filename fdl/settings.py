"""The settings contract (work in progress: filled in by the settings change)."""

from __future__ import annotations

# What torch.distributed.elastic gives each worker (besides TORCHELASTIC_*): a process that
# inherits them believes it is a worker of some group.
TORCHRUN_WORKER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                       "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE",
                       "MASTER_ADDR", "MASTER_PORT")
ENV_PREFIXES = ("FDL_", "TORCHELASTIC_")  # fdl's variables and torchelastic's own


def is_launcher_variable(name: str) -> bool:
    """Whether ``name`` is one of fdl's or torchrun's variables (what a test or a benchmark cell
    scrubs so that the caller's environment cannot leak into it)."""
    return name.startswith(ENV_PREFIXES) or name in TORCHRUN_WORKER_ENV
