"""Run a :class:`LaunchSpec` on torch.distributed.elastic — torchrun's own agent, not a
home-made process manager.

Each worker is ``python -u -m fdl.launch.worker SCRIPT ARGS`` with torchrun's environment
(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK,
ROLE_NAME, ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_*) plus what fdl adds, all
of it made by :mod:`fdl.launch.worker_env`, which lists it and says why: the spec's ``env``,
set in the launcher's environment for the run's duration since the agent copies that into
every worker (the agent itself reads TORCH_DISABLE_SHARE_RDZV_TCP_STORE from there), and the
variables of a worker's global rank (TORCHELASTIC_ERROR_FILE), which fdl's logs layout
(:func:`run_logs_specs`) adds as each attempt's workers start, since only the rendezvous
assigns the ranks.

Before anything is written or started, :func:`preflight` checks what needs the outside world
(torch, the ``-m`` module, the rendezvous host) and, for a one-node run, binds the rendezvous
port to its address alone (127.0.0.1, or --master-addr). torch's TCPStore listens on every
interface whatever address it is given; fdl serves torch's stores on sockets it binds itself
(:func:`_local_store`, :data:`LOOPBACK_C10D`). Runs across nodes keep torch's binding: the
other nodes must reach the store.

Failure: when a worker exits non-zero or is killed, the agent stops the others (SIGTERM, then
SIGKILL after ``SHUTDOWN_TIMEOUT_S``), restarts the group while ``max_restarts`` allows, and
otherwise :func:`launch` returns the failing worker's exit code (``128 + signal`` for a killed
one) with a :class:`RootCause`: rank, exit code or signal, what the worker recorded of the
exception that ended it (:mod:`fdl.rundir.crash`: the last frame of the user's code and the
error), else the last lines of its log. Of several ranks that raised, the root cause is the one
that raised first (torch orders failures by the second they were noticed, so a rank that died
of a peer's crash in the same poll could be named instead).
Ctrl-C (or SIGTERM) stops everything and returns 130 (``128 + N``). While the workers run, what
reaches the terminal is decided in :mod:`fdl.launch.terminal`: their output until a stop
signal, none of torch's own log lines (``logs/agent.log`` keeps them).
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import sys
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fdl.errors import MissingTorchError, UsageError
from fdl.files import open_for_writing
from fdl.launch.rendezvous import (
    Rendezvous,
    bind_listener,
    join_endpoint,
    lookup_host,
    parse_endpoint,
)
from fdl.launch.spec import LaunchSpec
from fdl.launch.startup import torch_import_without_collections
from fdl.launch.terminal import terminal_for_workers
from fdl.launch.worker_env import ERROR_FILE_ENV, build_rank_env
from fdl.rundir import layout as run_layout
from fdl.rundir.crash import Crash, read_crash

SHUTDOWN_TIMEOUT_S = 5
LOG_TAIL_LINES = 20
JOIN_TIMEOUT_S = 900  # how long a node waits for the others at the rendezvous
# torch's c10d rendezvous, with the workers' store on the node's address only (one-node runs).
LOOPBACK_C10D = "fdl-loopback-c10d"


@dataclass(frozen=True)
class RootCause:
    rank: int
    local_rank: int
    exit_code: int
    signal: str | None
    log: Path
    tail: tuple[str, ...]
    crash: Crash | None = None  # what the worker recorded of the exception that ended it


@dataclass(frozen=True)
class LaunchResult:
    exit_code: int
    root_cause: RootCause | None = None
    interrupted: bool = False
    stop_signal: str | None = None  # what interrupted it: SIGINT (Ctrl-C), SIGTERM ...


def preflight(spec: LaunchSpec) -> socket.socket | None:
    """Checks that need the outside world, before anything is written or started; each failure
    is a usage error. Returns the listening socket of a one-node rendezvous (None otherwise):
    bound here to the rendezvous address only, and held until the store serves on it, so no
    other process can take the port in between."""
    from fdl.engine.tensorboard import INSTALL_HINT
    from fdl.launch.worker import module_problem

    if not _installed("torch"):
        raise MissingTorchError("fdl run")
    tensorboard = spec.settings.get("tensorboard")
    if tensorboard is not None and tensorboard.value is not None and \
            not _installed("tensorboard"):
        raise UsageError("--tensorboard needs the tensorboard package, which is not installed",
                         hint=INSTALL_HINT)
    if spec.run_dir_use == "resume" and spec.rendezvous.max_nodes == 1:
        # several nodes: rank 0's node holds the checkpoints (fdl.engine.recovery); the others
        # learn which one from it, and every node stops alike when it has none
        from fdl.launch.resume import check_resumable

        check_resumable(spec.run_dir)
    if spec.module:
        problem = module_problem(str(spec.script), search_path=[os.getcwd(), *sys.path[1:]])
        if problem:
            raise UsageError(problem, hint="fdl run -m NAME runs NAME as `python -m NAME` would, "
                                           "in this directory with this Python")
    rdzv = spec.rendezvous
    host, port = parse_endpoint(rdzv.endpoint, flag="--rdzv-endpoint", default_port=0,
                                min_port=0)
    address = lookup_host(host, port)
    return bind_listener(address, host=host) if rdzv.binds_locally else None


def _installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken install is not an installed one
        return False


def launch(spec: LaunchSpec, *, listener: socket.socket | None = None,
           node: str | None = None,
           on_workers: Callable[[], None] | None = None) -> LaunchResult:
    """Run the workers to completion. Blocks; returns the exit code ``fdl run`` should use.
    ``listener``: :func:`preflight`'s socket for a one-node rendezvous; ``node``: this node's
    address when it joined another node's run directory (its agent log is then its own);
    ``on_workers``: called as each attempt's workers are about to start (the rendezvous done),
    on the launcher's thread: it must return at once."""
    with torch_import_without_collections():
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import launch_agent

    logs_dir = run_layout.logs_dir(spec.run_dir)
    args = ["-u", "-m", "fdl.launch.worker", *(["--module"] if spec.module else []),
            str(spec.script), *spec.script_args]
    with _environ(spec.env), _local_store(spec.rendezvous, listener) as (backend, endpoint), \
            terminal_for_workers(run_layout.agent_log_path(logs_dir, node=node)):
        try:
            launch_agent(_launch_config(spec, logs_dir, backend=backend, endpoint=endpoint,
                                        on_workers=on_workers),
                         sys.executable, args)
        except ChildFailedError as exc:
            return _failed(exc, logs_dir)
        except SignalException as exc:
            return LaunchResult(128 + int(exc.sigval), interrupted=True,
                                stop_signal=signal.Signals(exc.sigval).name)
        except KeyboardInterrupt:
            return LaunchResult(130, interrupted=True, stop_signal="SIGINT")
    return LaunchResult(0)


