"""This rank's replica: the script's model and optimizer, and what the engine binds to them for
the run's policy.

:meth:`Replica.build` makes it from explicit values: every rank checks it trains what rank 0
trains (fdl.engine.agreement) and takes rank 0's weights; from there each rank draws its own
random streams (dropout, augmentation: the same masks on every rank would waste replicas). It
then binds what the policy needs:

* sync's gradient all-reduce (fdl.engine.grad_sync): DDP's wrapper for ``fdl.Trainer``
  (``ddp``), the hook reducer for a loop script, nothing under cadence and async;
* the averaging buffers (fdl.engine.averaging): parameters and buffers under cadence and async
  (async: with a snapshot of the packed replica), buffers only under sync (DDP keeps the
  parameters identical); the outer optimizer (fdl.engine.outer) when asked for;
* the watch on the optimizer's steps (fdl.engine.steps).

``--policy auto`` starts as cadence; when it has chosen, :meth:`Replica.adopt` binds what the
chosen policy needs (right after a blocking average: every replica holds the same model).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fdl.engine.agreement import agree, data_facts
from fdl.engine.averaging import Averager
from fdl.engine.checks import refuse_collectives_in_steps
from fdl.engine.collectives import Group, broadcast_from_rank0
from fdl.engine.config import EngineConfig
from fdl.engine.ddp_sync import DdpSync
from fdl.engine.grad_sync import GradSync, NoGradSync
from fdl.engine.hook_sync import HookSync
from fdl.engine.policies import Policy
from fdl.engine.state import NUM_STATS
from fdl.engine.steps import DrivenScheduler, StepWatch
from fdl.errors import UsageError


@dataclass(eq=False)
class Replica:
    """This rank's model, its optimizer and what steps and averages them."""

    rank: int
    world_size: int
    device: torch.device
    group: Group
    config: EngineConfig
    model: nn.Module
    optimizer: torch.optim.Optimizer
    ddp: bool  # fdl.Trainer's: sync steps through DDP's wrapper
    sync: GradSync
    averager: Averager | None
    steps: StepWatch  # the optimizer steps the script took
    scheduler: DrivenScheduler | None = None  # run.batches(scheduler=): stepped by the engine
    # Each param group's LR as the optimizer was made (before a checkpoint is loaded, whose
    # optimizer state holds the LR already scaled): the guard's LR scale is the LR over these.
    base_lrs: list[float] = field(default_factory=list)

    @classmethod
    def build(cls, model: nn.Module, optimizer: torch.optim.Optimizer, *, config: EngineConfig,
              group: Group, rank: int, world_size: int, device: torch.device, ddp: bool,
              data: Any, seed_after: int) -> Replica:
        """The replica of ``model`` (see the module docstring); ``data`` is what the ranks
        agree on (None for a stream), ``seed_after`` this rank's seed from here on."""
        if not isinstance(model, nn.Module) or not isinstance(optimizer, torch.optim.Optimizer):
            raise UsageError("run.batches(..., model=, optimizer=) takes the nn.Module and the "
                             "torch.optim.Optimizer the loop trains with")
        distributed = world_size > 1
        if distributed:  # the same data and model everywhere, before rank 0's weights go out
            agree(data_facts(data, model, seed=config.seed), world_size=world_size)
            broadcast_from_rank0([t.data for t in (*model.parameters(), *model.buffers())],
                                 via_host=group.backend != "nccl", group=group.process_group)
        torch.manual_seed(seed_after)
        policy = config.policy
        if distributed and policy.local_steps:
            refuse_collectives_in_steps(model, optimizer, policy=policy.name)
        replica = cls(rank=rank, world_size=world_size, device=device, group=group,
                      config=config, model=model, optimizer=optimizer, ddp=ddp,
                      sync=NoGradSync(model), averager=None, steps=StepWatch.on(optimizer),
                      base_lrs=[g["lr"] for g in optimizer.param_groups])
        if distributed and policy.syncs_gradients:
            replica.sync = replica._grad_sync()
        replica.averager = replica._averager(policy) if distributed else None
        return replica

    @property
    def step_model(self) -> nn.Module:
        """The module a step calls: DDP's wrapper under sync in fdl.Trainer, else the model."""
        return self.sync.step_model

    def adopt(self, policy: Policy) -> None:
        """``--policy auto`` chose ``policy``: bind what it needs (sync: the gradient
        all-reduce, buffers-only averaging; async: the snapshot)."""
        if policy.syncs_gradients:
            self.sync = self._grad_sync()
        if self.averager is not None and (policy.syncs_gradients or policy.background):
            self.averager = self._averager(policy)

    def lr_scale(self) -> float:
        """The optimizer's LR now over its LR when the run began (the first param group's)."""
        if not self.base_lrs or not self.base_lrs[0]:
            return 1.0
        return float(self.optimizer.param_groups[0]["lr"]) / self.base_lrs[0]

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of it besides the model: the optimizer's state and the
        outer optimizer's momentum."""
        state: dict[str, Any] = {"optimizer": self.optimizer.state_dict()}
        if self.averager is not None and self.averager.outer is not None:
            state["outer"] = self.averager.outer.state_dict()
        return state

    def close(self) -> None:
        """Training is over: the step hooks removed, DDP's wrapper dropped."""
        self.steps.close()
        self.sync.close()

    def _grad_sync(self) -> GradSync:
        """Sync's gradient all-reduce: with ``ddp`` (fdl.Trainer) DDP's wrapper, metered under
        the slowdown emulation (which must sleep on compute only); in a loop script, the hook
        reducer."""
        group, slowdown = self.group, self.config.simulate_slowdown
        if not self.ddp:
            return HookSync(self.model, self.optimizer, device=self.device,
                            via_host=group.backend != "nccl", process_group=group.process_group)
        return DdpSync(self.model, process_group=group.process_group, device=self.device,
                       metered=slowdown is not None and any(f != 1 for f in slowdown))

    def _averager(self, policy: Policy) -> Averager:
        """The averaging buffers ``policy`` needs (sync: buffers only; async: a snapshot)."""
        config, group = self.config, self.group
        outer = None if config.outer_optimizer == "none" else (config.outer_lr,
                                                               config.outer_momentum)
        return Averager(self.model, rank=self.rank, world_size=self.world_size,
                        backend=group.backend, device=self.device, num_stats=NUM_STATS,
                        group=group.process_group, params=policy.averages_params,
                        snapshot=policy.background, wire=config.average_dtype, outer=outer)
