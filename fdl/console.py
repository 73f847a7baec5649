"""The one place that talks to rich.

Results go to stdout, progress and messages to stderr. ``--json`` output is one JSON document
printed with :func:`print_json` and nothing else. ``NO_COLOR`` is honoured (rich reads it), and
every string that comes from outside (paths, GPU names, subprocess output) is printed with markup
and highlighting off, so a ``[`` in a GPU name can never be taken for a style.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console, JustifyMethod
    from rich.progress import Progress


def _console(*, stderr: bool) -> Console:
    # A fresh Console per call is cheap and follows sys.stdout/sys.stderr when tests swap them.
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=True)


def out(text: str = "", *, style: str | None = None) -> None:
    """A line of plain result text on stdout (no markup)."""
    _console(stderr=False).print(text, style=style, markup=False)


def rule(title: str) -> None:
    """A section heading on stdout."""
    _console(stderr=False).rule(title, style="bold", align="left")


# The control codes rich strips from text (BEL, BS, VT, FF, CR): info() writes what rich would.
_CONTROL_CODES = dict.fromkeys((7, 8, 11, 12, 13))


def info(message: str) -> None:
    """A plain line on stderr. Written without rich, which has nothing to style in it: fdl run
    prints one before its workers start, and importing rich there costs 15 ms."""
    sys.stderr.write(message.translate(_CONTROL_CODES) + "\n")
    sys.stderr.flush()


def warn(message: str) -> None:
    _console(stderr=True).print(f"warning: {message}", style="yellow", markup=False)


def error(message: str, hint: str | None = None) -> None:
    """``error: ...`` and ``hint: ...`` on stderr: the only way fdl reports a failure."""
    console = _console(stderr=True)
    console.print(f"error: {message}", style="bold red", markup=False)
    if hint:
        console.print(f"hint: {hint}", style="cyan", markup=False)


def print_json(document: Any) -> None:
    """One JSON document on stdout, nothing else (no colour, stable key order as given)."""
    sys.stdout.write(json.dumps(document, indent=2, default=str) + "\n")
    sys.stdout.flush()


def print_table(
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    title: str | None = None,
    styles: Sequence[str | None] | None = None,
    justify: Sequence[JustifyMethod] | None = None,
    no_wrap: bool = False,
) -> None:
    """A table on stdout; cells are shown as plain text. ``styles`` styles whole rows,
    ``justify`` gives each column's alignment (``"left"``, ``"right"``, ``"center"``; left
    when not given). ``no_wrap`` keeps every header and cell on one line: for a table whose
    columns are known to fit, so "sync wait" is never broken into "sync" over "wait"."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, title_justify="left", header_style="bold")
    for index, column in enumerate(columns):
        table.add_column(column, justify=justify[index] if justify else "left", no_wrap=no_wrap)
    for index, row in enumerate(rows):
        style = styles[index] if styles else None
        table.add_row(*(Text("" if cell is None else str(cell)) for cell in row), style=style)
    _console(stderr=False).print(table)


def print_pairs(pairs: Sequence[tuple[str, Any]], *, wrap: bool = False) -> None:
    """Aligned ``key  value`` lines on stdout; pairs whose value is None are left out.

    Without ``wrap`` a long value runs on and the terminal wraps it (a path stays one line to
    copy). With ``wrap`` a value wider than the terminal continues on the next lines under its
    own column, broken between words, or inside a word longer than the column."""
    pairs = [(key, value) for key, value in pairs if value is not None]
    if not pairs:
        return
    width = max(len(key) for key, _ in pairs)
    console = _console(stderr=False)
    for key, value in pairs:
        lines = _wrapped(str(value), width=console.width - width - 4) if wrap else [str(value)]
        for index, line in enumerate(lines):
            console.print(f"  {(key if index == 0 else '').ljust(width)}  {line}", markup=False)


def _wrapped(text: str, *, width: int) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width=max(width, 10), break_on_hyphens=False) or [""]


@contextmanager
def progress(*, transient: bool = False, unit: str = "bytes") -> Iterator[Progress]:
    """A rich progress display on stderr: bytes, rate and ETA columns for downloads, or
    ``done/total``, elapsed and ETA columns for counted work (``unit="items"``)."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (DownloadColumn(), TransferSpeedColumn()) if unit == "bytes" else \
        (MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        *columns,
        TimeRemainingColumn(),
        console=_console(stderr=True),
        transient=transient,
    ) as bar:
        yield bar


@contextmanager
def status(message: str) -> Iterator[None]:
    """A spinner on stderr while something runs (only when stderr is a terminal)."""
    console = _console(stderr=True)
    if not console.is_terminal:
        yield
        return
    with console.status(message):
        yield


def is_live_terminal() -> bool:
    """Whether stderr is a terminal that can redraw a status line (not ``TERM=dumb``).
    rich decides; without a tty it can only say yes when TTY_COMPATIBLE=1 or FORCE_COLOR is
    set, so otherwise the answer is no without importing rich (15 ms of fdl run's start)."""
    import os

    if os.environ.get("TERM", "") == "dumb":
        return False
    if not (_isatty(sys.stderr) or os.environ.get("TTY_COMPATIBLE") == "1"
            or os.environ.get("FORCE_COLOR")):
        return False
    return _console(stderr=True).is_terminal


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no such method, or a closed stream
        return False


def terminal_width() -> int:
    return _console(stderr=True).width


@contextmanager
def live_status() -> Iterator[Callable[[str], None]]:
    """Status lines pinned under everything else on stderr, redrawn by ``update(text)`` (from any
    thread); whatever is printed meanwhile to stdout or stderr scrolls above them. The lines
    are gone when the block ends."""
    from rich.live import Live
    from rich.text import Text

    with Live(Text(""), console=_console(stderr=True), auto_refresh=False, transient=True,
              redirect_stdout=True, redirect_stderr=True) as live:

        def update(text: str) -> None:
            live.update(Text(text, no_wrap=True, overflow="crop"), refresh=True)

        yield update
