"""What ``run.batches`` refuses before anything trains, each a ``UsageError`` that says what was
wrong and what to do instead: a model still wrapped in DDP or FSDP, an optimizer that steps
parameters outside the model, a collective in every step under cadence and async, an
``accumulate`` that is no whole number, a budget with no whole batch; and the one warning, a
torch LR scheduler the ranks would step at their own pace. Every rank runs the same checks on
the same values, so every rank stops alike.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import nn

from fdl.engine.data import TrainData
from fdl.engine.policies import Policy
from fdl.errors import UsageError

#: wrappers that run collectives of their own in forward or backward (torch's DDP and FSDP)
COLLECTIVE_WRAPPERS = ("DistributedDataParallel", "FullyShardedDataParallel", "FSDPModule")


def whole_batches(budget: int | None, train: TrainData | None, batch_size: int) -> int | None:
    """A sample budget cut to whole batches when ``train`` drops the last partial batch (its
    last step would otherwise take the rest); UsageError when none is left."""
    if budget is None or train is None or not train.drop_last:
        return budget
    if budget < batch_size:
        raise UsageError(f"a budget of {budget} samples holds no whole batch of {batch_size}, "
                         "and drop_last trains on whole batches only",
                         hint="raise max_samples, or leave drop_last off")
    return budget - budget % batch_size


def check_accumulate(accumulate: Any) -> None:
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise UsageError(f"accumulate must be a whole number >= 1, got {accumulate!r}")


def check_model_and_optimizer(model: Any, optimizer: Any) -> None:
    """Refuse a ``model`` that is no ``torch.nn.Module``, or an ``optimizer`` with no
    ``param_groups`` and ``step`` (an optimizer wrapper that has both is taken as one):
    ``run.batches(model=None)`` raised AttributeError inside fdl."""
    problem = None
    if not isinstance(model, nn.Module):
        problem = f"run.batches' model is {type(model).__name__}, not a torch.nn.Module"
    elif not (hasattr(optimizer, "param_groups") and callable(getattr(optimizer, "step", None))):
        problem = f"run.batches' optimizer is {type(optimizer).__name__}, not an optimizer " \
                  f"(a torch.optim.Optimizer: param_groups and step())"
    if problem is not None:
        raise UsageError(problem, hint="run.batches(data, model=model, optimizer=optimizer, ...) "
                                       "with the model being trained and its optimizer")


def check_unwrapped(model: nn.Module) -> None:
    """Refuse a model that is, or holds, a DDP or FSDP wrapper (a torchrun script's leftover):
    its all-reduce in every backward would meet another rank's only while every rank steps
    alike, so cadence and async (ranks step unequally) hang there, and under sync the
    gradients would be averaged twice. Read by class name, so FSDP is never imported."""
    for module in model.modules():
        wrapper = next((cls.__name__ for cls in type(module).__mro__
                        if cls.__name__ in COLLECTIVE_WRAPPERS), None)
        if wrapper is not None:
            raise UsageError(
                f"the model is wrapped in {wrapper}: fdl averages the replicas itself, and the "
                f"wrapper's all-reduce in every backward would hang cadence and async (ranks "
                f"take different numbers of steps) and average sync's gradients twice",
                hint="build the model without the wrapper (its .module), and call that one "
                     "in the loop")


def check_optimized(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that steps parameters outside ``model`` (a learnable temperature or
    a head kept beside it): fdl averages, checkpoints and restores the model's parameters
    only, so the ranks' copies of those would drift apart, silently."""
    own = {id(parameter) for parameter in model.parameters()}
    outside = [parameter for group in getattr(optimizer, "param_groups", [])
               for parameter in group["params"] if id(parameter) not in own]
    if outside:
        shapes = ", ".join(str(list(parameter.shape)) for parameter in outside[:3])
        raise UsageError(
            f"the optimizer steps {len(outside)} parameter(s) outside the model (shape "
            f"{shapes}{', ...' if len(outside) > 3 else ''}): fdl averages, checkpoints and "
            f"restores the model's parameters only, so each rank's copy would drift apart",
            hint="give run.batches a module that holds them all, e.g. "
                 "nn.ModuleDict({'net': model, 'loss': loss_module}), or register them on the "
                 "model (model.register_parameter)")


def streaming(data: Any) -> bool:
    """Whether ``data`` is data without ``len()`` that run.batches streams (fdl.engine.shards):
    an IterableDataset, a list of shard paths, or a stream."""
    from torch.utils.data import IterableDataset

    from fdl.engine.shards import IterableStream, ShardStream

    return isinstance(data, (IterableDataset, ShardStream, IterableStream)) or (
        isinstance(data, (list, tuple)) and bool(data)
        and all(isinstance(item, (str, os.PathLike)) for item in data))


def scheduler_warning(optimizer: torch.optim.Optimizer, policy: Policy) -> str | None:
    """What to say (rank 0, once) of a torch LR scheduler made on ``optimizer`` when the ranks
    step unequally (cadence, async, auto's calibration): stepped every batch, the fast rank
    runs through its schedule sooner, and a OneCycleLR sized by one rank's batches raises on
    the fast rank once it passes its total. torch's schedulers leave ``initial_lr`` in every
    param group they are made on; a scheduler stepped at epoch ends, which every rank reaches
    alike, is fine. None: nothing to say."""
    if not (policy.local_steps or policy.decides) or not any(
            "initial_lr" in group for group in getattr(optimizer, "param_groups", [])):
        return None
    return (f"an LR scheduler was made on the optimizer: under --policy {policy.name} each rank "
            "steps at its own pace, so a scheduler stepped every batch runs through its "
            "schedule sooner on the fast rank (and OneCycleLR stops it once it passes its "
            "total): hand it to run.batches(..., scheduler=) and fdl steps it once per global "
            "step on every rank, step it at epoch ends (run.at_epoch_end), or set the LR "
            "from run.progress, which every rank shares")


def refuse_collectives_in_steps(model: nn.Module, optimizer: torch.optim.Optimizer, *,
                                policy: str) -> None:
    """Under cadence and async ranks run different numbers of steps between averages, so a
    collective inside a step (SyncBatchNorm's statistics, a sharded optimizer's broadcasts)
    waits for a peer that is not there and hangs the run. Refuse what fdl can see, before any
    step: every rank runs this on the same model and stops alike.

    ZeroRedundancyOptimizer is looked up among the modules already imported, never imported
    here: a script that uses one has imported it, and a run that does not need not pay for
    ``torch.distributed.optim``'s import."""
    optim = sys.modules.get("torch.distributed.optim")
    zero = getattr(optim, "ZeroRedundancyOptimizer", None)
    sync_bn = next((name for name, module in model.named_modules()
                    if isinstance(module, nn.SyncBatchNorm)), None)
    if sync_bn is not None:
        raise UsageError(f"the model's {sync_bn or 'top module'} is a SyncBatchNorm, whose "
                         f"collective in every step hangs under --policy {policy} (ranks run "
                         "different numbers of steps)",
                         hint="use nn.BatchNorm (fdl averages its statistics with the model) "
                              "or --policy sync")
    if zero is not None and isinstance(optimizer, zero):
        raise UsageError(f"ZeroRedundancyOptimizer's collectives in every step hang under "
                         f"--policy {policy} (ranks run different numbers of steps)",
                         hint="use a plain optimizer (fdl averages the replicas) or "
                              "--policy sync")
