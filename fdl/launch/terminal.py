"""What reaches the terminal while ``fdl run``'s workers run, and what stays in the run's logs.

* The workers' output: torch's agent tees each worker's log to ``sys.stdout`` as it grows.
  During a launch :class:`OutputGate` stands in for ``sys.stdout`` and passes it through until
  the launcher is told to stop (Ctrl-C, SIGTERM, SIGHUP, SIGQUIT); from then on nothing more
  of the workers' output reaches the terminal. What they print while they are stopped — a
  KeyboardInterrupt traceback per rank, a gloo "Connection closed by peer" from a rank whose
  peer went first — stays in ``logs/rank<r>.log``, and ``fdl run`` ends with one line instead.
  The gate has to close the moment the signal arrives, while torch's agent is still stopping
  the workers in the main thread (its signal handler replaces any other): :func:`gate_closing_on_stop`
  has Python write every signal's number to a pipe (``signal.set_wakeup_fd``, which works
  whoever handles the signal) and a thread closes the gate when a stop signal comes through.
* torch's own log lines (the agent's warning on a signal, its error line for a failed worker)
  go to ``logs/agent.log`` (:func:`agent_log`): ``fdl run`` says what happened itself, once.

``FDL_DEBUG=1`` leaves both as torch has them.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from fdl.files import open_for_writing

STOP_SIGNALS = frozenset(int(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP,
                                          signal.SIGQUIT))
AGENT_LOGGER = "torch.distributed.elastic"  # every logger of torch's agent is below it


@contextmanager
def terminal_for_workers(agent_log_path: Path) -> Iterator[None]:
    """What reaches the terminal during one launch, as the module docstring says; with
    ``FDL_DEBUG=1`` (:func:`fdl.settings.debugging`), everything as torch has it."""
    from fdl.settings import debugging

    if debugging():
        yield
        return
    import sys

    with agent_log(agent_log_path), gated_stdout(sys.stdout) as gate, gate_closing_on_stop(gate):
        yield


class OutputGate:
    """A text stream that writes through to ``target`` until :meth:`close_gate`."""

    def __init__(self, target: TextIO) -> None:
        self._target = target
        self._open = True
        self._lock = threading.Lock()  # a line being written when the gate closes is whole

    def write(self, text: str) -> int:
        with self._lock:
            if self._open:
                self._target.write(text)
        return len(text)

    def flush(self) -> None:
        with self._lock:
            if self._open:
                self._target.flush()

    def close_gate(self) -> None:
        with self._lock:
            if self._open:
                self._target.flush()
            self._open = False

    @property
    def is_open(self) -> bool:
        return self._open

    def __getattr__(self, name: str) -> Any:  # encoding, isatty, fileno ... of the terminal
        return getattr(self._target, name)


@contextmanager
def gated_stdout(target: TextIO) -> Iterator[OutputGate]:
    """``sys.stdout`` is an :class:`OutputGate` over ``target`` for the block."""
    import sys

    gate = OutputGate(target)
    saved, sys.stdout = sys.stdout, gate  # type: ignore[assignment]
    try:
        yield gate
    finally:
        sys.stdout = saved


@contextmanager
def gate_closing_on_stop(gate: OutputGate) -> Iterator[None]:
    """Close ``gate`` as soon as the process receives a stop signal (:data:`STOP_SIGNALS`)
    during the block. Python writes each signal it handles to the wakeup fd from its C-level
    handler, before any Python handler runs; the main thread only may set it (elsewhere the
    gate just stays open)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    watcher = threading.Thread(target=_watch, args=(read_fd, gate), name="fdl-stop-watch",
                               daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous)
        os.close(write_fd)  # the watcher reads the end of the pipe and returns
        watcher.join()
        os.close(read_fd)


def _watch(read_fd: int, gate: OutputGate) -> None:
    while True:
        try:
            received = os.read(read_fd, 64)
        except OSError:
            return
        if not received:
            return
        if STOP_SIGNALS.intersection(received):
            gate.close_gate()


class _LogFile(logging.FileHandler):
    """A FileHandler that opens its file as fdl opens its own: never through a link."""

    def _open(self) -> TextIO:
        return open_for_writing(Path(self.baseFilename), append=True,  # type: ignore[return-value]
                                encoding=self.encoding)


@contextmanager
def agent_log(path: Path) -> Iterator[None]:
    """torch's agent logs into ``path`` (created at its first line) instead of the terminal."""
    logger = logging.getLogger(AGENT_LOGGER)
    handler = _LogFile(path, encoding="utf-8", delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    saved = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False  # torch's own handler, on "torch.distributed", writes to stderr
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = saved
        handler.close()
