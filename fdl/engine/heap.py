"""The cyclic garbage collector while a rank trains.

CPython (3.11 here) runs a full collection once the objects that survived younger collections
since the last one reach a quarter of those already in the oldest generation. In a process that
imported torch the oldest generation holds everything torch, torch._dynamo and the user's script
made before training, and a full collection walks all of it: 130 ms on a 2-core VM, a stall in
the middle of a round that finds nothing to free. fdl bench's quick mlp cell had one on its fast
rank in every El Che run of two sweeps (12 of 12: a round at 1.6-1.8 ms a step among rounds at
0.85, ~8% of a 1.6 s run; a ``gc.callbacks`` probe showed it: a generation-2 collection of 129.6
ms, 0 objects collected), and the solo runs it was compared with had none. On a GPU such a stall
leaves the device without queued work for as long.

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
