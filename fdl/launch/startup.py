"""What ``fdl run`` skips to start its workers sooner than torchrun does.

Both are pauses torch.distributed.elastic takes that do nothing for the launcher: full garbage
collections while torch is imported, and, on one node, the random wait before the first
rendezvous. docs/run.md "Launch latency" has the measurements; ``scripts/bench-launch`` the
comparison with torchrun.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def torch_import_without_collections() -> Iterator[None]:
    """Import torch with the cyclic garbage collector paused, then freeze what was imported.
    Importing torch allocates enough objects to set off full collections, each one walking
    everything imported so far: 0.3 to 0.45 s of a 1.0 to 1.4 s import on a 2-core VM, all
    before the first worker starts. Frozen, torch's modules are never walked again by the
    collections of the agent's loop. Only in a process that has not imported torch yet."""
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


@contextmanager
def no_join_stagger() -> Iterator[None]:
    """Without torch's random pause of 0 to 0.3 s before a node first joins: it staggers the
    nodes' joins so that they do not all hit the store at once, and the loopback handler serves
    one node, which has nobody to stagger against: 0.15 s of every one-node launch on average
    (docs/run.md "Launch latency"). Other pauses are kept."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    delay = getattr(dynamic_rendezvous, "_delay", None)
    if delay is None:  # a torch without it: nothing to skip
        yield
        return

    def delay_unless_stagger(seconds: float | tuple[float, float]) -> None:
        if not isinstance(seconds, tuple):  # the stagger is the only (low, high) pause
            delay(seconds)

    dynamic_rendezvous._delay = delay_unless_stagger
    try:
        yield
    finally:
        dynamic_rendezvous._delay = delay
