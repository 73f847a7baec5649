"""The first thing each ``fdl run`` worker executes: run the user's script as ``python SCRIPT``.

The elastic agent starts ``python -u -m fdl.launch.worker SCRIPT ARGS...`` in every worker with
torchrun's environment. This module merges stderr into stdout (so ``logs/rank<r>.log`` holds
both, in order), then runs SCRIPT as ``__main__`` with ``sys.argv`` and ``sys.path[0]`` exactly
as ``python SCRIPT ARGS`` would set them. Exceptions and exit codes propagate unchanged, except
fdl's own errors: those end the worker with ``error:``/``hint:`` lines and their exit code.
Any other exception is first recorded for the launcher's root-cause block (the last frame of
the user's own code and the error's lines, :mod:`fdl.rundir.crash`), then propagates: Python
prints its traceback into the log as before.
``--module NAME`` runs a module as ``python -m NAME`` would (:func:`module_problem` lets the
launcher check first that it would be found).

Before the script runs, the worker

* ties its life to the launcher's. torch's agent starts workers in sessions of their own, so a
  launcher killed with SIGKILL (which gives it no chance to stop them) would leave them training
  as orphans. ``fdl run`` passes its pid in ``FDL_LAUNCHER_PID`` (fdl.launch.worker_env); on
  Linux the worker asks the kernel for a SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``)
  and exits at once if the launcher is already gone; elsewhere a watchdog thread polls its
  parent every second.
  PR_SET_PDEATHSIG fires when the *thread* that started the worker ends: torch's agent starts
  workers from the launcher's main thread, which lives as long as the launcher;
* hosts the workers' store on loopback. With a store per attempt
  (``TORCHELASTIC_USE_AGENT_STORE=False``: ``fdl run --max-restarts``) global rank 0's
  ``init_process_group`` creates the store at ``MASTER_ADDR:MASTER_PORT``, and torch's TCPStore
  listens on every interface whatever the address. When ``MASTER_ADDR`` is a loopback address,
  rank 0 starts that server first on a socket bound to it alone; the script's TCPStore is
  multi-tenant (as ``init_process_group`` makes it) and shares it.

After a script that ended well (it returned, or ``sys.exit(0)``), the worker collects what is
garbage then and freezes the rest (:func:`freeze_for_exit`): Python's teardown then frees what is
left by reference count without the full collections that walk every object torch and
torch._dynamo made at import, which were most of a worker's exit (docs/run.md "Launch latency"
has the figures). A script that raised, or exited with another code, exits as before: its
frames stay collectable.
"""

from __future__ import annotations

import gc
import os
import runpy
import sys
from typing import Any

from fdl.launch.interpreters import exec_if_named
from fdl.settings import LAUNCHER_PID_ENV, debugging

WATCHDOG_INTERVAL_S = 1.0
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_store: Any = None  # the store server this worker hosts for its script; lives as long as it


def main(argv: list[str]) -> None:
    global _store
    exec_if_named(os.environ, argv)  # --worker-python: this rank's own interpreter, at once
    os.dup2(sys.stdout.fileno(), sys.stderr.fileno())
    die_with_launcher(os.environ)
    _store = host_store_on_loopback(os.environ)
    try:
        _run(argv)
    except SystemExit as exc:
        if exc.code in (None, 0):
            exc.__traceback__ = None  # its frames hold the script's globals: free them first
            freeze_for_exit()
        raise
    except Exception as exc:
        _tell_peers(exc)
        _exit_on_fdl_error(exc)
        _exit_on_lost_peer(exc, argv)
        _record_crash(exc, argv)
        raise
    freeze_for_exit()


def freeze_for_exit() -> None:
    """Before a worker that is done exits: collect what is garbage now (the script's globals
    and whatever cycles its objects left: their finalizers run now, while every module they
    may use is still there), then move every object still alive to the collector's permanent
    generation (``gc.freeze``). The interpreter's teardown still runs the ``atexit`` handlers
    and frees what is left by reference count; what it skips is walking torch's import-time
    objects in its full collections."""
    gc.collect()
    gc.freeze()


