"""Make the environments ``fdl setup`` planned for a host no single build covers (its ``--yes``).

For each environment (fdl.libtorch.environments) in turn: its venv, the torch wheel of its
variant, and the running fdl packed as a wheel (no package index has fdl), each command shown
before it runs and its output kept in ``$FLODL_HOME/envs/<name>.log``. Then each one is checked
the way ``fdl run`` will use it: its torch is probed (release, CUDA, arch list) and must run
every GPU given to it. Only then is ``$FLODL_HOME/envs/device-map.json`` written (atomically),
which ``fdl run`` reads to start each GPU's worker under its environment. A command that fails
stops here with one line naming it and its log; an environment this run began is removed, so
nothing half-made is left to be used.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from fdl.errors import FdlError
from fdl.libtorch.coverage import check_build
from fdl.libtorch.environments import DEVICE_MAP, Environment, EnvironmentPlan
from fdl.system.gpus import GpuSurvey


def make_environments(plan: EnvironmentPlan, *, wheel: Path, wheel_data: bytes,
                      say: Callable[[str], None]) -> Path:
    """Make every environment of ``plan`` (``wheel``: where the running fdl's wheel, its
    ``wheel_data``, is written for their pip), check them, write the device map; its path."""
    from fdl.files import write_atomic, write_json_atomic

    envs = wheel.parent.parent
    try:
        wheel.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(wheel, wheel_data)
    except OSError as exc:
        raise FdlError(f"cannot write {wheel}: {exc.strerror or exc}",
                       hint="FLODL_HOME must be a writable directory") from exc
    total = len(plan.environments)
    for number, env in enumerate(plan.environments, start=1):
        say(f"fdl setup: environment {number}/{total}: {env.name} "
            f"(torch {env.build.version}+{env.build.variant}) at {env.path}")
        _make(env, log=envs / f"{env.name}.log", say=say)
    for env in plan.environments:
        _verify(env)
    return write_json_atomic(envs / DEVICE_MAP, plan.map_document())


def _make(env: Environment, *, log: Path, say: Callable[[str], None]) -> None:
    """Run ``env``'s commands; on a failure remove the venv if this call began it."""
    began = not env.path.exists()
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w", encoding="utf-8") as out:
        for argv in env.commands:
            line = shlex.join(argv)
            say(f"  running: {line}")
            out.write(f"$ {line}\n")
            out.flush()
            try:
                done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=False)
                code = done.returncode
            except OSError as exc:
                code, out_text = None, str(exc)
                out.write(out_text + "\n")
            if code != 0:
                if began:
                    shutil.rmtree(env.path, ignore_errors=True)
                raise FdlError(f"making environment {env.name} failed: {line} exited "
                               f"{code if code is not None else 'before it started'}",
                               hint=f"its output is in {log}")


def _verify(env: Environment) -> None:
    """The environment's torch runs every GPU given to it (as fdl run will check)."""
    from fdl.system.torchenv import probe_torch

    info = probe_torch(python=str(env.python), peers=False)
    wanted = f"{env.build.version}+{env.build.variant}"
    if info.error or not info.installed or info.version != wanted:
        raise FdlError(f"environment {env.name}: its torch is "
                       f"{info.error or info.version or 'missing'}, not {wanted}",
                       hint=f"see {env.path.parent / (env.name + '.log')}")
    coverage = check_build(GpuSurvey("setup", env.gpus, None, None), label=f"torch {wanted}",
                           archs=info.arch_list, cuda=info.cuda_version)
    missing = [item.gpu for item in coverage.gpus if not item.kernel.runs]  # the driver: diagnose
    if missing:
        names = ", ".join(f"{g.name} ({g.arch})" for g in missing)
        raise FdlError(f"environment {env.name}: its torch {wanted} has no kernels for {names}",
                       hint="its wheel is not the build the catalog lists; remove "
                            f"{env.path} and run fdl setup again")
