"""The range of every number in the settings contract (fdl.settings), stated once, and the
small parsers that read a number into one.

A :class:`Range` says which numbers a setting allows and prints itself as ``[1, 1000000]`` or
``(0, 1000]`` in the error that refuses one outside it. A number is never a bool, NaN or an
infinity, and a huge one is shortened in an error (:func:`shortened`), never printed whole. The
ranges are what a run can use with room to spare; each one's reason is beside it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fdl.errors import UsageError


@dataclass(frozen=True)
class Range:
    """The numbers a setting allows, ``low`` to ``high``, each end included unless open: shown
    as ``[1, 1000000]`` or ``(0, 1000]`` in the error that refuses a value outside it."""

    low: float
    high: float
    open_low: bool = False
    open_high: bool = False

    def __contains__(self, number: float) -> bool:
        above = number > self.low if self.open_low else number >= self.low
        return above and (number < self.high if self.open_high else number <= self.high)

    def __str__(self) -> str:
        return (f"{'(' if self.open_low else '['}{number_text(self.low)}, {number_text(self.high)}"
                f"{')' if self.open_high else ']'}")


# The engine seeds torch with seed + epoch (fdl.engine.data) and seed + 1_000_003 * rank
# (fdl.engine.loop); torch.manual_seed takes at most 2**64 - 1, so a seed stops at 2**63 - 1,
# which leaves room for both (tests/faults/test_number_faults.py seeds torch so at the ends).
SEEDS = Range(0, 2**63 - 1)
NUM_SEEDS = Range(1, 1000)  # fdl bench --seeds (per cell), fdl compare --seeds (per policy)
EPOCHS = Range(1, 1_000_000)
BATCH_SIZES = Range(1, 2**24)
MAX_MICRO_BATCH = 2**20
MICRO_BATCHES = Range(1, MAX_MICRO_BATCH)
STEPS = Range(1, 10**12)
SAMPLES = Range(1, 10**15)  # below 2**53: a count of samples stays exact as a float
WORKERS_PER_NODE = Range(1, 1024)  # --nproc-per-node N; "cpu" is this host's core count
NODES = Range(1, 10_000)  # --nnodes N or MIN:MAX (fdl.launch.rendezvous)
RESTARTS = Range(0, 1000)
# The emulation sleeps (f - 1) x a rank's compute (fdl.engine.speed): below 1 it cannot make a
# rank faster, and a factor of 1000 already turns a 1 ms step into a second.
SLOWDOWNS = Range(1, 1000)
TIMES_S = Range(0, 365 * 86400, open_low=True)  # budgets and checkpoint intervals: a year
MAX_COLLECTIVE_TIMEOUT_S = 86400.0  # a day: beyond it a stuck peer is never noticed
COLLECTIVE_TIMEOUTS_S = Range(0, MAX_COLLECTIVE_TIMEOUT_S, open_low=True)
DIVERGENCE_THRESHOLDS = Range(0, 1_000_000, open_low=True)
OVERHEAD_TARGETS = Range(0, 1000, open_low=True)  # 1000: the anchor stays at its minimum
OUTER_LRS = Range(0, 10, open_low=True)
MOMENTUMS = Range(0, 1, open_high=True)
MAX_SHOWN = 40  # a value longer than this is shortened in an error


def shortened(value: Any) -> str:
    """``repr(value)`` as an error shows it: shortened past :data:`MAX_SHOWN` characters, so a
    400-digit number is never printed whole."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's 4300 digits
        return "a number of more than 4300 digits"
    if len(text) <= MAX_SHOWN:
        return text
    size = f"{len(text.lstrip('-'))} digits" if isinstance(value, int) else \
        f"{len(value)} characters" if isinstance(value, str) else f"{len(text)} characters"
    return f"{text[:MAX_SHOWN - 16]}... ({size})"


def parse_whole(name: str, allowed: Range, *, hint: str | None = None) -> Callable[[Any], int]:
    """A whole number in ``allowed``: an int, or text that reads as one (never a bool or a
    float)."""
    return parse_in(name, allowed, whole, "a whole number", hint=lambda: hint or (
        f"give {name} a whole number from {number_text(allowed.low)} to "
        f"{number_text(allowed.high)}"))


def parse_in(name: str, allowed: Range, read: Callable[[Any], Any], what: str, *,
             hint: Callable[[], str]) -> Callable[[Any], Any]:
    """A parser of ``name``: ``read(value)`` (None: it does not read as ``what``) inside
    ``allowed``, else one usage error naming the range and the value, with ``hint()`` (made
    when it is needed: a caller's hint may name what is defined after its parsers)."""
    def parse(value: Any) -> Any:
        number = read(value)
        if number is None or number not in allowed:
            raise UsageError(f"{name} must be {what} in {allowed}, got {shortened(value)}",
                             hint=hint())
        return number

    return parse


def whole(value: Any) -> int | None:
    """An int, or text that reads as one; None for anything else (a bool, a float, a number
    past Python's 4300 digits)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    try:
        return int(value.strip()) if isinstance(value, str) else None
    except ValueError:  # not a whole number, or past Python's 4300 digits
        return None


def real(value: Any) -> float | None:
    """A finite number from an int, a float or text; None for anything else (a bool, NaN,
    infinity, an int too large for a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        number = float(value)
    except (ValueError, OverflowError):  # not a number, or an int too large for a float
        return None
    return number if math.isfinite(number) else None


def number_text(value: Any) -> str:
    """A float as short as reads back exactly (``2.5``, ``16``, ``1234567.5``), else ``str``."""
    if not isinstance(value, float):
        return str(value)
    short = f"{value:g}"
    return short if float(short) == value else repr(value)
