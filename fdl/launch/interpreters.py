"""Each local worker's Python: ``fdl run --worker-python 1=/path/to/venv/bin/python``.

Two cards of different CUDA generations (a GTX 1060, sm_61, beside an RTX 5060 Ti, sm_120) have
no torch wheel in common, but fdl's workers are separate processes: each may run its own
environment's torch, of the same release, built for its card (fdl setup's environments per
device class, docs/libtorch.md). ``--worker-python LOCAL_RANK=PATH[,...]`` names the interpreter
of each local worker that does not run under the launcher's own.

torch's agent starts every worker with one command (the launcher's ``python -u -m
fdl.launch.worker ...``); the map travels in ``FDL_WORKER_PYTHON`` and a worker whose local rank
is in it replaces itself at once (``exec``: the same process, so the agent's bookkeeping, the
launcher's tie and the logs stay as they are) with that interpreter running the same command.

Before any worker starts, the launcher probes (:func:`probe_worker_pythons`): it asks each named
interpreter (a subprocess, no torch import) for its Python, fdl and torch versions; one that
does not run, lacks fdl or torch, or differs from the launcher's in Python (major.minor), fdl
or the torch *release* (the CUDA tag, ``+cu126`` against ``+cu128``, may differ: that is the
point) is a usage error naming the worker. What it found (:class:`WorkerPythons`) is plain
data: :func:`fdl.launch.spec.build_launch_spec` decides from it and the torch builds'
probe (fdl.launch.kernels) which backend averages: with workers under more than one
interpreter it is ``cpu`` (two wheels carry two NCCLs), unless the user set one or every GPU
worker's torch carries the same NCCL. Each worker's engine compares fdl and the torch release
again at the rendezvous (fdl.engine.agreement), as torch reports them at run time.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fdl import readback
from fdl.errors import UsageError

if TYPE_CHECKING:
    from fdl.launch.devices import DevicePlan

WORKER_PYTHON_ENV = "FDL_WORKER_PYTHON"  # {"<local rank>": "<interpreter>"}, JSON
EXECED_ENV = "FDL_WORKER_PYTHON_EXECED"  # set across the exec: never a second one
PROBE_TIMEOUT_S = 60.0
PROBE_QUIET_S = 5.0  # a probe that takes longer says what it waits for, and until when
# What a named interpreter reports, without importing torch (seconds on a CUDA wheel).
_PROBE = ("import json, sys\n"
          "from importlib.metadata import PackageNotFoundError, version\n"
          "try:\n"
          "    from fdl.version import __version__ as fdl\n"
          "except ImportError:\n"
          "    fdl = None\n"
          "try:\n"
          "    torch = version('torch')\n"
          "except PackageNotFoundError:\n"
          "    torch = None\n"
          "print(json.dumps({'python': '%d.%d' % sys.version_info[:2], 'fdl': fdl,"
          " 'torch': torch}))\n")


@dataclass(frozen=True)
class Interpreter:
    """A worker's interpreter and the versions it reported."""

    local_rank: int
    path: str
    python_version: str  # major.minor
    fdl: str
    torch: str

    def to_dict(self) -> dict[str, object]:
        return {"local_rank": self.local_rank, "path": self.path,
                "python_version": self.python_version, "fdl": self.fdl, "torch": self.torch}


@dataclass(frozen=True)
class WorkerPythons:
    """What :func:`probe_worker_pythons` found: the interpreters named for local workers, each
    as it reported itself, checked alike; the workers not named run under the launcher's."""

    origin: str = "--worker-python"  # what named them: "--worker-python" | "device map"
    named: tuple[Interpreter, ...] = ()  # by local rank; () = every worker under the launcher's

    def python_of(self, local_rank: int) -> str:
        """The interpreter local worker ``local_rank`` runs under."""
        return python_of(self.named, local_rank)

    def environments(self, nproc: int) -> int:
        """How many interpreters ``nproc`` local workers run under (the launcher's counts when
        a worker is not named)."""
        used = {i.path for i in self.named}
        if len(self.named) < nproc:
            used.add(os.path.abspath(sys.executable))
        return len(used)


def python_of(named: tuple[Interpreter, ...], local_rank: int) -> str:
    """The interpreter of local worker ``local_rank``: its named one, else the launcher's."""
    return next((i.path for i in named if i.local_rank == local_rank), sys.executable)


