"""``fdl run --resume RUN_DIR``: continue a run from its last valid checkpoint.

The script, its arguments and every setting given as a flag come from ``RUN_DIR/config.json``
unless given again (then the new value wins: ``--nproc-per-node 1`` resumes with one worker
fewer, ``--epochs 10`` trains further). The workers get ``FDL_RESUME=1`` and load the newest
checkpoint whose files match its manifest (fdl.rundir.checkpoints); nothing starts when there is
none.

Planning (:func:`resume_request`, also under ``--dry-run``) reads only ``config.json``;
the checkpoints are read and hashed by :func:`check_resumable`, just before the run starts.
"""

from __future__ import annotations

from pathlib import Path

from fdl.errors import UsageError
from fdl.files import named_path
from fdl.launch.request import RunRequest
from fdl.rundir.config import FILE as CONFIG_FILE
from fdl.rundir.config import launch_settings, read_config
from fdl.settings import BY_NAME


def resume_request(request: RunRequest, *, cwd: Path) -> RunRequest:
    """``request`` completed from the ``config.json`` of the run it resumes; usage errors for a
    directory that is not a run of fdl run."""
    given = request.get("resume")
    assert given is not None
    run_dir = named_path(cwd / given)  # a link stays one: fdl.rundir.layout refuses it
    if not run_dir.is_dir():
        raise UsageError(f"--resume {given}: no such run directory",
                         hint="--resume takes the run directory of an earlier fdl run")
    explicit = request.get("run_dir")
    if explicit is not None and named_path(cwd / explicit) != run_dir:
        raise UsageError("--resume and --run-dir name different directories",
                         hint="--resume RUN_DIR continues in RUN_DIR; leave --run-dir out")
    previous = read_config(run_dir, hint="--resume needs a run directory written by fdl run",
                           missing_ok=False)
    if request.script is None:
        script = previous.get("script")
        if not script or not isinstance(script, str):
            raise UsageError(f"{run_dir / CONFIG_FILE} does not name the script",
                             hint="fdl run --resume RUN_DIR SCRIPT [ARGS...]")
        args = previous.get("args", ())
        request = RunRequest(script, tuple(str(a) for a in args) if isinstance(args, list)
                             else (), {**request.flags, "module": bool(previous.get("module"))})
    flags = {key: BY_NAME[key].encode(entry["value"])
             for key, entry in launch_settings(previous).items()
             if key in BY_NAME and BY_NAME[key].flag and key != "run_dir"
             and entry.get("source") == "flag"
             and entry.get("value") is not None and request.get(key) is None}
    return request.with_flags(run_dir=str(run_dir), **flags)


def check_resumable(run_dir: Path) -> None:
    """A usage error unless ``run_dir`` holds a checkpoint whose files match its manifest (each
    file is read and hashed)."""
    from fdl.rundir.checkpoints import DIRNAME, latest_checkpoint

    checkpoint, skipped = latest_checkpoint(run_dir)
    if checkpoint is None:
        why = "; ".join(skipped) or "none was written"
        raise UsageError(f"--resume {run_dir}: no usable checkpoint in {run_dir / DIRNAME} "
                         f"({why})",
                         hint="checkpoints are written with --checkpoint-every N (epochs) or 10m")
