"""The run directory of ``fdl run``: created before workers start, ``config.json`` first.

``runs/<UTC time>-<script stem>-<policy>/`` (or ``--run-dir``) holds ``config.json`` (every
setting with its value and source, the launch spec), ``logs/rank<r>.log`` (each worker's stdout
and stderr; an earlier attempt's log is kept as ``rank<r>.attempt<k>.log`` on restart), and
what the engine writes (metrics, timeline, summary.json, model.pt).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fdl.errors import UsageError
from fdl.files import write_atomic


def prepare_run_dir(run_dir: Path, *, config: dict[str, Any]) -> Path:
    """Create ``run_dir`` and ``run_dir/logs`` and write ``config.json`` atomically."""
    try:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        if not os.access(run_dir, os.W_OK):
            raise PermissionError(f"{run_dir} is not writable")
        write_json_atomic(run_dir / "config.json", config)
    except OSError as exc:
        raise UsageError(f"cannot use run directory {run_dir}: {exc.strerror or exc}",
                         hint="pass --run-dir DIR with a writable directory") from exc
    return run_dir


def write_json_atomic(path: Path, document: Any) -> None:
    """Write ``document`` as JSON, atomically (fdl.files.write_atomic)."""
    write_atomic(path, json.dumps(document, indent=2, default=str) + "\n")


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
