"""The cyclic garbage collector while a rank trains.

CPython (3.11) runs a full collection once the objects that survived younger collections since
the last one reach a quarter of those already in the oldest generation. In a process that
imported torch the oldest generation holds everything torch, torch._dynamo and the user's script
made before training, and a full collection walks all of it: a stall in the middle of a round
that finds nothing to free, long enough to show as one slow round on the fast rank of a short
run (docs/bench.md "After training on a frozen heap" has the sweeps and the ``gc.callbacks``
probe that found it). On a GPU such a stall leaves the device without queued work for as long.

:func:`frozen_heap` moves what exists when training starts into the permanent generation
(``gc.freeze``, public API) and puts it back when training ends (``gc.unfreeze``), so a full
collection during training walks only what training made. Garbage is still freed: by reference
count as always, cycles made during training by the collector, and cycles that existed before
training once it ends. The young generations are collected first (cheap), so the freeze keeps
no fresh garbage. A process that froze objects itself, or disabled the collector, is left as it
is.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def frozen_heap() -> Iterator[bool]:
    """Freeze the heap for the ``with`` block; yields whether it did (False: the process had
    frozen objects itself or the collector was disabled, and nothing is touched)."""
    if not gc.isenabled() or gc.get_freeze_count():
        yield False
        return
    gc.collect(1)
    gc.freeze()
    try:
        yield True
    finally:
        gc.unfreeze()