def probe_worker_pythons(worker_python: str | None, *, devices: DevicePlan, cwd: Path,
                         home: Path) -> WorkerPythons:
    """Each local worker's interpreter, when it is not the launcher's: ``worker_python`` (the
    ``--worker-python`` text), else (GPU workers) the device map under ``home``. Each named one
    is asked for its versions and they are checked alike (:func:`check_alike`); usage errors
    name the worker. Reads files and starts a process per named interpreter."""
    if worker_python:
        origin = "--worker-python"
        mapping = parse_worker_python(worker_python, nproc=devices.nproc, cwd=cwd)
    else:
        origin, mapping = "device map", from_device_map(devices, home=home)
    if not mapping:
        return WorkerPythons(origin)
    named = [probe_interpreter(rank, path, origin=origin) for rank, path in sorted(mapping.items())]
    check_alike(named, own=own_interpreter(), origin=origin, own_runs=len(mapping) < devices.nproc)
    return WorkerPythons(origin, tuple(named))


def parse_worker_python(text: str, *, nproc: int, cwd: Path) -> dict[int, str]:
    """``"1=/venv/bin/python,0=py"`` -> {local rank: absolute path}. Paths are made absolute
    but symlinks are kept (a venv's ``python`` is a link to its base: resolved, the venv would
    be lost)."""
    mapping: dict[int, str] = {}
    for item in (part.strip() for part in text.split(",")):
        rank_text, sep, path = item.partition("=")
        if not sep or not rank_text.strip().isdigit() or not path.strip():
            raise UsageError(f"--worker-python: {item!r} is not LOCAL_RANK=PATH",
                             hint="e.g. --worker-python 1=/home/me/.flodl/envs/cu126/bin/python")
        rank = int(rank_text)
        if rank >= nproc:
            raise UsageError(f"--worker-python names local rank {rank}, and this node runs "
                             f"{nproc} worker(s) (local ranks 0-{nproc - 1})",
                             hint="name a local rank below --nproc-per-node")
        if rank in mapping:
            raise UsageError(f"--worker-python names local rank {rank} twice",
                             hint="give each local rank one interpreter")
        full = os.path.abspath(cwd / os.path.expanduser(path.strip()))
        if not (os.path.isfile(full) and os.access(full, os.X_OK)):
            raise UsageError(f"--worker-python: {_named(full)} (local rank {rank}) is not an "
                             "executable file", hint="give the path of a python executable, "
                                                     "e.g. ENV/bin/python")
        mapping[rank] = full
    return mapping


DEVICE_MAP_MAX_BYTES = 1 << 20  # a map for hundreds of GPUs is a few KB


def from_device_map(devices: DevicePlan, *, home: Path) -> dict[int, str]:
    """{local rank: interpreter} for the GPU workers whose GPU ``$FLODL_HOME/envs/
    device-map.json`` (written by ``fdl setup``) names, by UUID or ``index:N``; {} without a
    map or GPU workers. The file is read as hostile: a regular file of bounded size holding an
    object of objects with a ``python`` string; anything else is one usage error naming it."""
    if devices.kind != "cuda":
        return {}
    path = home / "envs" / "device-map.json"
    if not path.exists():
        return {}
    problem, document = None, None
    try:
        document = readback.read_json(path, limit=DEVICE_MAP_MAX_BYTES)
    except readback.ReadBackError as exc:
        problem = exc.problem
    except OSError as exc:
        problem = f"unreadable ({exc.strerror or exc})"
    entries = document.get("devices") if isinstance(document, dict) else None
    if problem is None and not (isinstance(entries, dict) and all(
            isinstance(v, dict) and isinstance(v.get("python"), str) and v["python"]
            for v in entries.values())):
        problem = "not a map of GPUs to {\"python\": PATH}"
    if problem is not None:
        raise UsageError(f"device map {path}: {problem}",
                         hint="run fdl setup again to rewrite it, or remove it")
    assert isinstance(entries, dict)
    mapping = {}
    for rank, gpu in enumerate(devices.gpus):
        entry = entries.get(gpu.uuid or "") or entries.get(f"index:{gpu.index}")
        if entry is not None:
            mapping[rank] = entry["python"]
    return mapping


