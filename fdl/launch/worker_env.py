"""Everything ``fdl run`` adds to a worker's environment, made in one place.

:func:`build_worker_env` makes, while planning, what every worker of the node gets:
:attr:`fdl.launch.spec.LaunchSpec.env` is the whole of it, so ``fdl run --dry-run`` shows it,
``config.json`` records it, and :mod:`fdl.launch.elastic` sets it in the launcher's environment
for torch's agent to copy into every worker. :func:`build_rank_env` makes the one part that
depends on a worker's global rank, which only the rendezvous assigns: fdl's logs layout
(:func:`fdl.launch.elastic.run_logs_specs`, in place of torch's default one, which sets its own
value) adds it to each worker as an attempt starts. No other module adds a worker variable.

torch's agent gives each worker torchrun's variables (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``ROLE_RANK``,
``ROLE_NAME``, ``ROLE_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_MAX_RESTARTS``, ``TORCHELASTIC_RUN_ID``,
``TORCHELASTIC_USE_AGENT_STORE``). Besides those, every worker gets from fdl:

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
  reads it too: it runs in the launcher, whose environment holds the spec's for the run;
* ``FDL_WORKER_PYTHON`` — JSON ``{local rank: interpreter}`` for the workers that run under
  another interpreter than the launcher's (``--worker-python``, or the device map ``fdl setup``
  writes): each such worker replaces itself with its own at once (fdl.launch.interpreters);
* what this node's network needs (fdl.launch.network decides it, a user's own value winning):
  ``GLOO_SOCKET_IFNAME`` (one node: the loopback interface; several: the interface toward the
  rendezvous), ``NCCL_SOCKET_IFNAME`` and ``FDL_NODE_ADDR`` (several nodes: this node's address).

And each worker, as its attempt starts, from :func:`build_rank_env`:

* ``TORCHELASTIC_ERROR_FILE`` — ``logs/.rank<r>.error.json`` of its global rank, where a
  script decorated with torch's ``@record`` writes the error that ended it (torchrun gives the
  variable too, at a path of its own layout).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from fdl.launch.devices import DevicePlan
from fdl.launch.interpreters import WORKER_PYTHON_ENV
from fdl.launch.live import INTERVAL_S
from fdl.settings import (
    LAUNCHER_PID_ENV,
    PROGRESS_ENV,
    RESUME_ENV,
    RUN_DIR_ENV,
    Setting,
    engine_env,
)

if TYPE_CHECKING:
    from fdl.launch.network import NodeNetwork

OWN_STORE_PER_ATTEMPT_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # read by torch's @record in the worker


def build_worker_env(settings: Mapping[str, Setting], *, devices: DevicePlan, run_dir: Path,
                     parent: Mapping[str, str], resume: bool, live: bool,
                     launcher_pid: int | None, worker_pythons: Mapping[int, str],
                     network: NodeNetwork | None) -> dict[str, str]:
    """What fdl adds to every worker's environment (the module docstring says why each).
    ``settings``: every run setting, decided (the backend included); ``parent``: the launcher's
    environment; ``launcher_pid``: the process that will start the workers (None when nobody
    will: a plan that is only checked); ``worker_pythons``: {local rank: interpreter} of the
    workers not under the launcher's; ``network``: this node's (None: not decided, as for
    ``--dry-run`` with an endpoint that does not resolve here). Pure."""
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
    if worker_pythons:
        env[WORKER_PYTHON_ENV] = json.dumps({str(rank): path
                                             for rank, path in sorted(worker_pythons.items())})
    if network is not None:
        env.update(network.env)
    return env


def build_rank_env(logs_dir: Path, *, rank: int | str) -> dict[str, str]:
    """What fdl adds to the worker of global rank ``rank`` as its attempt starts (the module
    docstring says why). Pure."""
    from fdl.rundir.layout import error_file

    return {ERROR_FILE_ENV: str(error_file(logs_dir, rank))}
