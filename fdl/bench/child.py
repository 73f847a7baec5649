"""One ``fdl run`` as a child process of ``fdl bench`` or ``fdl compare``: its output into a log
file (and, when asked, line by line to a callback, to show it as it comes), and Ctrl-C handed on
to it so that it stops its workers before the caller stops.

Standard library only: ``fdl compare`` runs its cells without importing torch.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

STOP_GRACE_S = 30  # how long fdl run gets to stop its workers after our SIGINT
LOG_TAIL_LINES = 30


def run_logged(argv: Sequence[str], *, log: Path, cwd: Path, env: Mapping[str, str],
               echo: Callable[[str], None] | None = None) -> int:
    """Run ``argv`` with stdout and stderr into ``log`` (overwritten); return its exit code.

    ``echo`` also gets each line of output as it comes (without its newline); the child then
    runs with ``PYTHONUNBUFFERED=1`` so that its lines are not held back by a pipe's buffer.
    On Ctrl-C the child is stopped (:func:`wait_child`) and KeyboardInterrupt propagates."""
    with log.open("w", encoding="utf-8") as handle:
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
    """The last ``count`` lines of ``log`` (empty when it cannot be read)."""
    try:
        return log.read_text(encoding="utf-8", errors="replace").splitlines()[-count:]
    except OSError:
        return []