def _tell_peers(exc: Exception) -> None:
    """Post this rank's root cause for the other ranks, on every node (fdl.engine.peers), unless
    it is itself a peer's failure; nothing for a script that never joined fdl's group."""
    peers = sys.modules.get("fdl.engine.peers")
    store = peers.kept_store() if peers is not None else None
    if store is None or peers.is_consequence(exc):
        return
    peers.tell_peers(store, peers.cause_of(exc), rank=int(os.environ.get("RANK", "0")))


def _exit_on_fdl_error(exc: Exception) -> None:
    """fdl's own errors raised in the worker (the engine's: no usable checkpoint to resume, a
    checkpoint that does not fit the model) end it as ``fdl`` ends: ``error:`` and ``hint:``
    lines and the error's exit code, which the root-cause block shows, instead of a traceback.
    Any other exception propagates unchanged (``FDL_DEBUG=1``: fdl's too)."""
    from fdl.errors import FdlError

    if not isinstance(exc, FdlError) or debugging():
        return
    sys.stderr.write(f"error: {exc.message}\n" + (f"hint: {exc.hint}\n" if exc.hint else ""))
    sys.stderr.flush()
    sys.exit(exc.exit_code)


class PeerLost(Exception):
    """A peer left the run or stopped answering (fdl.engine.peers.stopped_by_peer says so)."""


def _exit_on_lost_peer(exc: Exception, argv: list[str]) -> None:
    """A collective that failed because a peer left (another node killed or crashed) or never
    came (the group's timeout): one line naming the peer and, when a peer posted one, its
    error (fdl.engine.peers), and exit 1, instead of gloo's message and a traceback through
    the training loop. ``FDL_DEBUG=1`` keeps the traceback."""
    peers = sys.modules.get("fdl.engine.peers")
    if debugging() or peers is None:
        return
    line = peers.stopped_by_peer(exc)
    if line is None:
        return
    store = peers.kept_store()
    failed = None if store is None else peers.cause_within(
        store, rank=int(os.environ.get("RANK", "0")),
        world_size=int(os.environ.get("WORLD_SIZE", "1")))
    if failed is not None:
        line = peers.failed_line(*failed)
    # Recorded (with the collective's frames) so that the root-cause block still blames the
    # rank that crashed first, when one did, and shows this line when none did.
    _record_crash(PeerLost(line).with_traceback(exc.__traceback__), argv)
    sys.stderr.write(f"error: {line}\nhint: {peers.STOPPED_WITH_IT}\n")
    sys.stderr.flush()
    sys.exit(1)


def _record_crash(exc: Exception, argv: list[str]) -> None:
    """Leave ``logs/rank<r>.crash.json`` for fdl run's root-cause block (nothing without
    fdl run's run directory). Never in the way of the exception itself."""
    from fdl.settings import RUN_DIR_ENV

    run_dir, rank = os.environ.get(RUN_DIR_ENV), os.environ.get("RANK")
    if not run_dir or rank is None:
        return
    import time
    from pathlib import Path

    from fdl.rundir.crash import describe_crash, write_crash
    from fdl.rundir.layout import logs_dir

    home = Path.cwd() if argv[:1] == ["--module"] else Path(argv[0]).resolve().parent
    try:
        crash = describe_crash(exc, home=home, pid=os.getpid(), t=time.time())
        write_crash(logs_dir(Path(run_dir)), rank, crash)
    except (OSError, ValueError):
        pass  # the traceback in the log is still there


def _run(argv: list[str]) -> None:
    if argv[:1] == ["--module"]:
        sys.argv = argv[1:]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


def die_with_launcher(env: dict[str, str] | Any) -> None:
    """Make this process die with the launcher whose pid ``env`` names (nothing without one):
    torch's agent starts workers itself, with ``sys.executable``, so the launcher is our
    parent."""
    raw = env.get(LAUNCHER_PID_ENV, "")
    if not raw.isdigit():
        return
    launcher = int(raw)
    if not _kill_me_when_parent_dies():
        import threading

        threading.Thread(target=_watch_parent, args=(launcher,), name="fdl-launcher-watchdog",
                         daemon=True).start()
    if os.getppid() != launcher:  # it died before the kernel was asked: nobody would stop us
        _launcher_gone(launcher)


