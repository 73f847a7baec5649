"""``fdl run``: launch one worker per device on torch.distributed.elastic.

    fdl run train.py --policy async                 # one worker per GPU, or 2 CPU workers
    fdl run --nproc-per-node 4 train.py --lr 0.1    # args after the script go to the script
    fdl run --dry-run train.py                      # print the launch spec, start nothing
    fdl run --nnodes 2 --rdzv-endpoint node0:29400 train.py   # on every node

:func:`plan_run` is the planning shell, the only part of planning that reads the environment,
``fdl.toml``, the clock and the machine: it resolves the settings once, runs the probes and
hands their results, as plain data, to the pure functions of :mod:`fdl.launch.spec`, which
return the :class:`~fdl.launch.spec.LaunchSpec`; :func:`fdl.launch.elastic.launch` runs it.
docs/run.md is the manual.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # every worker imports this package (fdl.launch.worker): keep it bare
    from collections.abc import Mapping
    from pathlib import Path

    from fdl.launch.request import RunRequest
    from fdl.launch.spec import LaunchProbes, LaunchSpec, WorkerPlacement
    from fdl.system.gpus import GpuSurvey


def plan_run(request: RunRequest, *, env: Mapping[str, str] | None = None,
             cwd: Path | None = None, live: bool = False,
             launcher_pid: int | None = None, preview: bool = False) -> LaunchSpec:
    """Everything ``fdl run`` decides before starting a process. ``live``: the launcher will
    show live progress; ``launcher_pid``: the process that will start the workers (None for a
    plan that is only checked, as ``fdl compare`` checks its cells). Both go into the worker
    environment (:mod:`fdl.launch.worker_env`). ``preview`` (``--dry-run``): a node network
    that cannot be decided here (an endpoint this machine cannot resolve: a Slurm node list
    read off the cluster) and workers whose torch cannot run on their GPU are shown as the
    problems the real run would refuse, not raised; every other problem is refused alike.

    In order: the settings (flag > env > file > default, once), the GPU survey, the workers'
    placement (pure, with every check of the flags), the probes that ask about those workers
    (:func:`_probe`), then the spec (pure), decided once from all of it."""
    import os
    import uuid
    from datetime import datetime, timezone
    from pathlib import Path

    from fdl.launch.config_file import load_config_file
    from fdl.launch.devices import usable_cores
    from fdl.launch.spec import build_launch_spec, place_workers
    from fdl.settings import resolve_run_settings
    from fdl.system.gpus import GpuSurvey, probe_gpus

    env = os.environ if env is None else env
    cwd = Path.cwd() if cwd is None else cwd
    if request.get("resume") is not None:
        from fdl.launch.resume import resume_request

        request = resume_request(request, cwd=cwd)
    _check_script(request, cwd=cwd)
    file_values, file_path = load_config_file(cwd)
    settings = resolve_run_settings(flags=request.flags, env=env, file_values=file_values,
                                    file_path=file_path)
    wants_cpu = settings["nproc_per_node"].value == "cpu"  # no GPU probe then
    survey = GpuSurvey("none", (), None, None) if wants_cpu else probe_gpus(env=env)
    placement = place_workers(
        request, settings=settings, survey=survey, env=env, cwd=cwd,
        now=datetime.now(timezone.utc), run_id=uuid.uuid4().hex[:12],
        logical_cores=usable_cores(),  # the affinity's cores, without importing psutil
        taken=Path.exists)
    return build_launch_spec(request, settings=settings, placement=placement,
                             probes=_probe(request, placement, survey=survey, env=env, cwd=cwd),
                             env=env, live=live, launcher_pid=launcher_pid, preview=preview)


def _probe(request: RunRequest, placement: WorkerPlacement, *, survey: GpuSurvey,
           env: Mapping[str, str], cwd: Path) -> LaunchProbes:
    """What the placed workers meet on this machine: the interpreters named for them
    (``--worker-python``, else the device map ``fdl setup`` wrote), checked alike; with GPU
    workers, each interpreter's torch build; this node's network toward the rendezvous. Each
    probe's own usage errors are raised here, in that order; an endpoint that does not resolve
    here is kept as data, since whether it is refused is the spec's decision (``--dry-run``)."""
    from fdl.launch.interpreters import probe_worker_pythons
    from fdl.launch.network import EndpointNotResolved, NodeNetwork, probe_network
    from fdl.launch.spec import LaunchProbes
    from fdl.paths import flodl_home

    devices = placement.devices
    pythons = probe_worker_pythons(request.get("worker_python"), devices=devices, cwd=cwd,
                                   home=flodl_home())
    builds = None
    if devices.kind == "cuda":  # a CPU run pays nothing for the kernel check, not its import
        from fdl.launch.kernels import probe_builds

        builds = probe_builds({rank: pythons.python_of(rank) for rank in range(devices.nproc)})
    network: NodeNetwork | EndpointNotResolved
    try:
        network = probe_network(placement.rendezvous, env)  # from this node's routes
    except EndpointNotResolved as exc:
        network = exc
    return LaunchProbes(survey, pythons, builds, network)


def _not_a_script(path: Path) -> str | None:
    """What stands at ``path`` where a script should be (None: nothing there)."""
    import stat

    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _check_script(request: RunRequest, *, cwd: Path) -> None:
    from fdl.errors import UsageError, os_failure

    if request.script is None or request.get("module"):  # the spec says what is missing
        return
    path = cwd / request.script
    if not path.is_file():
        kind = _not_a_script(path)
        raise UsageError(f"script not found: {request.script}" if kind is None else
                         f"the script {request.script} is {kind}, not a file",
                         hint="fdl run SCRIPT [ARGS...], e.g. fdl run train.py --policy async")
    try:  # every worker would fail on a script it cannot read, after the run began
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise os_failure(exc, doing="cannot read the script", exit_code=2) from exc
