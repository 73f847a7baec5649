"""One ``fdl run`` as a child process — a cell of ``fdl bench`` or ``fdl compare``: started from
scratch in its run directory, its output into a log file (and, when asked, line by line to a
callback, to show it as it comes), and Ctrl-C handed on to it so that it stops its workers
before the caller stops.

:func:`run_from_scratch` is the one way both commands run a cell: an earlier attempt's run
directory is removed first, but only when it holds nothing but what ``fdl run`` writes
(:func:`fdl.rundir.layout.check_run_dir`), so a mistyped output directory never costs a user
their files; then :func:`run_logged`.

Standard library and :mod:`fdl.rundir.layout` only: ``fdl compare`` runs its cells without
importing torch.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from fdl.errors import UsageError
from fdl.files import open_for_writing, output_dir_problem
from fdl.rundir.layout import check_run_dir, tail_lines

STOP_GRACE_S = 30  # how long fdl run gets to stop its workers after our SIGINT
LOG_TAIL_LINES = 30


def run_from_scratch(argv: Sequence[str], *, run_dir: Path, log: Path, cwd: Path,
                     env: Mapping[str, str],
                     echo: Callable[[str], None] | None = None) -> int:
    """Run the ``fdl run`` of ``argv``, whose run directory is ``run_dir``, from scratch; return
    its exit code. An earlier attempt's ``run_dir`` is removed first (never mix two attempts),
    but a directory that is not a run fdl wrote is a UsageError and nothing starts. ``log``,
    ``cwd``, ``env`` and ``echo`` as for :func:`run_logged`."""
    if run_dir.exists() or run_dir.is_symlink():
        try:
            check_run_dir(run_dir, use="overwrite")  # a link is refused: never removed through
        except UsageError as exc:  # its hint names fdl run's --run-dir, which no caller has
            raise UsageError(exc.message, hint="move what is there away, or pass another "
                                                "--out") from exc
        _remove_attempt(run_dir)
    log.parent.mkdir(parents=True, exist_ok=True)
    return run_logged(argv, log=log, cwd=cwd, env=env, echo=echo)


OUT_HINT = "pass --out DIR with a directory you can write"


def check_out(out: Path, *, command: str, paths: Iterable[Path] = ()) -> None:
    """A UsageError, reading only (so ``--dry-run`` asks too), unless ``out`` (fdl compare's or
    fdl bench's ``--out``) is a directory fdl can write (fdl.files.output_dir_problem) and none
    of ``paths`` (the cells' run directories and logs there) is a symbolic link: an unfinished
    cell's directory is removed and its log rewritten, never through a link."""
    problem = output_dir_problem(out)
    if problem is not None:
        raise UsageError(f"--out {out} {problem}", hint=OUT_HINT)
    for path in paths:
        if path.is_symlink():
            raise UsageError(f"{path} is a symbolic link; {command} does not write or remove a "
                             "run through a link", hint="remove the link, or pass another --out")


def _remove_attempt(run_dir: Path) -> None:
    """Remove an earlier attempt's run directory (checked to be one, not a link); shutil.rmtree
    removes the links inside it, never what they point at. A failure is one usage error."""
    try:
        shutil.rmtree(run_dir)
    except OSError as exc:
        raise UsageError(f"cannot remove the earlier attempt in {run_dir}: "
                         f"{exc.strerror or exc}", hint="remove it yourself, or pass another "
                                                         "--out") from exc


def run_logged(argv: Sequence[str], *, log: Path, cwd: Path, env: Mapping[str, str],
               echo: Callable[[str], None] | None = None) -> int:
    """Run ``argv`` with stdout and stderr into ``log`` (overwritten); return its exit code.

    ``echo`` also gets each line of output as it comes (without its newline); the child then
    runs with ``PYTHONUNBUFFERED=1`` so that its lines are not held back by a pipe's buffer.
    On Ctrl-C the child is stopped (:func:`wait_child`) and KeyboardInterrupt propagates. A link
    planted at ``log`` is a usage error, its target untouched (fdl.files.open_for_writing)."""
    with open_for_writing(log, encoding="utf-8") as handle:
        if echo is None:
            child = subprocess.Popen(list(argv), stdout=handle, stderr=subprocess.STDOUT,
                                     cwd=cwd, env=dict(env))
            return wait_child(child)
        child = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 cwd=cwd, env={**env, "PYTHONUNBUFFERED": "1"}, text=True,
                                 encoding="utf-8", errors="replace")
        try:
            assert child.stdout is not None
            for line in child.stdout:
                handle.write(line)
                handle.flush()
                echo(line.rstrip("\n"))
        except KeyboardInterrupt:
            _stop(child)
            raise
        return wait_child(child)


def wait_child(child: subprocess.Popen) -> int:
    """The child's exit code. On Ctrl-C, hand fdl run a SIGINT of its own (it may not share our
    terminal) so that it stops its workers, give it a moment, then kill it."""
    try:
        return child.wait()
    except KeyboardInterrupt:
        _stop(child)
        raise


def _stop(child: subprocess.Popen) -> None:
    child.send_signal(signal.SIGINT)
    try:
        child.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def log_tail(log: Path, *, count: int = LOG_TAIL_LINES) -> list[str]:
    """The last ``count`` lines of ``log`` (fdl.rundir.layout.tail_lines)."""
    return tail_lines(log, count)
