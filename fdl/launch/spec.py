"""``fdl run`` as data: a :class:`~fdl.launch.request.RunRequest` (the flags) and its resolved
settings become a :class:`LaunchSpec` (what will run: devices, rendezvous, the whole worker
environment, run directory, settings with provenance) before anything starts. ``fdl run
--dry-run`` prints the spec; :mod:`fdl.launch.elastic` executes it.

Rendezvous rules: :mod:`fdl.launch.rendezvous`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from fdl.errors import UsageError
from fdl.launch.devices import DevicePlan, plan_devices
from fdl.launch.interpreters import Interpreter
from fdl.launch.network import NodeNetwork
from fdl.launch.rendezvous import Rendezvous, plan_rendezvous
from fdl.launch.request import RunRequest
from fdl.launch.worker_env import build_worker_env
from fdl.settings import PER_WORKER, Setting, check_per_worker
from fdl.system.gpus import GpuSurvey


@dataclass(frozen=True)
class LaunchSpec:
    script: Path
    script_args: tuple[str, ...]
    module: bool
    devices: DevicePlan
    rendezvous: Rendezvous
    max_restarts: int
    run_dir: Path
    settings: dict[str, Setting]
    # All fdl adds to every worker's environment (fdl.launch.worker_env)
    env: dict[str, str] = field(default_factory=dict)
    quiet_ranks: bool = False
    run_dir_use: str = "new"  # "new" | "resume" | "overwrite" (fdl.rundir.layout.check_run_dir)
    network: NodeNetwork | None = None  # several nodes: how this one reaches the others
    network_problem: str | None = None  # --dry-run: why the network could not be decided
    # --worker-python: the local workers that run under another interpreter, as they reported
    # themselves (fdl.launch.interpreters); the others run under the launcher's
    interpreters: tuple[Interpreter, ...] = ()
    # GPU workers: what the check of each one's torch against its GPU found (fdl.launch.kernels;
    # () = every one can run; None = not checked: CPU workers)
    kernel_check: tuple[str, ...] | None = None

    @property
    def nproc_per_node(self) -> int:
        return self.devices.nproc

    def python_of(self, local_rank: int) -> str:
        """The interpreter local worker ``local_rank`` runs under."""
        import sys

        named = {i.local_rank: i.path for i in self.interpreters}
        return named.get(local_rank, sys.executable)

    def to_dict(self) -> dict[str, Any]:
        rdzv = self.rendezvous
        single = rdzv.max_nodes == 1
        return {
            "script": str(self.script), "args": list(self.script_args), "module": self.module,
            "nproc_per_node": self.nproc_per_node,
            "nnodes": f"{rdzv.min_nodes}:{rdzv.max_nodes}" if rdzv.min_nodes != rdzv.max_nodes
            else rdzv.min_nodes,
            "rendezvous": {"backend": rdzv.backend, "endpoint": rdzv.endpoint,
                           "run_id": rdzv.run_id, "node_rank": rdzv.node_rank,
                           "source": rdzv.source},
            "max_restarts": self.max_restarts,
            "run_dir": str(self.run_dir),
            "devices": {"kind": self.devices.kind, "reason": self.devices.reason,
                        "threads_per_worker": self.devices.threads_per_worker},
            "workers": [{"local_rank": r, "rank": r if single else None,
                         "device": self.devices.describe(r), "python": self.python_of(r)}
                        for r in range(self.nproc_per_node)],
            "interpreters": [i.to_dict() for i in self.interpreters],
            "kernel_check": None if self.kernel_check is None else list(self.kernel_check),
            "network": self.network.to_dict() if self.network is not None else (
                {"problem": self.network_problem} if self.network_problem else None),
            "env": dict(sorted(self.env.items())),
            "settings": {k: {"value": s.value, "source": s.source}
                         for k, s in self.settings.items()},
        }


def build_launch_spec(request: RunRequest, *, settings: Mapping[str, Setting],
                      survey: GpuSurvey, env: Mapping[str, str], cwd: Path, now: datetime,
                      run_id: str, logical_cores: int, taken: Callable[[Path], bool],
                      live: bool = False, launcher_pid: int | None = None) -> LaunchSpec:
    """What will run, from the request and its ``settings`` (resolved flag > env > file >
    default by :func:`fdl.launch.plan_run`, which also completes ``request`` from ``--resume``).
    Pure: all inputs are given; ``env`` is the launcher's environment, ``taken`` says whether a
    default run directory name is in use; ``live`` and ``launcher_pid`` go into the worker
    environment (:func:`fdl.launch.worker_env.build_worker_env`)."""
    run_dir_use = _run_dir_use(request)
    script = _script_path(request, cwd)
    devices = plan_devices(survey=survey, devices=request.get("devices"),
                           nproc=settings["nproc_per_node"].value, logical_cores=logical_cores,
                           env=env)
    rendezvous = plan_rendezvous(request, env=env, run_id=run_id)
    _check_slowdown(settings, devices.nproc * rendezvous.max_nodes)
    for name in PER_WORKER:  # one value for every worker, or one per worker
        values = settings[name].value
        if values is not None:
            check_per_worker(name, values, devices.nproc * rendezvous.max_nodes, as_flag=True)
    run_dir = _run_dir(settings, cwd=cwd, now=now, stem=script.stem,
                       policy=settings["policy"].value, taken=taken)
    return LaunchSpec(script, request.script_args, request.get("module"), devices, rendezvous,
                      settings["max_restarts"].value, run_dir, dict(settings),
                      build_worker_env(settings, devices=devices, run_dir=run_dir, parent=env,
                                       resume=request.get("resume") is not None, live=live,
                                       launcher_pid=launcher_pid),
                      request.get("quiet_ranks"), run_dir_use)


def _run_dir_use(request: RunRequest) -> str:
    if request.get("resume") is not None and request.get("overwrite_run_dir"):
        raise UsageError("--resume and --overwrite-run-dir cannot be combined",
                         hint="--resume continues the run in RUN_DIR; --overwrite-run-dir "
                              "replaces it with a new one")
    return "resume" if request.get("resume") is not None else (
        "overwrite" if request.get("overwrite_run_dir") else "new")


def _script_path(request: RunRequest, cwd: Path) -> Path:
    if request.script is None:
        raise UsageError("missing SCRIPT", hint="fdl run [OPTIONS] SCRIPT [ARGS...], or fdl run "
                                                "--resume RUN_DIR to continue a run")
    if request.get("module"):
        return Path(request.script)
    return (cwd / request.script).resolve()


def _check_slowdown(settings: Mapping[str, Setting], world_size: int) -> None:
    factors = settings["simulate_slowdown"].value
    if factors is not None and len(factors) != world_size:
        raise UsageError(
            f"--simulate-slowdown has {len(factors)} factor(s) for {world_size} worker(s)",
            hint="give one factor per worker, e.g. --simulate-slowdown 1,2.5 for 2 workers")


def _run_dir(settings: Mapping[str, Setting], *, cwd: Path, now: datetime, stem: str,
             policy: str, taken: Callable[[Path], bool]) -> Path:
    explicit = settings["run_dir"].value
    if explicit:
        return (cwd / explicit).resolve()
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    name = f"{stamp}-{stem.replace('.', '_')}-{policy}"
    path, count = (cwd / "runs" / name).resolve(), 1
    while taken(path):  # a run of the same script and policy started in the same second
        count += 1
        path = path.with_name(f"{name}-{count}")
    return path
