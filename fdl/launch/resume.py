"""``fdl run --resume RUN_DIR``: continue a run from its last valid checkpoint.

The script, its arguments and every setting given as a flag come from ``RUN_DIR/config.json``
unless given again (then the new value wins: ``--nproc-per-node 1`` resumes with one worker
fewer, ``--epochs 10`` trains further). The workers get ``FDL_RESUME=1`` and load the newest
checkpoint whose files match its manifest (fdl.engine.checkpoint); nothing starts when there is
none.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from fdl.errors import UsageError
from fdl.launch.spec import DEFAULTS, RunRequest


def resume_request(request: RunRequest, *, cwd: Path) -> RunRequest:
    """``request`` completed from the run directory it resumes; usage errors for a directory
    that is not a resumable run."""
    from fdl.engine.checkpoint import DIRNAME, latest_checkpoint

    assert request.resume is not None
    run_dir = (cwd / request.resume).resolve()
    if not run_dir.is_dir():
        raise UsageError(f"--resume {request.resume}: no such run directory",
                         hint="--resume takes the run directory of an earlier fdl run")
    if request.run_dir is not None and (cwd / request.run_dir).resolve() != run_dir:
        raise UsageError("--resume and --run-dir name different directories",
                         hint="--resume RUN_DIR continues in RUN_DIR; leave --run-dir out")
    checkpoint, skipped = latest_checkpoint(run_dir)
    if checkpoint is None:
        why = "; ".join(skipped) or "none was written"
        raise UsageError(f"--resume {request.resume}: no usable checkpoint in "
                         f"{run_dir / DIRNAME} ({why})",
                         hint="checkpoints are written with --checkpoint-every N (epochs) or 10m")
    previous = _previous_config(run_dir)
    script = request.script
    if script is None:
        script = previous.get("script")
        if not script:
            raise UsageError(f"{run_dir}/config.json does not name the script",
                             hint="fdl run --resume RUN_DIR SCRIPT [ARGS...]")
        request = replace(request, script_args=tuple(previous.get("args", ())),
                          module=bool(previous.get("module")))
    flags = {key: _as_flag(entry["value"])
             for key, entry in previous.get("settings", {}).items()
             if key in DEFAULTS and key != "run_dir" and entry.get("source") == "flag"
             and getattr(request, key) is None}
    return replace(request, script=script, run_dir=str(run_dir), **flags)


def _previous_config(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "config.json"
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read {path}: {exc}",
                         hint="--resume needs a run directory written by fdl run") from exc
    return document if isinstance(document, dict) else {}


def _as_flag(value: Any) -> Any:
    if isinstance(value, list):
        return ",".join(f"{v:g}" for v in value)
    return value if value is None else str(value)
