"""``fdl run``'s live progress on a terminal: two status lines under the workers' output, redrawn
a few times a second from rank 0's progress snapshot (fdl.rundir.progress)::

    epoch 2/5 ━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━ 73%  1:02 left
    7,120 samples/s  loss 0.4623  sync 1.8%  data 9.3%  anchor 20  ranks 71% 29%  precision bf16 fp32

The launcher reads; the workers only write a small file when it is due, so the display costs
rank 0 a clock read per step and a file write per :data:`INTERVAL_S` (docs/run.md "Live
progress" has the measurement). The per-epoch lines still scroll above it; off a terminal, or
with ``--quiet``, there are only those lines; a script that does not train with fdl (fdl.init or fdl.Trainer)
writes no snapshot, and nothing is shown. A file that is missing, torn, oversized or not
what rank 0 writes shows nothing new: the display is never worth stopping a run for.

``data`` is the share of rank 0's step time spent waiting for its batches, shown from 1%:
a rank fed too slowly by its loader, not a slow device.
``precision`` is each rank's, in rank order (the order of ``ranks``), or one word when every
rank trains in the same; a snapshot without precisions (an engine that gives none) leaves it
out. Before rank 0's first step ends the second line says it is taking it (:data:`FIRST_STEP`):
a compiled model's first step lasts half a minute, with nothing else to show.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fdl.rundir.progress import clear_snapshot, read_snapshot

INTERVAL_S = 0.25  # rank 0's snapshots and the redraws: four a second
DATA_SHOWN = 0.01  # the data wait is shown from this share of the step time
# the second line while rank 0 takes its first step (a snapshot's first_step)
FIRST_STEP = "taking the first step (a torch.compile'd model compiles in it)"


def format_status(snapshot: dict[str, Any], *, width: int) -> str:
    """The two status lines for ``snapshot``, each at most ``width`` characters. A figure that
    is not what rank 0 writes (not a number, NaN, infinite, or below what it can be: a negative
    rate, a count below 1) shows as unknown (``?`` or ``-``), never as a figure."""
    epoch = f"epoch {_count(snapshot.get('epoch'))}/{_count(snapshot.get('epochs'))} "
    fraction = _number(snapshot.get("epoch_fraction"), low=0.0)
    fraction = min(1.0, fraction) if fraction is not None else 0.0
    tail = f" {fraction:4.0%}  {_duration(snapshot.get('eta_s'))} left"
    bar_width = max(0, width - len(epoch) - len(tail))
    filled = round(bar_width * fraction)
    first = epoch + "━" * filled + "╺" * min(1, bar_width - filled) + \
        " " * max(0, bar_width - filled - 1) + tail
    if snapshot.get("first_step") is True:
        return first[:width] + "\n" + FIRST_STEP[:width]
    parts = [f"{_grouped(snapshot.get('samples_per_s'))} samples/s"]
    loss = _number(snapshot.get("loss"))  # any finite loss is a figure: some are negative
    parts.append(f"loss {loss:.4f}" if loss is not None else "loss -")
    overhead = _number(snapshot.get("sync_overhead"), low=0.0)
    if overhead is not None:
        parts.append(f"sync {overhead:.1%}")
    data_wait = _number(snapshot.get("data_wait"), low=0.0)
    if data_wait is not None and data_wait >= DATA_SHOWN:
        parts.append(f"data {min(data_wait, 1.0):.1%}")
    if snapshot.get("anchor") is not None:
        parts.append(f"anchor {_count(snapshot.get('anchor'))}")
    shares = snapshot.get("shares")
    if isinstance(shares, list) and len(shares) > 1:
        parts.append("ranks " + " ".join(_share(share) for share in shares))
    precisions = snapshot.get("precisions")
    if isinstance(precisions, list) and precisions:
        shown = [_word(value) for value in precisions]
        parts.append("precision " + " ".join(shown if len(set(shown)) > 1 else shown[:1]))
    return first[:width] + "\n" + "  ".join(parts)[:width]


def _number(value: Any, *, low: float = -math.inf) -> float | None:
    """``value`` as a float when it is a finite number of at least ``low``; else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value >= low else None


def _count(value: Any) -> str:
    """An epoch, a number of epochs or an anchor: a whole number from 1, else ``?``."""
    number = _number(value, low=1.0)
    return str(int(number)) if number is not None else "?"


def _grouped(value: Any) -> str:
    number = _number(value, low=0.0)
    return f"{number:,.0f}" if number is not None else "-"


def _share(value: Any) -> str:
    number = _number(value, low=0.0)
    return f"{number:.0%}" if number is not None and number <= 1 else "?"


def _word(value: Any) -> str:
    """A precision's name (letters and digits, a few of them), else ``?``."""
    ok = isinstance(value, str) and value.isascii() and value.isalnum() and len(value) <= 8
    return value if ok else "?"


def _duration(value: Any) -> str:
    seconds = _number(value, low=0.0)
    if seconds is None:
        return "-:--"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


@contextmanager
def live_progress(run_dir: Path, *, enabled: bool) -> Iterator[None]:
    """Show rank 0's progress under the run's output while the block runs (when ``enabled``)."""
    if not enabled:
        yield
        return
    from fdl import console

    clear_snapshot(run_dir)
    stop = threading.Event()
    with console.live_status() as update:
        poller = threading.Thread(target=_poll, args=(run_dir, update, stop, console.terminal_width),
                                  name="fdl-live-progress", daemon=True)
        poller.start()
        try:
            yield
        finally:
            stop.set()
            poller.join()


def _poll(run_dir: Path, update: Callable[[str], None], stop: threading.Event,
          width: Callable[[], int]) -> None:
    shown = None
    while not stop.wait(INTERVAL_S):
        snapshot = read_snapshot(run_dir)
        if snapshot is None:  # not yet (or not a script that trains with fdl)
            continue
        text = format_status(snapshot, width=max(20, width() - 1))
        if text != shown:
            update(text)
            shown = text
