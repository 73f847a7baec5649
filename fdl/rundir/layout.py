"""The run directory of ``fdl run``: checked, then created before workers start, ``config.json``
first.

``runs/<UTC time>-<script stem>-<policy>/`` (or ``--run-dir``) holds ``config.json`` (every
setting with its value and source, the launch spec), ``logs/rank<r>.log`` (each worker's stdout
and stderr; an earlier attempt's log is kept as ``rank<r>.attempt<k>.log`` on restart),
``logs/rank<r>.crash.json`` (what ended a worker that raised, fdl.rundir.crash),
``logs/agent.log`` (torch's agent's own log lines), and
what the engine writes (metrics, timeline, summary.json, model.pt, checkpoints).

One directory holds one run. A new run needs a directory that does not exist or is empty;
``--resume`` continues the run a directory holds; ``--overwrite-run-dir`` replaces it, but only
a directory that holds nothing but what ``fdl run`` writes (:data:`RUN_ENTRIES`): a typo such as
``--run-dir ~`` never deletes anything.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from fdl.errors import UsageError
from fdl.rundir import checkpoints, config, metrics, model, progress, summary, timeline

LOGS = "logs"
AGENT_LOG = "agent.log"  # in logs/: torch's agent's own log lines
TENSORBOARD = "tensorboard"  # the default directory of --tensorboard
# What fdl run and the engine write at the top of a run directory, each name from the module
# that owns the file; fdl.files's temporary files beside the files are ".<name>.<random>.tmp".
RUN_ENTRIES = frozenset({config.FILE, LOGS, metrics.FILE, summary.FILE, model.FILE,
                         checkpoints.DIRNAME, timeline.DIRNAME, progress.FILE, TENSORBOARD})


def check_run_dir(run_dir: Path, *, use: str) -> None:
    """Raise a usage error unless ``run_dir`` may be used as ``use`` says (``"new"``,
    ``"resume"`` or ``"overwrite"``). Reads only: nothing is created or deleted here."""
    if use == "resume" or not (run_dir.exists() or run_dir.is_symlink()):
        return
    if not run_dir.is_dir():
        raise UsageError(f"run directory {run_dir} is not a directory",
                         hint="pass --run-dir DIR with a new or empty directory")
    entries = _entries(run_dir)
    if not entries:
        return
    if not config.holds_a_run(run_dir):
        raise UsageError(f"run directory {run_dir} is not empty and holds no fdl run",
                         hint="pass --run-dir DIR with a new or empty directory")
    if use == "new":
        raise UsageError(f"run directory {run_dir} holds an earlier run",
                         hint=f"--resume {run_dir} continues it, --overwrite-run-dir replaces "
                              "it, or pass another --run-dir")
    foreign = sorted(name for name in entries if not _is_run_entry(name))
    if foreign:
        raise UsageError(f"run directory {run_dir} holds files fdl run did not write "
                         f"({', '.join(foreign[:5])}); not replacing it",
                         hint="move them away, or pass another --run-dir")


def prepare_run_dir(run_dir: Path, *, spec: dict[str, Any], fdl_version: str,
                    use: str = "new") -> Path:
    """Create ``run_dir`` and ``run_dir/logs`` (after removing the earlier run when ``use`` is
    ``"overwrite"``) and write ``config.json`` (the launch ``spec``) atomically. Call
    :func:`check_run_dir` first.

    A new run claims the directory by creating ``logs/``: of two ``fdl run`` started at once
    with the same directory, the second is refused instead of mixing its run into the first."""
    try:
        if use == "overwrite":
            _remove_run(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(run_dir, os.W_OK):
            raise PermissionError(f"{run_dir} is not writable")
        logs_dir(run_dir).mkdir(exist_ok=use == "resume")
        config.write_config(run_dir, spec, fdl_version=fdl_version)
    except FileExistsError as exc:
        raise UsageError(f"run directory {run_dir} is being used by another fdl run",
                         hint="pass another --run-dir") from exc
    except OSError as exc:
        raise UsageError(f"cannot use run directory {run_dir}: {exc.strerror or exc}",
                         hint="pass --run-dir DIR with a writable directory") from exc
    return run_dir


def _entries(run_dir: Path) -> list[str]:
    try:
        return os.listdir(run_dir)
    except OSError as exc:
        raise UsageError(f"cannot use run directory {run_dir}: {exc.strerror or exc}",
                         hint="pass --run-dir DIR with a writable directory") from exc


def _is_run_entry(name: str) -> bool:
    if name in RUN_ENTRIES:
        return True
    if name.startswith(".") and name.endswith(".tmp"):  # fdl.files's, left by a kill
        return name[1:-len(".tmp")].rsplit(".", 1)[0] in RUN_ENTRIES
    return False


def _remove_run(run_dir: Path) -> None:
    """Delete the earlier run: fdl's entries only, each checked again (by name) right before.
    No directory yet: nothing to replace (``--overwrite-run-dir`` on a first run)."""
    if not (run_dir.exists() or run_dir.is_symlink()):
        return
    for name in _entries(run_dir):
        if not _is_run_entry(name):
            raise UsageError(f"run directory {run_dir} holds {name}, which fdl run did not "
                             "write; not replacing it", hint="move it away, or pass another "
                                                             "--run-dir")
    for name in _entries(run_dir):
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def logs_dir(run_dir: Path) -> Path:
    return run_dir / LOGS


def log_path(logs: Path, rank: int | str, *, attempt: int | None = None) -> Path:
    """``logs/rank<r>.log``: rank r's stdout and stderr; an earlier attempt's, after a restart,
    is kept as ``rank<r>.attempt<k>.log``."""
    return logs / (f"rank{rank}.log" if attempt is None else f"rank{rank}.attempt{attempt}.log")


def agent_log_path(logs: Path) -> Path:
    """``logs/agent.log``: what torch's elastic agent logged in the launcher (its warnings and
    errors), kept off the terminal (fdl.launch.terminal)."""
    return logs / AGENT_LOG


def error_file(logs: Path, rank: int | str) -> Path:
    """Where torchelastic's ``@record`` writes rank r's error (TORCHELASTIC_ERROR_FILE)."""
    return logs / f".rank{rank}.error.json"


def tensorboard_dir(run_dir: Path | None) -> Path:
    """``--tensorboard``'s default directory (``runs/tensorboard`` without a run directory)."""
    return (run_dir if run_dir is not None else Path("runs")) / TENSORBOARD


def tail_lines(path: Path, count: int = 20) -> list[str]:
    """The last ``count`` lines of a log file (empty when it does not exist)."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 64 * 1024))
            data = handle.read()
    except OSError:
        return []
    return data.decode("utf-8", errors="replace").splitlines()[-count:]