@contextmanager
def _local_store(rdzv: Rendezvous, listener: socket.socket | None) -> Iterator[tuple[str, str]]:
    """The rendezvous backend and endpoint to give torch's agent. With a ``listener`` (one
    node), first start the rendezvous's TCPStore server on it: torch's own TCPStore listens on
    every interface whatever address it is given. torch's stores are multi-tenant, so the
    agent's TCPStore for this port shares this server; the store the agent creates for the
    workers goes through :data:`LOOPBACK_C10D`, which binds the same way."""
    if listener is None:
        yield rdzv.backend, rdzv.endpoint
        return
    host = rdzv.local_addr or "127.0.0.1"
    port = listener.getsockname()[1]
    server = serve_store(listener, host=host)
    if rdzv.backend == "c10d":
        _register_loopback_c10d()
    try:
        yield LOOPBACK_C10D if rdzv.backend == "c10d" else rdzv.backend, join_endpoint(host, port)
    finally:
        del server


def serve_store(listener: socket.socket, *, host: str) -> Any:
    """A TCPStore server (multi-tenant) listening on ``listener``, which it takes over."""
    from torch.distributed import TCPStore

    port = listener.getsockname()[1]
    return TCPStore(host, port, is_master=True, multi_tenant=True, wait_for_workers=False,
                    master_listen_fd=listener.detach())


