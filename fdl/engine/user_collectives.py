"""One error, not a hang, when the script's own code calls a collective where the ranks' calls
cannot pair up: in a step under cadence and async (the ranks take different numbers of steps
between averages) or in sync's round that ends an epoch cut unevenly over the ranks, and in an
evaluation's function (each rank evaluates a shard of its own size, under every policy). Such
a call waits for one that another rank never makes, and the run would sit silent until killed
(a loop that all-reduces its loss for logging, as torchrun scripts do, is the common case).

While :func:`refused` holds, torch.distributed's functions that wait for other ranks
(:data:`WAITING`) are replaced, as attributes of the ``torch.distributed`` package, by guards
that look at who called them, past torch's own frames (a helper such as
``torch.distributed.nn``'s calls on somebody's behalf): fdl's calls (the averages, the
evaluation's sums) and those of fdl's DDP (its join, called from the script's forward) go
through; any other raises :class:`~fdl.errors.UsageError` naming the function and that
caller's file and line, while a reason is active. The script's own modules bound such a
function by name too (``from torch.distributed import all_reduce``): in ``__main__`` and every
module loaded from outside the interpreter's installed paths (the standard library,
site-packages), such a name is a guard as well. Installed packages' names and torch's module
``distributed_c10d`` are left as they are. The originals are put back when the last
:func:`refused` ends, wherever nothing else replaced them meanwhile."""

from __future__ import annotations

import contextlib
import functools
import sys
import sysconfig
import types
from collections.abc import Callable, Iterator
from typing import Any

from fdl.errors import UsageError

#: torch.distributed's functions that wait for other ranks (absent ones are skipped)
WAITING = ("all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce",
           "all_to_all", "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast",
           "broadcast_object_list", "gather", "gather_object", "irecv", "isend",
           "monitored_barrier", "recv", "reduce", "reduce_scatter", "reduce_scatter_tensor",
           "scatter", "scatter_object_list", "send")

#: torch's modules whose collectives are DDP's, which only fdl's wrapper runs (a model the
#: script wrapped itself is refused before any step): its join in sync's unevenly cut round
#: all-reduces from the script's forward
DDPS_OWN = ("torch.nn.parallel.", "torch.distributed.algorithms.join")

#: what each :func:`refused` now holding refuses for (None: nothing, at the moment)
_reasons: list[Callable[[], str | None]] = []
_installed: dict[str, tuple[Any, Any]] = {}  # name: (torch's function, its guard)
#: (a script module's namespace, the name it bound, torch's function, its guard)
_rebound: list[tuple[dict[str, Any], str, Any, Any]] = []


@contextlib.contextmanager
def refused(reason: Callable[[], str | None]) -> Iterator[None]:
    """While the body runs, a collective whose caller (past torch's own frames) is not fdl
    raises UsageError whenever ``reason()`` says why it cannot pair up (None: it may, at that
    moment)."""
    if not _reasons:
        _install()
    _reasons.append(reason)
    try:
        yield
    finally:
        _reasons.remove(reason)
        if not _reasons:
            _uninstall()


def _install() -> None:
    import torch.distributed as dist

    for name in WAITING:
        original = getattr(dist, name, None)
        if callable(original):
            guard = _guard(name, original)
            setattr(dist, name, guard)
            _installed[name] = (original, guard)
    guards = {id(original): guard for original, guard in _installed.values()}
    for namespace in _script_namespaces():
        for name, value in list(namespace.items()):
            guard = guards.get(id(value))
            if guard is not None and value is guard.__wrapped__:
                namespace[name] = guard
                _rebound.append((namespace, name, value, guard))


def _uninstall() -> None:
    import torch.distributed as dist

    for name, (original, guard) in _installed.items():
        if getattr(dist, name, None) is guard:
            setattr(dist, name, original)
    _installed.clear()
    for namespace, name, original, guard in _rebound:
        if namespace.get(name) is guard:
            namespace[name] = original
    _rebound.clear()


def _script_namespaces() -> Iterator[dict[str, Any]]:
    """The namespaces of the script's own modules: ``__main__`` and the modules loaded from a
    file outside the interpreter's installed paths (its standard library, site-packages), but
    torch's and fdl's. Installing the guards looks at every module a worker holds, over a
    thousand once torch and fdl are imported, at a cost docs/elche.md gives ("Measurements
    behind the engine's choices")."""
    installed = tuple(path + "/" for path in {
        sysconfig.get_path(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")})
    for name, module in list(sys.modules.items()):
        if not isinstance(module, types.ModuleType) or name.split(".", 1)[0] in ("torch", "fdl"):
            continue
        namespace = object.__getattribute__(module, "__dict__")  # a lazy module stays unloaded
        where = namespace.get("__file__")
        if name == "__main__" or (isinstance(where, str) and not where.startswith(installed)):
            yield namespace


def _guard(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1)
        while caller.f_back is not None and _package(caller) == "torch":
            if _module(caller).startswith(DDPS_OWN):
                return original(*args, **kwargs)  # fdl's DDP (a script's own is refused)
            caller = caller.f_back  # torch's helper (torch.distributed.nn): whose call is it?
        if _package(caller) != "fdl":
            why = next(filter(None, (reason() for reason in reversed(_reasons))), None)
            if why is not None:
                raise UsageError(
                    f"torch.distributed.{name} called at {caller.f_code.co_filename}:"
                    f"{caller.f_lineno} while {why}: it would wait for a call another rank "
                    f"never makes, and the run would hang there",
                    hint="log a step's values with run.log(...) and evaluate with "
                         "run.evaluate(...) (fdl combines the ranks' values); collectives "
                         "before run.batches(...) and after run.finish() are fine")
        return original(*args, **kwargs)

    return guarded


def _module(frame: Any) -> str:
    """The module whose code ``frame`` runs."""
    return str(frame.f_globals.get("__name__", ""))


def _package(frame: Any) -> str:
    """The top-level package of the module whose code ``frame`` runs."""
    return _module(frame).split(".", 1)[0]
