"""The one place that talks to rich.

Results go to stdout, progress and messages to stderr. ``--json`` output is one JSON document
printed with :func:`print_json` and nothing else: strict JSON (a NaN or an infinity is written
as ``null``), every string its exact value (json escapes control characters). ``NO_COLOR`` is
honoured (rich reads it), and every string that comes from outside (paths, GPU names, subprocess
output) is printed with markup, emoji codes and highlighting off, so a ``[`` in a GPU name can
never be taken for a style.

Text that reaches the terminal passes through :func:`shown` here, in every function of this
module, so no caller can forget it: a control character in a GPU name, a policy, a metric name
or a directory name (an escape sequence that retitles the window or clears the screen, a C1
control, a right-to-left override) is shown escaped (``\\x1b``, ``\\u202e``), never acted on.
A single value (a table cell, a title, a ``print_pairs`` key or value) has its newlines and tabs
escaped as well; a message (``out``, ``info``, ``warn``, ``error``) is built by fdl, so it keeps
its line breaks and escapes every other control character in the outside text it quotes.
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


# What a terminal would act on rather than show: the C0 controls (ESC starts every escape
# sequence, BEL ends an OSC title change), DEL, the C1 controls (U+009B is a one-byte CSI), the
# bidirectional controls that reorder what follows (U+202E, right-to-left override) and the two
# Unicode line and paragraph separators.
_BIDI = (0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A))
_CONTROLS = (*range(0x20), *range(0x7F, 0xA0), *_BIDI, 0x2028, 0x2029)
_NAMED = {0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r"}


def _escape(code: int) -> str:
    return _NAMED.get(code) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


_ESCAPED_VALUE = {code: _escape(code) for code in _CONTROLS}
_ESCAPED_MESSAGE = {code: text for code, text in _ESCAPED_VALUE.items() if code != 0x0A}


def shown(value: object, *, lines: bool = False) -> str:
    """``value`` as text a terminal shows and never acts on: each control character (the C0
    and C1 controls, DEL, the bidirectional controls, U+2028/U+2029) written as its escape,
    ``\\x1b``, ``\\u202e``, ``\\t``, ``\\n``, ``\\r``. ``lines`` keeps newlines (a message of
    several lines). A backslash is left as is, so the form is for reading, not for parsing back
    (``--json`` has the exact value), and showing shown text again changes nothing."""
    text = value if isinstance(value, str) else str(value)
    return text.translate(_ESCAPED_MESSAGE if lines else _ESCAPED_VALUE)


def _console(*, stderr: bool) -> Console:
    # A fresh Console per call is cheap and follows sys.stdout/sys.stderr when tests swap them.
    # emoji off: ":smile:" in a path is shown as typed.
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=True, emoji=False)


def _text(value: object, *, style: str = "") -> Any:
    """A rich Text of one value, shown (:func:`shown`): no markup, no control character."""
    from rich.text import Text

    return Text(shown(value), style=style)


def out(text: str = "", *, style: str | None = None) -> None:
    """A line of plain result text on stdout (no markup)."""
    _console(stderr=False).print(shown(text, lines=True), style=style, markup=False)


def rule(title: str) -> None:
    """A section heading on stdout."""
    _console(stderr=False).rule(_text(title, style="rule.text"), style="bold", align="left")


def info(message: str) -> None:
    """A plain line on stderr. Written without rich, which has nothing to style in it: fdl run
    prints one before its workers start, where rich's import would delay them (docs/run.md
    "Launch latency")."""
    sys.stderr.write(shown(message, lines=True) + "\n")
    sys.stderr.flush()


def warn(message: str) -> None:
    _console(stderr=True).print(f"warning: {shown(message, lines=True)}", style="yellow",
                                markup=False)


def error(message: str, hint: str | None = None) -> None:
    """``error: ...`` and ``hint: ...`` on stderr: the only way fdl reports a failure."""
    console = _console(stderr=True)
    console.print(f"error: {shown(message, lines=True)}", style="bold red", markup=False)
    if hint:
        console.print(f"hint: {shown(hint, lines=True)}", style="cyan", markup=False)


def print_json(document: Any) -> None:
    """One JSON document on stdout, nothing else (no colour, stable key order as given). Strict
    JSON: a NaN or an infinity, which a strict parser refuses, is written as ``null``."""
    from fdl.files import finite_json

    sys.stdout.write(json.dumps(finite_json(document), indent=2, default=str, allow_nan=False)
                     + "\n")
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

    table = Table(title=None if title is None else _text(title, style="table.title"),
                  title_justify="left", header_style="bold")
    for index, column in enumerate(columns):
        table.add_column(_text(column), justify=justify[index] if justify else "left",
                         no_wrap=no_wrap)
    for index, row in enumerate(rows):
        style = styles[index] if styles else None
        table.add_row(*(_text("" if cell is None else cell) for cell in row), style=style)
    _console(stderr=False).print(table)


def print_pairs(pairs: Sequence[tuple[str, Any]], *, wrap: bool = False) -> None:
    """Aligned ``key  value`` lines on stdout; pairs whose value is None are left out.

    Without ``wrap`` a long value runs on and the terminal wraps it (a path stays one line to
    copy). With ``wrap`` a value wider than the terminal continues on the next lines under its
    own column, broken between words, or inside a word longer than the column."""
    pairs = [(shown(key), shown(value)) for key, value in pairs if value is not None]
    if not pairs:
        return
    width = max(len(key) for key, _ in pairs)
    console = _console(stderr=False)
    for key, value in pairs:
        lines = _wrapped(value, width=console.width - width - 4) if wrap else [value]
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
        TimeElapsedColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (DownloadColumn(), TransferSpeedColumn()) if unit == "bytes" else \
        (MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(
        _description_column(),
        BarColumn(),
        *columns,
        TimeRemainingColumn(),
        console=_console(stderr=True),
        transient=transient,
    ) as bar:
        yield bar


def _description_column() -> Any:
    """A progress column showing each task's description as plain text (:func:`shown`): a
    description may quote a file name, and rich's TextColumn reads markup in it."""
    from rich.progress import ProgressColumn

    class DescriptionColumn(ProgressColumn):
        def render(self, task: Any) -> Any:
            return _text(task.description)

    return DescriptionColumn()


@contextmanager
def status(message: str) -> Iterator[None]:
    """A spinner on stderr while something runs (only when stderr is a terminal)."""
    console = _console(stderr=True)
    if not console.is_terminal:
        yield
        return
    with console.status(_text(message)):
        yield


def is_live_terminal() -> bool:
    """Whether stderr is a terminal that can redraw a status line (not ``TERM=dumb``).
    rich decides; without a tty it can only say yes when TTY_COMPATIBLE=1 or FORCE_COLOR is
    set, so otherwise the answer is no without importing rich (part of fdl run's start:
    docs/run.md "Launch latency")."""
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
            live.update(Text(shown(text, lines=True), no_wrap=True, overflow="crop"),
                        refresh=True)

        yield update
