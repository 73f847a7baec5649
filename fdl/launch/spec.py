"""``fdl run`` as data: a :class:`~fdl.launch.request.RunRequest` (the flags), its resolved
settings and what the planning shell probed become a :class:`LaunchSpec` (what will run:
devices, rendezvous, each worker's interpreter, the backend, the whole worker environment, run
directory, settings with provenance) before anything starts. ``fdl run --dry-run`` prints the
spec; :mod:`fdl.launch.elastic` executes it.

Two pure functions, around the probes :func:`fdl.launch.plan_run` runs between them:

* :func:`place_workers`: from the request, its settings and the GPU survey alone, the workers'
  devices, their rendezvous and the run directory (:class:`WorkerPlacement`), with every check
  of the flags; the probes then ask about these workers: their interpreters, their torch builds
  (GPU workers) and this node's network toward that rendezvous (:class:`LaunchProbes`);
* :func:`build_launch_spec`: from the request, its settings, the placement and every probe's
  result, the finished spec. Each decision that needs a probe is made here, once: the
  interpreters' map, the kernel check's refusal, the averaging backend, the network (or, for
  ``--dry-run``, why it could not be decided), and the worker environment
  (:func:`fdl.launch.worker_env.build_worker_env`) from all of them.

Rendezvous rules: :mod:`fdl.launch.rendezvous`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fdl.errors import UsageError
from fdl.files import named_path
from fdl.launch.devices import DevicePlan, check_devices, plan_devices
from fdl.launch.interpreters import Interpreter, WorkerPythons, python_of
from fdl.launch.network import EndpointNotResolved, NodeNetwork
from fdl.launch.rendezvous import Rendezvous, plan_rendezvous
from fdl.launch.request import RunRequest
from fdl.launch.worker_env import build_worker_env
from fdl.ranges import shortened
from fdl.settings import BY_NAME, PER_WORKER, RESUME_ENV, Setting, check_per_worker
from fdl.system.gpus import GpuSurvey

if TYPE_CHECKING:  # fdl.launch.kernels is imported for GPU workers only: a CPU run pays nothing
    from fdl.launch.kernels import KernelProblem
    from fdl.system.torchenv import TorchInfo


@dataclass(frozen=True)
class LaunchSpec:
    """What ``fdl run`` will run, every decision made (:func:`build_launch_spec`):
    :meth:`to_dict` is what ``--dry-run`` prints and ``config.json`` records."""

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
    # --worker-python or the device map: the local workers that run under another interpreter,
    # as they reported themselves (fdl.launch.interpreters); the others run under the launcher's
    interpreters: tuple[Interpreter, ...] = ()
    # GPU workers: what the check of each one's torch against its GPU found (fdl.launch.kernels;
    # () = every one can run; None = not checked: CPU workers)
    kernel_check: tuple[KernelProblem, ...] | None = None

    @property
    def nproc_per_node(self) -> int:
        return self.devices.nproc

    def python_of(self, local_rank: int) -> str:
        """The interpreter local worker ``local_rank`` runs under."""
        return python_of(self.interpreters, local_rank)

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
            "kernel_check": None if self.kernel_check is None else
            [problem.message for problem in self.kernel_check],
            "network": self.network.to_dict() if self.network is not None else (
                {"problem": self.network_problem} if self.network_problem else None),
            "env": dict(sorted(self.env.items())),
            "settings": {k: {"value": s.value, "source": s.source}
                         for k, s in self.settings.items()},
        }


@dataclass(frozen=True)
class WorkerPlacement:
    """Where and how many: what :func:`place_workers` decides before the probes that ask
    about these workers."""

    script: Path
    devices: DevicePlan
    rendezvous: Rendezvous
    run_dir: Path
    run_dir_use: str  # "new" | "resume" | "overwrite"


@dataclass(frozen=True)
class LaunchProbes:
    """What :func:`fdl.launch.plan_run` found outside the request, as plain data. A field
    left at its default was not probed (a plan checked without them)."""

    survey: GpuSurvey  # the GPUs (fdl.system.gpus), the one probe place_workers needs
    # the interpreters named for local workers, checked alike (fdl.launch.interpreters)
    pythons: WorkerPythons = field(default_factory=WorkerPythons)
    # GPU workers: each interpreter's torch build, by path (fdl.launch.kernels.probe_builds)
    builds: Mapping[str, TorchInfo] | None = None
    # this node's network (fdl.launch.network), or the endpoint that does not resolve here
    network: NodeNetwork | EndpointNotResolved | None = None


def place_workers(request: RunRequest, *, settings: Mapping[str, Setting], survey: GpuSurvey,
                  env: Mapping[str, str], cwd: Path, now: datetime, run_id: str,
                  logical_cores: int, taken: Callable[[Path], bool]) -> WorkerPlacement:
    """The workers' devices, rendezvous and run directory, from the request and its
    ``settings`` (resolved flag > env > file > default by :func:`fdl.launch.plan_run`, which
    also completes ``request`` from ``--resume``), with every check of the flags: usage errors
    before any slower probe runs. Pure: all inputs are given; ``env`` is the launcher's
    environment, ``taken`` says whether a default run directory name is in use."""
    run_dir_use = _run_dir_use(request)
    script = _script_path(request, cwd)
    devices = plan_devices(survey=survey, devices=request.get("devices"),
                           nproc=settings["nproc_per_node"].value, logical_cores=logical_cores,
                           env=env)
    rendezvous = plan_rendezvous(request, env=env, run_id=run_id)
    _check_caller_env(env, resuming=request.get("resume") is not None)
    _check_per_worker(settings, devices.nproc, rendezvous)
    check_devices(devices, backend=settings["backend"].value,
                  precision=settings["precision"].value, one_node=rendezvous.max_nodes == 1)
    _check_sample_budget(settings, devices.nproc * rendezvous.max_nodes)
    run_dir = _run_dir(settings, cwd=cwd, now=now, stem=script.stem,
                       policy=settings["policy"].value, taken=taken)
    return WorkerPlacement(script, devices, rendezvous, run_dir, run_dir_use)


def build_launch_spec(request: RunRequest, *, settings: Mapping[str, Setting],
                      placement: WorkerPlacement, probes: LaunchProbes, env: Mapping[str, str],
                      live: bool = False, launcher_pid: int | None = None,
                      preview: bool = False) -> LaunchSpec:
    """The finished spec, every decision that needs a probe made once: a worker whose torch
    cannot run on its GPU is refused, the backend decided (:func:`decide_backend`), the
    network taken, and the worker environment made from all of it. ``env``: the launcher's
    environment; ``live`` and ``launcher_pid`` go into the worker environment
    (:func:`fdl.launch.worker_env.build_worker_env`); ``preview`` (``--dry-run``): a kernel
    problem and an endpoint that does not resolve here are shown in the spec, not refused.
    Pure."""
    devices, named = placement.devices, probes.pythons.named
    problems = _kernel_check(devices, probes, preview=preview)
    network, network_problem = _network(probes.network, preview=preview)
    decided = {**settings, "backend": decide_backend(settings["backend"], pythons=probes.pythons,
                                                     nproc=devices.nproc, builds=probes.builds)}
    worker_env = build_worker_env(
        decided, devices=devices, run_dir=placement.run_dir, parent=env,
        resume=request.get("resume") is not None, live=live, launcher_pid=launcher_pid,
        worker_pythons={i.local_rank: i.path for i in named}, network=network)
    return LaunchSpec(placement.script, request.script_args, request.get("module"), devices,
                      placement.rendezvous, settings["max_restarts"].value, placement.run_dir,
                      decided, worker_env, quiet_ranks=request.get("quiet_ranks"),
                      run_dir_use=placement.run_dir_use, network=network,
                      network_problem=network_problem, interpreters=named, kernel_check=problems)


def _kernel_check(devices: DevicePlan, probes: LaunchProbes, *,
                  preview: bool) -> tuple[KernelProblem, ...] | None:
    """GPU workers: each whose torch cannot run on its GPU, refused unless ``preview``; None
    for CPU workers (or builds not probed)."""
    if devices.kind != "cuda" or probes.builds is None:
        return None
    from fdl.launch.kernels import kernel_problems

    pythons = {rank: probes.pythons.python_of(rank) for rank in range(devices.nproc)}
    problems = kernel_problems(devices, probes.survey, pythons, probes.builds)
    if problems and not preview:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UsageError(f"{problems[0].message}{more}",
                         hint="`fdl diagnose` says which torch build runs each GPU; "
                              "--worker-python runs a worker under another environment")
    return problems


def _network(found: NodeNetwork | EndpointNotResolved | None, *,
             preview: bool) -> tuple[NodeNetwork | None, str | None]:
    """The network the probe found, and why there is none: an endpoint that does not resolve
    here is refused, or with ``preview`` shown as the problem the run would refuse."""
    if not isinstance(found, EndpointNotResolved):
        return found, None
    if not preview:
        raise found
    return None, found.message


def decide_backend(chosen: Setting, *, pythons: WorkerPythons, nproc: int,
                   builds: Mapping[str, TorchInfo] | None) -> Setting:
    """The averaging backend. One the user set (flag, variable, file) stands; left at its
    default, workers under more than one interpreter average on ``cpu`` (two wheels carry two
    NCCLs; averages go through host memory), unless every GPU worker's build carries one and
    the same NCCL (``builds``: GPU workers only). Its source says why."""
    if chosen.source != "default" or pythons.environments(nproc) <= 1:
        return chosen
    if builds is not None:
        from fdl.launch.kernels import shared_nccl

        if shared_nccl(builds):
            return chosen
    return Setting("cpu", f"{pythons.origin}: several environments")


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


def _check_caller_env(env: Mapping[str, str], *, resuming: bool) -> None:
    """``FDL_RESUME`` is fdl run's to give its workers (with ``--resume``): one left in the
    caller's environment would make every worker of a new run look for a checkpoint and fail,
    after the run directory exists."""
    if env.get(RESUME_ENV) and not resuming:
        raise UsageError(f"{RESUME_ENV} is set in your environment ({shortened(env[RESUME_ENV])}); "
                         "fdl run sets it for its workers only with --resume",
                         hint=f"unset {RESUME_ENV}; fdl run --resume RUN_DIR continues a run")


def _check_per_worker(settings: Mapping[str, Setting], nproc: int,
                      rendezvous: Rendezvous) -> None:
    """One slowdown factor per worker, and a :data:`PER_WORKER` setting once or once per worker
    (each worker checks its count against the group's world size): the count must match, and
    with an elastic ``--nnodes MIN:MAX`` a list per worker cannot, whatever number joins."""
    low, high = nproc * rendezvous.min_nodes, nproc * rendezvous.max_nodes
    for name in ("simulate_slowdown", *PER_WORKER):
        values = settings[name].value
        if values is None or (name in PER_WORKER and len(values) <= 1):
            continue
        flag = BY_NAME[name].flag_name
        if low != high:
            raise UsageError(f"{flag} gives one value per worker, and --nnodes "
                             f"{rendezvous.min_nodes}:{rendezvous.max_nodes} leaves the number "
                             f"of workers open ({low} to {high})",
                             hint="use a fixed --nnodes N" + (
                                 "" if name == "simulate_slowdown" else
                                 f", or one value for every worker ({flag} "
                                 f"{PER_WORKER[name][0]})"))
        if name in PER_WORKER:
            check_per_worker(name, values, high, as_flag=True)
        elif len(values) != high:
            raise UsageError(
                f"--simulate-slowdown has {len(values)} factor(s) for {high} worker(s)",
                hint="give one factor per worker, e.g. --simulate-slowdown 1,2.5 for 2 workers")


def _check_sample_budget(settings: Mapping[str, Setting], world_size: int) -> None:
    """A sample budget below one batch per worker (``world_size x batch_size``), which the
    engine's plan refuses (fdl.engine.plan.PlanConfig); only with a batch size given here, since
    the script may set its own."""
    budget, batch = settings["max_samples"], settings["batch_size"]
    if budget.value is None or batch.source == "default":
        return
    least = world_size * batch.value
    if budget.value < least:
        where = BY_NAME["max_samples"].source_name(budget.source)
        raise UsageError(f"max_samples {budget.value} ({where}) is less than one batch per "
                         f"worker ({world_size} x batch_size {batch.value} = {least})",
                         hint=f"give max_samples {least} or more, a smaller batch_size, or "
                              "max_steps instead")


def _run_dir(settings: Mapping[str, Setting], *, cwd: Path, now: datetime, stem: str,
             policy: str, taken: Callable[[Path], bool]) -> Path:
    explicit = settings["run_dir"].value
    if explicit:  # as named: a link there is refused (fdl.rundir.layout), not followed
        return named_path(cwd / explicit)
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    name = f"{stamp}-{stem.replace('.', '_')}-{policy}"
    path, count = (cwd / "runs" / name).resolve(), 1
    while taken(path):  # a run of the same script and policy started in the same second
        count += 1
        path = path.with_name(f"{name}-{count}")
    return path
