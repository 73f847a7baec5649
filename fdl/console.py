"""The one place that talks to rich.

Results go to stdout, progress and messages to stderr. ``--json`` output is one JSON document
printed with :func:`print_json` and nothing else. ``NO_COLOR`` is honoured (rich reads it), and
every string that comes from outside (paths, GPU names, subprocess output) is printed with markup
and highlighting off, so a ``[`` in a GPU name can never be taken for a style.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
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


def info(message: str) -> None:
    _console(stderr=True).print(message, markup=False)


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
) -> None:
    """A table on stdout; cells are shown as plain text. ``styles`` styles whole rows."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, title_justify="left", header_style="bold")
    for column in columns:
        table.add_column(column)
    for index, row in enumerate(rows):
        style = styles[index] if styles else None
        table.add_row(*(Text("" if cell is None else str(cell)) for cell in row), style=style)
    _console(stderr=False).print(table)


def print_pairs(pairs: Sequence[tuple[str, Any]]) -> None:
    """Aligned ``key  value`` lines on stdout; pairs whose value is None are left out."""
    pairs = [(key, value) for key, value in pairs if value is not None]
    if not pairs:
        return
    width = max(len(key) for key, _ in pairs)
    console = _console(stderr=False)
    for key, value in pairs:
        console.print(f"  {key.ljust(width)}  {value}", markup=False)


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
