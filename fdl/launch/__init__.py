"""``fdl run``: launch one worker per device on torch.distributed.elastic.

    fdl run train.py --policy async                 # one worker per GPU, or 2 CPU workers
    fdl run --nproc-per-node 4 train.py --lr 0.1    # args after the script go to the script
    fdl run --dry-run train.py                      # print the launch spec, start nothing
    fdl run --nnodes 2 --rdzv-endpoint node0:29400 train.py   # on every node

:func:`plan_run` turns a :class:`~fdl.launch.request.RunRequest` into a
:class:`~fdl.launch.spec.LaunchSpec` (reading the environment, ``fdl.toml`` and the GPU
survey, and resolving the settings once); :func:`fdl.launch.elastic.launch` runs it.
docs/run.md is the manual.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # every worker imports this package (fdl.launch.worker): keep it bare
    from collections.abc import Mapping
    from pathlib import Path

    from fdl.launch.request import RunRequest
    from fdl.launch.spec import LaunchSpec
    from fdl.system.gpus import GpuSurvey


def plan_run(request: RunRequest, *, env: Mapping[str, str] | None = None,
             cwd: Path | None = None, live: bool = False,
             launcher_pid: int | None = None, preview: bool = False) -> LaunchSpec:
    """Everything ``fdl run`` decides before starting a process. ``live``: the launcher will
    show live progress; ``launcher_pid``: the process that will start the workers (None for a
    plan that is only checked, as ``fdl compare`` checks its cells). Both go into the worker
    environment (:mod:`fdl.launch.worker_env`). ``preview`` (``--dry-run``): a node network
    that cannot be decided here (an endpoint this machine cannot resolve: a Slurm node list
    read off the cluster) is shown as the problem the real run would refuse, not raised; every
    other problem is refused alike."""
    import os
    import uuid
    from dataclasses import replace
    from datetime import datetime, timezone
    from pathlib import Path

    from fdl.launch.config_file import load_config_file
    from fdl.launch.devices import usable_cores
    from fdl.launch.network import EndpointNotResolved, node_network
    from fdl.launch.spec import build_launch_spec
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
    spec = build_launch_spec(
        request, settings=settings, survey=survey, env=env, cwd=cwd,
        now=datetime.now(timezone.utc), run_id=uuid.uuid4().hex[:12],
        logical_cores=usable_cores(),  # the affinity's cores, without psutil's 10 ms import
        taken=Path.exists, live=live, launcher_pid=launcher_pid,
    )
    spec = _with_interpreters(request, spec, cwd=cwd)
    spec = _with_kernel_check(spec, survey, preview=preview)
    try:
        network = node_network(spec.rendezvous, env)  # several nodes: from this node's routes
    except EndpointNotResolved as exc:
        if not preview:
            raise
        return replace(spec, network_problem=exc.message)
    return replace(spec, network=network, env={**spec.env, **network.env})


def _with_interpreters(request: RunRequest, spec: LaunchSpec, *, cwd: Path) -> LaunchSpec:
    """Each local worker's interpreter: ``--worker-python``, else (GPU workers) the device map
    ``fdl setup`` wrote. Each named one is checked (it runs, has fdl and torch, of the
    launcher's releases) and the map put in the worker environment; with workers under more
    than one interpreter the averaging backend is ``cpu`` (two wheels, two NCCLs) unless the
    user chose one (:func:`_with_kernel_check` may give it back where every build carries the
    same NCCL)."""
    import json
    import os
    import sys
    from dataclasses import replace

    from fdl.launch import interpreters
    from fdl.paths import flodl_home
    from fdl.settings import Setting, engine_env

    text = request.get("worker_python")
    if text:
        mapping = interpreters.parse_worker_python(text, nproc=spec.nproc_per_node, cwd=cwd)
        source = "--worker-python"
    else:
        mapping = interpreters.from_device_map(spec.devices, home=flodl_home())
        source = "device map"
    if not mapping:
        return spec
    named = [interpreters.probe(rank, path, origin=source)
             for rank, path in sorted(mapping.items())]
    interpreters.check_alike(named, own=interpreters.own_interpreter(), origin=source,
                             own_runs=len(mapping) < spec.nproc_per_node)
    encoded = json.dumps({str(rank): path for rank, path in sorted(mapping.items())})
    env = {**spec.env, interpreters.WORKER_PYTHON_ENV: encoded}
    settings = spec.settings
    used = set(mapping.values()) | ({os.path.abspath(sys.executable)}
                                    if len(mapping) < spec.nproc_per_node else set())
    if settings["backend"].source == "default" and len(used) > 1:
        settings = {**settings, "backend": Setting("cpu", f"{source}: several environments")}
        env.update(engine_env(settings))
    return replace(spec, interpreters=tuple(named), env=env, settings=settings)


def _with_kernel_check(spec: LaunchSpec, survey: GpuSurvey, *, preview: bool) -> LaunchSpec:
    """GPU workers: each one's torch has a kernel for its GPU (fdl.launch.kernels), or the run
    is refused before anything starts; ``--dry-run`` shows what the check found. Several
    environments that carry one and the same NCCL may average over it after all."""
    from dataclasses import replace

    from fdl.errors import UsageError
    from fdl.launch.kernels import kernel_problems, probe_builds, shared_nccl
    from fdl.settings import SETTINGS, SOURCES_ENV, Setting, engine_env

    if spec.devices.kind != "cuda":
        return spec
    pythons = {r: spec.python_of(r) for r in range(spec.nproc_per_node)}
    builds = probe_builds(pythons)
    problems = kernel_problems(spec.devices, survey, pythons, builds)
    if problems and not preview:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UsageError(f"{problems[0]}{more}",
                         hint="`fdl diagnose` says which torch build runs each GPU; "
                              "--worker-python runs a worker under another environment")
    settings, env = spec.settings, dict(spec.env)
    if settings["backend"].source.endswith("several environments") and shared_nccl(builds):
        default = next(s.default for s in SETTINGS if s.name == "backend")
        settings = {**settings, "backend": Setting(default, "default")}
        env.pop(next(s.env for s in SETTINGS if s.name == "backend"), None)
        env[SOURCES_ENV] = engine_env(settings)[SOURCES_ENV]
    return replace(spec, kernel_check=problems, settings=settings, env=env)


def _check_script(request: RunRequest, *, cwd: Path) -> None:
    from fdl.errors import UsageError, os_failure

    if request.script is None or request.get("module"):  # the spec says what is missing
        return
    path = cwd / request.script
    if not path.is_file():
        raise UsageError(f"script not found: {request.script}",
                         hint="fdl run SCRIPT [ARGS...], e.g. fdl run train.py --policy async")
    try:  # every worker would fail on a script it cannot read, after the run began
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise os_failure(exc, doing="cannot read the script", exit_code=2) from exc
