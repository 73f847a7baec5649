"""Where a run that did not finish stopped, from what it left on this node: the last round the
lowest rank here (rank 0 on its node) recorded in its timeline, the run's epochs from
``config.json``'s engine section, and the newest checkpoint written. ``fdl run`` says it in its
one line after Ctrl-C; ``fdl report`` marks a partial run with it.

A run whose script never trained with fdl's engine here has no timeline, and no stop point.
Reading never fails: what cannot be read is left out of the sentence.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fdl.errors import FdlError
from fdl.rundir import checkpoints, timeline
from fdl.rundir import config as run_config
from fdl.rundir.fields import is_int


@dataclass(frozen=True)
class StopPoint:
    epoch: int | None  # 1-based: the epoch of the last round that ended (or resumed in)
    epochs: int | None  # the run's epochs, when config.json says
    round: int | None  # the last round that ended; None: none of this attempt had
    checkpoint: str | None  # the newest checkpoint written (its manifest in place)

    def where(self) -> str:
        """``in epoch 2 of 3 (after round 17)``, as far as it is known."""
        if self.epoch is None:
            return "before its first round ended"
        of = f" of {self.epochs}" if self.epochs is not None else ""
        after = f" (after round {self.round})" if self.round is not None else \
            " (before its first round ended)"
        return f"in epoch {self.epoch}{of}{after}"


def stop_point(run_dir: Path) -> StopPoint | None:
    """Where the run in ``run_dir`` stopped; None when no rank here left a timeline."""
    ranks = timeline.numbered_files(run_dir, timeline.RANK_FILE)
    if not ranks:
        return None
    events = timeline.read_rank_timeline(run_dir, rank=ranks[0][0]).events
    # The epoch it was in: after its last round's, its last epoch end's, or where it started
    # (each event's "epoch" counts from 0, but an epoch end's counts the epochs done).
    begun = [e["epoch"] for e in events if e["kind"] in ("round", "start")
             and is_int(e.get("epoch"))]
    begun += [e["epoch"] for e in events if e["kind"] == "epoch" and is_int(e.get("epoch"))]
    rounds = [e["round"] for e in events if e["kind"] == "round" and is_int(e.get("round"))]
    epochs = _epochs(run_dir)
    epoch = max(begun) + 1 if begun else None
    if epoch is not None and epochs is not None:
        epoch = min(epoch, epochs)  # stopped after its last epoch ended
    return StopPoint(epoch, epochs, rounds[-1] if rounds else None,
                     checkpoints.newest_written(run_dir))


def _epochs(run_dir: Path) -> int | None:
    try:
        config = run_config.read_config(run_dir, hint="")
        epochs = run_config.engine_value(config, "epochs", run_dir=run_dir, hint="")
    except FdlError:  # a config.json fdl cannot use says nothing here
        return None
    return epochs if is_int(epochs) and epochs >= 1 else None