def probe_interpreter(local_rank: int, path: str, *,
                      origin: str = "--worker-python") -> Interpreter:
    """Ask ``path`` for its Python, fdl and torch versions (a usage error when it cannot)."""
    import subprocess  # here: every worker imports this module first (exec_if_named)

    try:
        code, out = _answer(subprocess.Popen(
            [path, "-c", _PROBE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=_clean_env(os.environ), start_new_session=True), local_rank=local_rank, path=path)
        report = json.loads(out.strip().splitlines()[-1]) if code == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        report = None
    if not isinstance(report, dict) or not all(isinstance(report.get(k), (str, type(None)))
                                               for k in ("python", "fdl", "torch")):
        raise UsageError(f"{origin}: {_named(path)} (local rank {local_rank}) does not run as "
                         "a Python interpreter", hint="give the path of a python executable")
    missing = [name for name in ("fdl", "torch") if not report.get(name)]
    if missing:
        raise UsageError(f"{origin}: {_named(path)} (local rank {local_rank}) has no "
                         f"{' and no '.join(missing)}",
                         hint=f"install them in that environment: {_named(path)} -m pip install "
                              "fdl torch==<this release>")
    return Interpreter(local_rank, path, str(report["python"]), str(report["fdl"]),
                       str(report["torch"]))


def _answer(child: Any, *, local_rank: int, path: str) -> tuple[int | None, str]:
    """The probe's exit code and output. A probe still running after :data:`PROBE_QUIET_S`
    says so in one line; one still running at :data:`PROBE_TIMEOUT_S` is killed with its whole
    session (a daemon it started, holding its output open, included) and answers None."""
    import contextlib
    import signal
    import subprocess

    try:
        try:
            out, _ = child.communicate(timeout=PROBE_QUIET_S)
        except subprocess.TimeoutExpired:
            from fdl import console

            console.info(f"fdl run: waiting for {_named(path)} (local rank {local_rank}) to say "
                         f"which Python, fdl and torch it runs (up to {PROBE_TIMEOUT_S:g} s)")
            out, _ = child.communicate(timeout=PROBE_TIMEOUT_S - PROBE_QUIET_S)
        return child.returncode, out
    except subprocess.TimeoutExpired:
        return None, ""
    finally:
        # its session, answered or not: nothing the probe started stays behind
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()


def check_alike(interpreters: list[Interpreter], *, own: Interpreter,
                origin: str = "--worker-python", own_runs: bool = True) -> None:
    """Every worker's interpreter runs the same Python (major.minor), fdl and torch release:
    the named ones against the launcher's when some worker runs under it (``own_runs``), else
    against the first named; one line naming the first that differs."""
    reference = own if own_runs else interpreters[0]
    for other in interpreters:
        for field, mine, theirs in (("Python", reference.python_version, other.python_version),
                                    ("fdl", reference.fdl, other.fdl),
                                    ("torch release", release(reference.torch),
                                     release(other.torch))):
            if mine != theirs:
                whose = "the launcher's workers" if own_runs else \
                    f"local rank {reference.local_rank}'s"
                raise UsageError(f"{origin}: local rank {other.local_rank} "
                                 f"({_named(other.path)}) has {field} {theirs}, {whose} {mine}",
                                 hint="every worker needs the same release (the CUDA tag "
                                      "may differ): install it in that environment")


def _named(path: str) -> str:
    """A path for an error line: a newline or other control character in it is shown escaped,
    so the line stays one line (fdl.console.shown)."""
    from fdl.console import shown

    return shown(path)


def release(version: str) -> str:
    """``2.9.1+cu126`` -> ``2.9.1``."""
    return version.split("+")[0]


def own_interpreter() -> Interpreter:
    """The launcher's own (the workers not named run under it)."""
    from importlib.metadata import PackageNotFoundError, version

    from fdl.version import __version__

    try:
        torch = version("torch")
    except PackageNotFoundError:
        torch = "none"
    python = f"{sys.version_info[0]}.{sys.version_info[1]}"
    return Interpreter(-1, sys.executable, python, __version__, torch)


def exec_if_named(env: Mapping[str, str], argv: list[str]) -> None:
    """In a worker, first thing: become the interpreter its local rank is given, running the
    same command (nothing when none is, or after that exec). Does not return when it execs."""
    raw, rank = env.get(WORKER_PYTHON_ENV), env.get("LOCAL_RANK", "")
    if not raw or env.get(EXECED_ENV) == "1":
        return
    try:
        target = json.loads(raw).get(rank)
    except (ValueError, AttributeError):
        target = None
    if not isinstance(target, str) or not target:
        return
    os.environ[EXECED_ENV] = "1"
    try:
        os.execv(target, [target, "-u", "-m", "fdl.launch.worker", *argv])
    except OSError as exc:
        sys.stderr.write(f"fdl worker: cannot start {target} for local rank {rank}: "
                         f"{exc.strerror or exc}\n")
        sys.stderr.flush()
        os._exit(1)


def _clean_env(env: Mapping[str, str]) -> dict[str, str]:
    """The launcher's environment without what would make another interpreter read this
    one's packages (PYTHONHOME; PYTHONPATH is the user's and stays)."""
    return {k: v for k, v in env.items() if k not in ("PYTHONHOME", "__PYVENV_LAUNCHER__")}