def _register_loopback_c10d() -> None:
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(LOOPBACK_C10D, _create_loopback_handler)


def _create_loopback_handler(params: Any) -> Any:
    """torch's c10d handler for ``params``, on the store :func:`_local_store` serves."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend

    c10d = RendezvousParameters("c10d", params.endpoint, params.run_id, params.min_nodes,
                                params.max_nodes, params.local_addr, **params.config)
    backend, store = create_backend(c10d)
    return _loopback_handler_class().from_backend(params.run_id, store, backend,
                                                  params.min_nodes, params.max_nodes,
                                                  params.local_addr)


@functools.cache
def _loopback_handler_class() -> type:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    class LoopbackRendezvousHandler(DynamicRendezvousHandler):
        """torch's c10d handler, except that the store it shares with the workers
        (TORCHELASTIC_USE_AGENT_STORE) listens on the node's address only. A security property,
        not a speed-up: torch's own store listens on every interface whatever address it is
        given, and a TCPStore has no authentication: anyone on the network who reaches it can
        read and write its keys, where the workers' process group meets. Overriding torch's
        ``_create_tcp_store_server`` is the one way to bind it; if a torch release drops that
        method, the store goes back to torch's binding, and tests/faults/test_launch_faults.py
        (the loopback-only test) fails."""

        def get_backend(self) -> str:
            return LOOPBACK_C10D

        def _create_tcp_store_server(self, master_addr: str, master_port: int) -> Any:
            address = lookup_host(master_addr, master_port)
            return serve_store(bind_listener(address, host=master_addr), host=master_addr)

    return LoopbackRendezvousHandler


def _launch_config(spec: LaunchSpec, logs_dir: Path, *, backend: str, endpoint: str,
                   on_workers: Callable[[], None] | None = None) -> Any:
    from torch.distributed.launcher.api import LaunchConfig

    rdzv = spec.rendezvous
    configs: dict[str, Any] = {"timeout": JOIN_TIMEOUT_S}
    if rdzv.node_rank is not None:
        configs["rank"] = rdzv.node_rank
    network = spec.network
    if network is not None and rdzv.backend == "c10d" and network.hosts_rendezvous is not None:
        # torch's documented c10d setting; its own guess compares host names, and a host name
        # that resolves to loopback made no node the host (fdl.launch.network)
        configs["is_host"] = network.hosts_rendezvous
    optional = {"shutdown_timeout": SHUTDOWN_TIMEOUT_S}
    return LaunchConfig(
        min_nodes=rdzv.min_nodes, max_nodes=rdzv.max_nodes, nproc_per_node=spec.nproc_per_node,
        logs_specs=run_logs_specs(logs_dir, quiet=spec.quiet_ranks, on_workers=on_workers),
        run_id=rdzv.run_id,
        role="default", rdzv_endpoint=endpoint, rdzv_backend=backend,
        rdzv_configs=configs, max_restarts=spec.max_restarts, monitor_interval=0.1,
        start_method="spawn", log_line_prefix_template="[rank ${rank}] ",
        local_addr=network.local_addr if network is not None and network.several_nodes
        else rdzv.local_addr,
        **supported_fields(LaunchConfig, optional),
    )


def supported_fields(config_class: type, fields: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``fields`` that ``config_class`` (a dataclass) has. torch 2.13's
    LaunchConfig takes ``shutdown_timeout``, 2.11's does not (seen on a GPU host): an older
    torch keeps its own shutdown timeout instead of failing every launch on the keyword."""
    import dataclasses

    known = {field.name for field in dataclasses.fields(config_class)}
    return {name: value for name, value in fields.items() if name in known}


