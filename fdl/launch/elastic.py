"""Run a :class:`LaunchSpec` on torch.distributed.elastic — torchrun's own agent, not a
home-made process manager.

Each worker is ``python -u -m fdl.launch.worker SCRIPT ARGS`` with exactly torchrun's
environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE,
ROLE_RANK, ROLE_NAME, ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_*) plus the
spec's additions (FDL_*, OMP_NUM_THREADS set to the worker's share of the cores, and on GPU
hosts CUDA_DEVICE_ORDER / CUDA_VISIBLE_DEVICES).

Failure: when a worker exits non-zero or is killed, the agent stops the others (SIGTERM, then
SIGKILL after ``SHUTDOWN_TIMEOUT_S``), restarts the group while ``max_restarts`` allows, and
otherwise :func:`launch` returns the failing worker's exit code (``128 + signal`` for a killed
one) with a :class:`RootCause`: rank, exit code or signal, and the last lines of its log.
Ctrl-C stops everything and returns 130.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fdl.errors import MissingTorchError, UsageError
from fdl.launch.rundir import tail_lines
from fdl.launch.spec import LaunchSpec

SHUTDOWN_TIMEOUT_S = 5
LOG_TAIL_LINES = 20


@dataclass(frozen=True)
class RootCause:
    rank: int
    local_rank: int
    exit_code: int
    signal: str | None
    log: Path
    tail: tuple[str, ...]


@dataclass(frozen=True)
class LaunchResult:
    exit_code: int
    root_cause: RootCause | None = None
    interrupted: bool = False


def preflight(spec: LaunchSpec) -> None:
    """Checks that need the outside world; each failure is a usage error, nothing started."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise MissingTorchError("fdl run")
    rdzv = spec.rendezvous
    if rdzv.backend == "static" and rdzv.max_nodes == 1:
        host, _, port = rdzv.endpoint.rpartition(":")
        if not port_is_free(host, int(port)):
            raise UsageError(f"--master-port {port} is already in use on {host}",
                             hint="pick another port, or leave it out for a free one")


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def launch(spec: LaunchSpec) -> LaunchResult:
    """Run the workers to completion. Blocks; returns the exit code ``fdl run`` should use."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import launch_agent

    if not os.environ.get("FDL_DEBUG"):
        logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    logs_dir = spec.run_dir / "logs"
    args = ["-u", "-m", "fdl.launch.worker", *(["--module"] if spec.module else []),
            str(spec.script), *spec.script_args]
    with _environ({**_agent_env(spec), **spec.env}):
        try:
            launch_agent(_launch_config(spec, logs_dir), sys.executable, args)
        except ChildFailedError as exc:
            return _failed(exc, logs_dir)
        except SignalException as exc:
            return LaunchResult(128 + int(exc.sigval), interrupted=True)
        except KeyboardInterrupt:
            return LaunchResult(130, interrupted=True)
    return LaunchResult(0)


def _agent_env(spec: LaunchSpec) -> dict[str, str]:
    """With restarts, the workers of each attempt get a store of their own. torch's c10d
    rendezvous otherwise hands every attempt the agent's one shared store without a per-attempt
    prefix, and a restarted worker can read the previous attempt's addresses and fail to
    connect (pytorch/pytorch#135712, #167288: "Connection refused" in gloo or NCCL init)."""
    if spec.max_restarts > 0 and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ:
        return {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return {}


def _launch_config(spec: LaunchSpec, logs_dir: Path) -> Any:
    from torch.distributed.launcher.api import LaunchConfig

    rdzv = spec.rendezvous
    configs: dict[str, Any] = {"timeout": 900}
    if rdzv.node_rank is not None:
        configs["rank"] = rdzv.node_rank
    return LaunchConfig(
        min_nodes=rdzv.min_nodes, max_nodes=rdzv.max_nodes, nproc_per_node=spec.nproc_per_node,
        logs_specs=run_logs_specs(logs_dir, quiet=spec.quiet_ranks), run_id=rdzv.run_id,
        role="default", rdzv_endpoint=rdzv.endpoint, rdzv_backend=rdzv.backend,
        rdzv_configs=configs, max_restarts=spec.max_restarts, monitor_interval=0.1,
        start_method="spawn", log_line_prefix_template="[rank ${rank}] ",
        local_addr=rdzv.local_addr, shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )


def run_logs_specs(logs_dir: Path, *, quiet: bool) -> Any:
    """torch's LogsSpecs for fdl's layout: ``logs/rank<r>.log`` per global rank, teed to the
    terminal (rank 0 only when ``quiet``); a restarted attempt keeps the previous log."""
    from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

    class RunLogsSpecs(LogsSpecs):
        def __init__(self) -> None:
            super().__init__(log_dir=str(logs_dir))

        @property
        def root_log_dir(self) -> str:
            return str(logs_dir)

        def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
            logs_dir.mkdir(parents=True, exist_ok=True)
            dest = LogsDest()
            for local_rank, env in envs.items():
                rank = env["RANK"]
                path = logs_dir / f"rank{rank}.log"
                attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
                if attempt and path.exists():
                    path.replace(logs_dir / f"rank{rank}.attempt{attempt - 1}.log")
                dest.stdouts[local_rank] = str(path)
                dest.stderrs[local_rank] = ""  # the worker merges stderr into stdout
                if not quiet or rank == "0":
                    dest.tee_stdouts[local_rank] = str(path)
                error_file = str(logs_dir / f".rank{rank}.error.json")
                dest.error_files[local_rank] = error_file
                env["TORCHELASTIC_ERROR_FILE"] = error_file  # as torchrun gives it (for @record)
            return dest

    return RunLogsSpecs()


def _failed(exc: Any, logs_dir: Path) -> LaunchResult:
    rank, failure = exc.get_first_failure()
    code = failure.exitcode
    signame = None
    if code < 0:
        try:
            signame = signal.Signals(-code).name
        except ValueError:
            signame = f"signal {-code}"
        code = 128 - code
    log = logs_dir / f"rank{rank}.log"
    cause = RootCause(rank, failure.local_rank, code, signame, log,
                      tuple(tail_lines(log, LOG_TAIL_LINES)))
    return LaunchResult(code or 1, cause)


@contextmanager
def _environ(extra: Mapping[str, str]) -> Iterator[None]:
    """The agent copies os.environ into every worker: add ``extra`` for the run's duration."""
    saved = {key: os.environ.get(key) for key in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