def _kill_me_when_parent_dies() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(launcher: int) -> None:
    import time

    while os.getppid() == launcher:
        time.sleep(WATCHDOG_INTERVAL_S)
    _launcher_gone(launcher)


def _launcher_gone(launcher: int) -> None:
    sys.stderr.write(f"fdl worker: its launcher (pid {launcher}) is gone; stopping\n")
    sys.stderr.flush()
    os._exit(1)


def host_store_on_loopback(env: dict[str, str] | Any) -> Any:
    """Global rank 0's store server on ``MASTER_ADDR`` only, when the workers have a store of
    their own and that address is loopback (see the module docstring); None otherwise, or when
    the port cannot be bound (the script's init_process_group then fails as it would have)."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "False" or env.get("RANK") != "0":
        return None
    addr, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
    if not (_is_loopback(addr) and port.isdigit()):
        return None
    import socket

    sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, int(port)))
        sock.listen(128)
    except OSError:
        sock.close()
        return None
    from torch.distributed import TCPStore

    return TCPStore(addr, int(port), is_master=True, multi_tenant=True, wait_for_workers=False,
                    master_listen_fd=sock.detach())


def _is_loopback(addr: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def module_problem(name: str, *, search_path: list[str]) -> str | None:
    """Why ``python -m NAME`` with ``search_path`` as ``sys.path`` would not find NAME (or, for
    a package, ``NAME.__main__``); None when it would. The import system's finders are asked,
    in order, as the import would ask them (editable installs included), but no code of NAME's
    packages runs; where a package's ``__init__`` computes its own ``__path__`` the answer is
    None (only running it could tell)."""
    if not all(part.isidentifier() for part in name.split(".")):
        return f"{name!r} is not a module name"
    try:
        return _module_problem(name, search_path)
    except (ImportError, KeyError, AttributeError, ValueError, OSError):
        return None  # a finder that needs the parent imported (nested namespace packages)


def _module_problem(name: str, search_path: list[str]) -> str | None:
    parts = name.split(".")
    spec = _find_spec(parts[0], None, search_path)
    for depth in range(1, len(parts)):
        if spec is None or spec.submodule_search_locations is None:
            spec = None
            break
        parent, locations = spec, _locations(spec)
        if locations is None:
            return None
        spec = _find_spec(".".join(parts[:depth + 1]), locations, search_path)
        if spec is None and _computes_path(parent):
            return None
    if spec is None:
        return f"no module named {name!r} in {search_path[0]} or this Python's path"
    locations = _locations(spec)
    if locations is not None and not _computes_path(spec) and _find_spec(
            f"{name}.__main__", locations, search_path) is None:
        return f"{name!r} is a package without a {name}.__main__ module to run"
    return None


def _locations(spec: Any) -> list[str] | None:
    """A package's ``__path__`` as a list (None: not a package)."""
    found = spec.submodule_search_locations
    if found is None:
        return None
    return list(found)


def _find_spec(fullname: str, path: list[str] | None, search_path: list[str]) -> Any:
    """The spec the first of ``sys.meta_path``'s finders gives, with ``search_path`` as
    ``sys.path`` for the path finder."""
    from importlib.machinery import PathFinder

    for finder in sys.meta_path:
        if finder is PathFinder:
            spec = PathFinder.find_spec(fullname, search_path if path is None else path)
        elif hasattr(finder, "find_spec"):
            spec = finder.find_spec(fullname, path)
        else:
            continue
        if spec is not None:
            return spec
    return None


def _computes_path(spec: Any) -> bool:
    """A package whose ``__init__`` may extend ``__path__`` (pkgutil / pkg_resources style)."""
    if not spec.origin or not os.path.isfile(spec.origin):
        return False
    try:
        with open(spec.origin, encoding="utf-8", errors="replace") as handle:
            text = handle.read()
    except OSError:
        return False
    return "__path__" in text or "declare_namespace" in text


if __name__ == "__main__":
    main(sys.argv[1:])
