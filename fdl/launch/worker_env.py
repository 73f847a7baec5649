"""Everything ``fdl run`` adds to a worker's environment, made in one place while planning
(:func:`build_worker_env`), so that :attr:`fdl.launch.spec.LaunchSpec.env` is the whole of it:
``fdl run --dry-run`` shows it, ``config.json`` records it, and :mod:`fdl.launch.elastic`
starts the workers with it and adds nothing of its own.

torch's agent gives each worker torchrun's variables (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``ROLE_RANK``,
``ROLE_NAME``, ``ROLE_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_*``).
Besides those, a worker gets from fdl:

* ``FDL_POLICY``, ``FDL_SLOWDOWN`` ... — each engine setting not left at its default, as its
  ``FDL_*`` variable, and ``FDL_SOURCES``, JSON ``{setting: source}`` for every engine setting:
  the engine resolves its settings from them and records where each came from
  (:func:`fdl.settings.engine_env` writes both, :func:`fdl.settings.resolve_engine_settings`
  reads them back);
* ``FDL_RUN_DIR`` — where the workers write;
* ``FDL_RESUME=1`` with ``--resume`` — load the newest valid checkpoint;
* ``FDL_PROGRESS`` — seconds between rank 0's progress snapshots, when the launcher shows live
  progress (a terminal, no ``--quiet``); without it rank 0 writes none (fdl.rundir.progress);
* ``FDL_LAUNCHER_PID`` — the ``fdl run`` process: each worker dies with it, so a launcher
  killed outright leaves no worker training on (fdl.launch.worker);
* ``OMP_NUM_THREADS`` — the worker's share of the cores, not torchrun's 1; a user's own value
  wins, as with torchrun;
* on GPU hosts, ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and ``CUDA_VISIBLE_DEVICES`` listing the
  chosen GPUs in local-rank order, so local rank r trains on ``cuda:r`` even when they differ;
* with CPU workers (``--nproc-per-node cpu``, or no GPU found), ``CUDA_VISIBLE_DEVICES=`` (empty):
  the plan says CPU, and a worker that could still see a GPU would train there (every worker on
  the one GPU of a 32-thread box) while ``--dry-run`` and ``config.json`` say ``cpu``;
* with ``--max-restarts`` above 0, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` unless the user set
  it: each attempt's workers get a store of their own. torch's c10d rendezvous otherwise hands
  every attempt the agent's one shared store without a per-attempt prefix, and a restarted
  worker can read the previous attempt's addresses and fail to connect
  (pytorch/pytorch#135712, #167288: "Connection refused" in gloo or NCCL init). torch's agent
  reads it too: it runs in the launcher, whose environment holds the spec's for the run.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from fdl.launch.devices import DevicePlan
from fdl.launch.live import INTERVAL_S
from fdl.settings import (
    LAUNCHER_PID_ENV,
    PROGRESS_ENV,
    RESUME_ENV,
    RUN_DIR_ENV,
    Setting,
    engine_env,
)

OWN_STORE_PER_ATTEMPT_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def build_worker_env(settings: Mapping[str, Setting], *, devices: DevicePlan, run_dir: Path,
                     parent: Mapping[str, str], resume: bool, live: bool,
                     launcher_pid: int | None) -> dict[str, str]:
    """What fdl adds to every worker's environment (the module docstring says why each).
    ``settings``: every run setting, resolved; ``parent``: the launcher's environment;
    ``launcher_pid``: the process that will start the workers (None when nobody will: a plan
    that is only checked). Pure."""
    env = {**engine_env(settings), RUN_DIR_ENV: str(run_dir),
           "OMP_NUM_THREADS": parent.get("OMP_NUM_THREADS") or str(devices.threads_per_worker)}
    if resume:
        env[RESUME_ENV] = "1"
    if live:
        env[PROGRESS_ENV] = f"{INTERVAL_S:g}"
    if launcher_pid is not None:
        env[LAUNCHER_PID_ENV] = str(launcher_pid)
    if devices.kind == "cuda":
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = devices.cuda_visible_devices or ""
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
    if settings["max_restarts"].value > 0 and OWN_STORE_PER_ATTEMPT_ENV not in parent:
        env[OWN_STORE_PER_ATTEMPT_ENV] = "1"
    return env
