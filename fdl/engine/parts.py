"""The parts of one rank's run, built once (fdl.engine.assembly) and called by the round loop
(fdl.engine.rounds, fdl.engine.boundary): the replica, the feed of batches, the tallies, the
evaluator, the recorder, the checkpointer, the timeline and the live progress. No part calls
back into the run that owns them: what the round needs of the script's registrations is
:class:`ScriptHooks`, one small protocol (fdl.engine.loop.Run implements it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fdl.engine.config import EngineConfig
from fdl.engine.evaluation import Evaluator
from fdl.engine.feed import Feed
from fdl.engine.plan import PlanConfig
from fdl.engine.recorder import Recorder
from fdl.engine.recovery import Checkpointer, Saving
from fdl.engine.replica import Replica
from fdl.engine.tallies import Tallies
from fdl.rundir.progress import ProgressFile
from fdl.rundir.timeline import Timeline


class ScriptHooks(Protocol):
    """What the round needs of the script's registrations (fdl.engine.loop.Run)."""

    def averaged(self) -> None:
        """An average has landed in the model (``run.after_average``'s functions)."""

    def epoch_ended(self, record: dict[str, Any]) -> None:
        """An epoch's record, on its consensus model (``run.at_epoch_end``'s functions)."""

    def user_state(self) -> dict[str, Any]:
        """``run.state``'s objects by name, for a checkpoint."""


@dataclass(eq=False)
class Parts:
    """One rank's parts (see the module docstring). ``config`` is the run's settings as the
    round applies them (``--policy auto``'s choice replaces its policy)."""

    config: EngineConfig
    plan_config: PlanConfig
    replica: Replica
    feed: Feed
    tallies: Tallies
    evaluator: Evaluator
    recorder: Recorder
    checkpointer: Checkpointer | None
    timeline: Timeline
    progress: ProgressFile | None  # rank 0's live progress, when fdl run shows it
    script: ScriptHooks
    precisions: list[str]  # every rank's (fp32, bf16, fp16)
    evaluate_every: int | None = None  # samples between evaluations within an epoch
    verify: bool = False  # FDL_VERIFY_REPLICAS: blocking averages log the model's checksum
    utilisation: Any = None  # local rank 0's utilisation sampler (fdl.engine.utilisation)

    @property
    def rank(self) -> int:
        return self.replica.rank

    @property
    def world_size(self) -> int:
        return self.replica.world_size

    @property
    def device(self) -> torch.device:
        return self.replica.device

    def saving(self) -> Saving:
        """What a checkpoint is taken of now."""
        return Saving(self.replica, self.tallies, self.timeline, self.recorder.history,
                      self.script.user_state())

    def close(self) -> None:
        """Training is over or failed: the hooks, the loader's workers and the sampler
        stopped."""
        self.replica.close()
        self.feed.close()
        if self.utilisation is not None:
            self.utilisation.stop()
            self.utilisation = None
