"""The run directory of ``fdl run``: checked, then created before workers start, ``config.json``
first.

``runs/<UTC time>-<script stem>-<policy>/`` (or ``--run-dir``) holds ``config.json`` (every
setting with its value and source, the launch spec), ``logs/rank<r>.log`` (each worker's stdout
and stderr; an earlier attempt's log is kept as ``rank<r>.attempt<k>.log`` on restart), and
what the engine writes (metrics, timeline, summary.json, model.pt, checkpoints).

One directory holds one run. A new run needs a directory that does not exist or is empty;
``--resume`` continues the run a directory holds; ``--overwrite-run-dir`` replaces it, but only
a directory that holds nothing but what ``fdl run`` writes (:data:`RUN_ENTRIES`): a typo such as
``--run-dir ~`` never deletes anything.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from fdl.errors import UsageError
from fdl.files import write_json_atomic

# What fdl run and the engine write at the top of a run directory (fdl.engine.trainer,
# fdl.engine.checkpoint.DIRNAME, fdl.engine.timeline, fdl.engine.progress and the default
# directory of fdl.engine.tensorboard); fdl.files's temporary files beside the files are
# ".<name>.<random>.tmp".
RUN_ENTRIES = frozenset({"config.json", "logs", "metrics.jsonl", "summary.json", "model.pt",
                         "checkpoints", "timeline", "progress.json", "tensorboard"})


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
    if not _holds_a_run(run_dir):
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


def prepare_run_dir(run_dir: Path, *, config: dict[str, Any], use: str = "new") -> Path:
    """Create ``run_dir`` and ``run_dir/logs`` (after removing the earlier run when ``use`` is
    ``"overwrite"``) and write ``config.json`` atomically. Call :func:`check_run_dir` first.

    A new run claims the directory by creating ``logs/``: of two ``fdl run`` started at once
    with the same directory, the second is refused instead of mixing its run into the first."""
    try:
        if use == "overwrite":
            _remove_run(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(run_dir, os.W_OK):
            raise PermissionError(f"{run_dir} is not writable")
        (run_dir / "logs").mkdir(exist_ok=use == "resume")
        write_json_atomic(run_dir / "config.json", config)
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


def _holds_a_run(run_dir: Path) -> bool:
    """``config.json`` as fdl run writes it (a JSON object with ``fdl_version``)."""
    try:
        config = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and "fdl_version" in config


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
