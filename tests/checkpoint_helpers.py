"""A checkpoint written in-process by a single worker, for the tests of fdl.rundir.checkpoints
(tests/engine/test_checkpoint.py) and of the checkpoints it refuses
(tests/faults/test_checkpoint_faults.py). Kept out of tests/helpers.py, which the CLI tests
import: this module loads torch."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from fdl.engine.state import RankState
from fdl.rundir import checkpoints as ckpt


def solo_gather(obj: object) -> list[object]:
    """``gather`` of a world of one: every rank's object is this rank's."""
    return [obj]


def write_solo_checkpoint(run_dir: Path, *, round_index: int, value: float | None = None) -> Path:
    """Write the checkpoint of round ``round_index`` under ``run_dir`` as rank 0 of 1 and return
    its directory: a 4x4 weight filled with ``value`` (``round_index`` when None, so that each
    checkpoint's model differs), a rank file laid out as fdl.engine.recovery writes it (an
    optimizer state holding the round, the RNG states, a fresh RankState), and an engine state
    naming the round as its epoch. Through ckpt.write_checkpoint, so the staging, manifest and
    pruning are the real ones."""
    fill = float(round_index) if value is None else value
    model = {"weight": torch.full((4, 4), fill)}
    rank_state = {"optimizer": {"step": round_index},
                  "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
                  "rank_state": RankState().to_dict()}
    return ckpt.write_checkpoint(run_dir, round_index=round_index, rank=0, world_size=1,
                                 model_state=model, rank_state=rank_state,
                                 engine_state={"epoch": round_index, "history": []},
                                 gather=solo_gather)
