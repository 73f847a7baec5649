"""``model.pt``: the consensus model's ``state_dict`` on the CPU, written by rank 0 at the end
of a run (``torch.load(path, weights_only=True)`` reads it back)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fdl.files import atomic_replace

FILE = "model.pt"


def save_model(run_dir: Path, model: Any) -> Path:
    """Write ``model``'s ``state_dict`` (on the CPU) to ``run_dir/model.pt`` atomically."""
    import torch

    path = run_dir / FILE
    with atomic_replace(path) as tmp:
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, tmp)
    return path
