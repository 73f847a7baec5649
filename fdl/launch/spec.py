"""``fdl run`` as data: a :class:`RunRequest` (the flags) becomes a :class:`LaunchSpec` (what
will run: devices, rendezvous, worker env, run directory, settings with provenance) before
anything starts. ``fdl run --dry-run`` prints the spec; :mod:`fdl.launch.elastic` executes it.

Rendezvous rules: :mod:`fdl.launch.rendezvous`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from fdl.errors import UsageError
from fdl.launch.devices import DevicePlan, plan_devices
from fdl.launch.rendezvous import Rendezvous, plan_rendezvous
from fdl.launch.settings import Setting, resolve, worker_env
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
    overwrite_run_dir: bool = False  # replace the earlier run in run_dir (fdl.launch.rundir)
    quiet_ranks: bool = False


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
    run_dir_use: str = "new"  # "new" | "resume" | "overwrite" (fdl.launch.rundir.check_run_dir)

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
    run_dir_use = _run_dir_use(request)
    if request.resume is not None:
        from fdl.launch.resume import resume_request

        request = resume_request(request, cwd=cwd)
    script = _script_path(request, cwd)
    settings = resolve(flags=_flag_values(request), env=env, file_values=file_values,
                       file_path=file_path, defaults=DEFAULTS)
    devices = plan_devices(survey=survey, devices=request.devices,
                           nproc=settings["nproc_per_node"].value, logical_cores=logical_cores,
                           env=env)
    rendezvous = plan_rendezvous(request, env=env, run_id=run_id)
    _check_slowdown(settings, devices.nproc * rendezvous.max_nodes)
    run_dir = _run_dir(settings, cwd=cwd, now=now, stem=script.stem,
                       policy=settings["policy"].value)
    return LaunchSpec(script, request.script_args, request.module, devices, rendezvous,
                      settings["max_restarts"].value, run_dir, settings,
                      _worker_env(settings, devices, run_dir, env, resume=request.resume),
                      request.quiet_ranks, run_dir_use)


def _run_dir_use(request: RunRequest) -> str:
    if request.resume is not None and request.overwrite_run_dir:
        raise UsageError("--resume and --overwrite-run-dir cannot be combined",
                         hint="--resume continues the run in RUN_DIR; --overwrite-run-dir "
                              "replaces it with a new one")
    return "resume" if request.resume is not None else (
        "overwrite" if request.overwrite_run_dir else "new")


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
    name = f"{stamp}-{stem.replace('.', '_')}-{policy}"
    path, count = (cwd / "runs" / name).resolve(), 1
    while path.exists():  # a run of the same script and policy started in the same second
        count += 1
        path = path.with_name(f"{name}-{count}")
    return path


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
              "--overwrite-run-dir": "overwrite_run_dir",
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
        raise UsageError(f"{flag} must be an integer, got {value!r}",
                         hint=f"e.g. {flag} 1") from None
