"""Slurm allocations: nodes, this node's rank and the rendezvous host, read from SLURM_* env.

Inside ``srun``/``sbatch`` a user runs the same ``fdl run train.py`` on every node; fdl derives
what torchrun would need flags for:

* nodes      <- ``SLURM_JOB_NUM_NODES`` (or ``SLURM_NNODES``)
* node rank  <- ``SLURM_NODEID``
* endpoint   <- the first host of ``SLURM_JOB_NODELIST`` (or ``SLURM_NODELIST``), port 29400
* run id     <- ``SLURM_JOB_ID``

GPUs are the survey's: Slurm exports ``CUDA_VISIBLE_DEVICES`` for the allocation, which the
survey honours. ``SLURM_GPUS_ON_NODE`` is recorded (``gpus_on_node``) but not used to choose.

Explicit flags still win (``--nnodes``, ``--node-rank``, ``--rdzv-endpoint``, ``--rdzv-id``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from fdl.errors import UsageError

RDZV_PORT = 29400
_ITEM = r"([^,\[\]]+)(?:\[([^\[\]]+)\])?"  # "gpu" or "gpu[01-03,07]"


@dataclass(frozen=True)
class SlurmJob:
    job_id: str
    nnodes: int
    node_rank: int
    master_host: str
    gpus_on_node: int | None

    @property
    def endpoint(self) -> str:
        return f"{self.master_host}:{RDZV_PORT}"


def slurm_job(env: Mapping[str, str]) -> SlurmJob | None:
    """The allocation this process runs in, or None outside Slurm (or in a one-task shell)."""
    job_id = env.get("SLURM_JOB_ID")
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    nnodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    if not (job_id and nodelist and nnodes):
        return None
    try:
        hosts = expand_nodelist(nodelist)
        gpus = env.get("SLURM_GPUS_ON_NODE")
        return SlurmJob(job_id, int(nnodes), int(env.get("SLURM_NODEID", "0")), hosts[0],
                        int(gpus) if gpus else None)
    except (ValueError, IndexError) as exc:
        raise UsageError(f"cannot read the Slurm allocation ({exc})",
                         hint="pass --nnodes, --node-rank and --rdzv-endpoint explicitly") from exc


def expand_nodelist(text: str) -> list[str]:
    """``"gpu[01-03,07],login1"`` -> ``["gpu01", "gpu02", "gpu03", "gpu07", "login1"]``."""
    # Only "prefix" and "prefix[ranges]" items are understood; anything else (an unclosed
    # bracket, text after a bracket) is refused rather than read as the wrong host.
    if not re.fullmatch(rf"{_ITEM}(?:,{_ITEM})*", text):
        raise ValueError(f"malformed node list {text!r}")
    hosts: list[str] = []
    for match in re.finditer(_ITEM, text):
        prefix, ranges = match.group(1), match.group(2)
        if ranges is None:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            if not high:
                hosts.append(prefix + low)
                continue
            width = len(low)
            hosts.extend(f"{prefix}{n:0{width}d}" for n in range(int(low), int(high) + 1))
    if not hosts:
        raise ValueError(f"empty node list {text!r}")
    return hosts
