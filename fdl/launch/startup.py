"""What ``fdl run`` skips to start its workers sooner than torchrun does: the full garbage
collections set off while torch is imported, which do nothing for the launcher. Only public
APIs (``gc.disable``, ``gc.freeze``): torch's own pauses, such as the random stagger before a
node first joins the rendezvous, are left alone, since skipping them meant patching torch's
private internals, which an upgrade breaks silently. docs/run.md "Launch latency" has the
measurements; ``scripts/bench-launch`` the comparison with torchrun.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def torch_import_without_collections() -> Iterator[None]:
    """Import torch with the cyclic garbage collector paused, then freeze what was imported.
    Importing torch allocates enough objects to set off full collections, each one walking
    everything imported so far, a large share of the import and all of it before the first
    worker starts (docs/run.md "Launch latency" has the figures). Frozen, torch's modules are
    never walked again by the collections of the agent's loop. Only in a process that has not
    imported torch yet."""
    import gc

    if "torch" in sys.modules or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()
