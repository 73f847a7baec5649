"""fdl: train PyTorch models on the hardware you own.

Importing ``fdl`` is cheap: the training API (``fdl.init`` for a loop of your own,
``fdl.Trainer``, ``fdl.TrainResult``) is loaded on first access, so the command line never pays
for torch.
"""

from __future__ import annotations

from typing import Any

from fdl.version import __version__

__all__ = ["Run", "RunResult", "TrainResult", "Trainer", "__version__", "init"]

_LAZY = {"Trainer": "fdl.engine.trainer", "TrainResult": "fdl.engine.trainer",
         "init": "fdl.engine.loop", "Run": "fdl.engine.loop", "RunResult": "fdl.engine.loop"}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'fdl' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module_name), name)