def run_logs_specs(logs_dir: Path, *, quiet: bool,
                   on_workers: Callable[[], None] | None = None) -> Any:
    """torch's LogsSpecs for fdl's layout: ``logs/rank<r>.log`` per global rank, teed to the
    terminal (rank 0 only when ``quiet``); a restarted attempt keeps the previous log; each
    worker's error file and its variable (:func:`fdl.launch.worker_env.build_rank_env`), as
    torch's default LogsSpecs gives them. The agent asks for them as an attempt's workers are
    about to start, their ranks known: ``on_workers`` is called then."""
    from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

    class RunLogsSpecs(LogsSpecs):
        def __init__(self) -> None:
            super().__init__(log_dir=str(logs_dir))
            self._held: list[Any] = []  # this attempt's logs, open while torch opens them

        @property
        def root_log_dir(self) -> str:
            return str(logs_dir)

        def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
            logs_dir.mkdir(parents=True, exist_ok=True)
            for handle in self._held:  # the last attempt's: torch opened its own long since
                handle.close()
            self._held.clear()
            dest = LogsDest()
            for local_rank, env in envs.items():
                rank = env["RANK"]
                path = run_layout.log_path(logs_dir, rank)
                attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
                if attempt and path.exists():
                    path.replace(run_layout.log_path(logs_dir, rank, attempt=attempt - 1))
                # made here, never through a link planted there, and handed to torch as this
                # process's descriptor of it: a link swapped in after the check is not followed
                handle = open_for_writing(path)
                self._held.append(handle)
                name = held_name(handle, path)
                dest.stdouts[local_rank] = name
                dest.stderrs[local_rank] = ""  # the worker merges stderr into stdout
                if not quiet or rank == "0":
                    dest.tee_stdouts[local_rank] = name
                added = build_rank_env(logs_dir, rank=rank)  # in place of torch's layout's
                env.update(added)
                dest.error_files[local_rank] = added[ERROR_FILE_ENV]
            if on_workers is not None:
                on_workers()
            return dest

    return RunLogsSpecs()


def held_name(handle: Any, path: Path) -> str:
    """A name that opens the very file ``handle`` has open, whatever ``path`` holds by then:
    ``/proc/self/fd/N`` (the launcher opens the workers' logs in its own process: torch's
    subprocess handler and its tee threads). Where there is no /proc, ``path`` itself."""
    name = f"/proc/self/fd/{handle.fileno()}"
    return name if os.path.exists(name) else str(path)


def _failed(exc: Any, logs_dir: Path) -> LaunchResult:
    first, _ = exc.get_first_failure()
    crashes = {rank: read_crash(logs_dir, rank, pid=failure.pid)
               for rank, failure in exc.failures.items()}
    stopped = {rank for rank, failure in exc.failures.items()
               if failure.exitcode == -signal.SIGTERM}
    rank = root_rank(first, crashes, stopped=stopped)
    failure = exc.failures[rank]
    code = failure.exitcode
    signame = None
    if code < 0:
        try:
            signame = signal.Signals(-code).name
        except ValueError:
            signame = f"signal {-code}"
        code = 128 - code
    log = run_layout.log_path(logs_dir, rank)
    cause = RootCause(rank, failure.local_rank, code, signame, log,
                      tuple(run_layout.tail_lines(log, LOG_TAIL_LINES)), crashes[rank])
    return LaunchResult(code or 1, cause)


def root_rank(first: int, crashes: Mapping[int, Crash | None], *,
              stopped: Collection[int] = ()) -> int:
    """The rank to blame: torch's ``first`` failure, unless it raised (it has a crash record)
    and another rank raised earlier, or it ended on SIGTERM (``stopped``: the signal the agent
    stops the other workers with once one failed) while another rank raised. A rank that was
    killed otherwise or exited leaves no record, and torch's order is all there is to go on."""
    recorded = {rank: crash for rank, crash in crashes.items() if crash is not None}
    if first not in recorded and (first not in stopped or not recorded):
        return first
    return min(recorded, key=lambda rank: (recorded[rank].t, rank))


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
