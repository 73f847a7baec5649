"""``fdl run`` as data: a :class:`RunRequest` (the flags) becomes a :class:`LaunchSpec` (what
will run: devices, rendezvous, worker env, run directory, settings with provenance) before
anything starts. ``fdl run --dry-run`` prints the spec; :mod:`fdl.launch.elastic` executes it.

Rendezvous rules, as torchrun users expect them:

* single node (default, or ``--standalone``): c10d on ``127.0.0.1`` with a free port chosen by
  the OS — never a fixed 29500;
* ``--master-addr/--master-port``: torchrun's static rendezvous at that address;
* several nodes: the same command on each node with ``--nnodes N`` (or ``MIN:MAX``) and
  ``--rdzv-endpoint HOST:PORT`` (c10d by default; ``--rdzv-backend static`` needs
  ``--node-rank``);
* inside a Slurm allocation the node count, node rank, endpoint and run id come from SLURM_*.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from fdl.errors import UsageError
from fdl.launch.devices import DevicePlan, plan_devices
from fdl.launch.settings import Setting, resolve, worker_env
from fdl.launch.slurm import slurm_job
from fdl.system.gpus import GpuSurvey

DEFAULTS: dict[str, Any] = {
    "policy": "cadence", "backend": "auto", "epochs": 5, "batch_size": 64, "seed": 42,
    "simulate_slowdown": None, "run_dir": None, "nproc_per_node": "auto", "max_restarts": 0,
    "checkpoint_every": None,
}


@dataclass(frozen=True)
class RunRequest:
    """The flags of ``fdl run`` as given (None: not given)."""

    script: str | None
    script_args: tuple[str, ...] = ()
    module: bool = False
    nproc_per_node: str | None = None
    nnodes: str | None = None
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_backend: str | None = None
    rdzv_id: str | None = None
    standalone: bool = False
    master_addr: str | None = None
    master_port: int | None = None
    max_restarts: int | None = None
    devices: str | None = None
    policy: str | None = None
    backend: str | None = None
    simulate_slowdown: str | None = None
    epochs: int | None = None
    batch_size: int | None = None
    seed: int | None = None
    run_dir: str | None = None
    checkpoint_every: str | None = None
    resume: str | None = None  # a run directory to continue (fdl.launch.resume)
    quiet_ranks: bool = False


@dataclass(frozen=True)
class Rendezvous:
    backend: str  # "c10d" | "static"
    endpoint: str
    run_id: str
    min_nodes: int
    max_nodes: int
    node_rank: int | None  # static rendezvous only; c10d assigns node ranks itself
    local_addr: str | None
    source: str  # "single node" | "flags" | "slurm"


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
    env: dict[str, str] = field(default_factory=dict)  # added to every worker's environment
    quiet_ranks: bool = False

    @property
    def nproc_per_node(self) -> int:
        return self.devices.nproc

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
                         "device": self.devices.describe(r)} for r in range(self.nproc_per_node)],
            "env": dict(sorted(self.env.items())),
            "settings": {k: {"value": s.value, "source": s.source}
                         for k, s in self.settings.items()},
        }


def build_launch_spec(request: RunRequest, *, survey: GpuSurvey, env: Mapping[str, str],
                      file_values: Mapping[str, Any], file_path: Path | None, cwd: Path,
                      now: datetime, run_id: str, logical_cores: int) -> LaunchSpec:
    """Resolve every flag against env, config file and defaults. Pure: all inputs are given."""
    if request.resume is not None:
        from fdl.launch.resume import resume_request

        request = resume_request(request, cwd=cwd)
    script = _script_path(request, cwd)
    settings = resolve(flags=_flag_values(request), env=env, file_values=file_values,
                       file_path=file_path, defaults=DEFAULTS)
    devices = plan_devices(survey=survey, devices=request.devices,
                           nproc=settings["nproc_per_node"].value, logical_cores=logical_cores,
                           env=env)
    rendezvous = _rendezvous(request, env=env, run_id=run_id)
    _check_slowdown(settings, devices.nproc * rendezvous.max_nodes)
    run_dir = _run_dir(settings, cwd=cwd, now=now, stem=script.stem,
                       policy=settings["policy"].value)
    return LaunchSpec(script, request.script_args, request.module, devices, rendezvous,
                      settings["max_restarts"].value, run_dir, settings,
                      _worker_env(settings, devices, run_dir, env, resume=request.resume),
                      request.quiet_ranks)


def _flag_values(request: RunRequest) -> dict[str, Any]:
    return {key: getattr(request, key) for key in DEFAULTS}


def _script_path(request: RunRequest, cwd: Path) -> Path:
    if request.script is None:
        raise UsageError("missing SCRIPT", hint="fdl run [OPTIONS] SCRIPT [ARGS...], or fdl run "
                                                "--resume RUN_DIR to continue a run")
    if request.module:
        return Path(request.script)
    path = (cwd / request.script).resolve()
    if not path.is_file():
        raise UsageError(f"script not found: {request.script}",
                         hint="fdl run SCRIPT [ARGS...], e.g. fdl run train.py --policy async")
    return path


def _rendezvous(request: RunRequest, *, env: Mapping[str, str], run_id: str) -> Rendezvous:
    slurm = None if request.standalone else slurm_job(env)
    min_nodes, max_nodes = _parse_nnodes(request.nnodes or (str(slurm.nnodes) if slurm else "1"))
    backend = request.rdzv_backend or "c10d"
    if backend not in ("c10d", "static"):
        raise UsageError(f"unknown --rdzv-backend {backend!r}", hint="use c10d or static")
    run_id = request.rdzv_id or (slurm.job_id if slurm else run_id)
    if request.master_port is not None and not request.rdzv_endpoint and max_nodes == 1:
        addr = request.master_addr or "127.0.0.1"
        return Rendezvous("static", f"{addr}:{request.master_port}", run_id, 1, 1, 0, addr,
                          "flags")
    if max_nodes == 1 and not request.rdzv_endpoint:
        return Rendezvous("c10d", "127.0.0.1:0", run_id, 1, 1, None, "127.0.0.1", "single node")
    endpoint = request.rdzv_endpoint or (slurm.endpoint if slurm else None)
    if request.master_addr and not endpoint:
        endpoint = f"{request.master_addr}:{request.master_port or 29400}"
    if not endpoint:
        raise UsageError(f"--nnodes {request.nnodes} needs --rdzv-endpoint HOST:PORT",
                         hint="run the same command on every node, e.g. "
                              "--nnodes 2 --rdzv-endpoint node0:29400")
    node_rank = request.node_rank if request.node_rank is not None else (
        slurm.node_rank if slurm else None)
    if backend == "static" and node_rank is None:
        raise UsageError("--rdzv-backend static needs --node-rank")
    return Rendezvous(backend, endpoint, run_id, min_nodes, max_nodes,
                      node_rank if backend == "static" else None, None,
                      "slurm" if slurm and not request.rdzv_endpoint else "flags")


def _parse_nnodes(text: str) -> tuple[int, int]:
    low, _, high = str(text).partition(":")
    try:
        bounds = (int(low), int(high or low))
    except ValueError:
        bounds = (0, 0)
    if bounds[0] < 1 or bounds[1] < bounds[0]:
        raise UsageError(f"--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return bounds


def _check_slowdown(settings: dict[str, Setting], world_size: int) -> None:
    factors = settings["simulate_slowdown"].value
    if factors is not None and len(factors) != world_size:
        raise UsageError(
            f"--simulate-slowdown has {len(factors)} factor(s) for {world_size} worker(s)",
            hint="give one factor per worker, e.g. --simulate-slowdown 1,2.5 for 2 workers")


def _run_dir(settings: dict[str, Setting], *, cwd: Path, now: datetime, stem: str,
             policy: str) -> Path:
    explicit = settings["run_dir"].value
    if explicit:
        return (cwd / explicit).resolve()
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    return (cwd / "runs" / f"{stamp}-{stem.replace('.', '_')}-{policy}").resolve()


def _worker_env(settings: dict[str, Setting], devices: DevicePlan, run_dir: Path,
                parent: Mapping[str, str], *, resume: str | None = None) -> dict[str, str]:
    # A user's own OMP_NUM_THREADS wins, as with torchrun; else each worker's share of cores.
    threads = parent.get("OMP_NUM_THREADS") or str(devices.threads_per_worker)
    env = {**worker_env(settings), "FDL_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": threads}
    if resume is not None:
        env["FDL_RESUME"] = "1"
    if devices.kind == "cuda":
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = devices.cuda_visible_devices or ""
    return env


# fdl run's own options are fdl's wherever they appear, so the documented
# `fdl run train.py --policy async --nproc-per-node 2` works. Everything after a `--` belongs to
# the script untouched (the way to hand a script an option named like one of fdl's).
VALUE_FLAGS = {"--policy": "policy", "--backend": "backend",
               "--simulate-slowdown": "simulate_slowdown", "--epochs": "epochs",
               "--batch-size": "batch_size", "--seed": "seed", "--run-dir": "run_dir",
               "--nproc-per-node": "nproc_per_node", "--nnodes": "nnodes",
               "--node-rank": "node_rank", "--rdzv-endpoint": "rdzv_endpoint",
               "--rdzv-backend": "rdzv_backend", "--rdzv-id": "rdzv_id",
               "--max-restarts": "max_restarts", "--master-addr": "master_addr",
               "--master-port": "master_port", "--devices": "devices",
               "--checkpoint-every": "checkpoint_every", "--resume": "resume"}
BOOL_FLAGS = {"--standalone": "standalone", "--quiet-ranks": "quiet_ranks",
              "--dry-run": "dry_run", "--json": "json_output"}
INT_FIELDS = ("node_rank", "master_port")


def split_script_args(args: tuple[str, ...]) -> tuple[dict[str, object], tuple[str, ...]]:
    """``("--policy", "async", "--lr", "0.1")`` -> ``({"policy": "async"}, ("--lr", "0.1"))``."""
    claimed: dict[str, object] = {}
    kept: list[str] = []
    items = list(args)
    while items:
        arg = items.pop(0)
        if arg == "--":
            kept.extend(items)
            break
        flag, eq, value = arg.partition("=")
        if flag in BOOL_FLAGS and not eq:
            claimed[BOOL_FLAGS[flag]] = True
        elif flag in VALUE_FLAGS:
            if not eq:
                if not items:
                    raise UsageError(f"{flag} needs a value", hint=f"e.g. {flag} <value>")
                value = items.pop(0)
            claimed[VALUE_FLAGS[flag]] = _typed(VALUE_FLAGS[flag], value, flag)
        else:
            kept.append(arg)
    return claimed, tuple(kept)


def _typed(field: str, value: str, flag: str) -> object:
    if field not in INT_FIELDS:
        return value
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"{flag} must be an integer, got {value!r}") from None
