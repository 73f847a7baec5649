"""Evaluation of the consensus model: each rank takes a contiguous shard of the eval set in
proportion to its speed, and the batch-size-weighted sums are all-reduced, so the result is
the mean over every sample.

:class:`Evaluator` holds the sets ``run.evaluate`` gave (checked as they are given), evaluates
them together at the points the round loop calls it (every epoch's end, and every N global
steps when asked) and keeps the last metrics and the time evaluations took (left out of the
throughput).

Equal shards leave a fast rank idle while a slow one finishes: with a GPU three times as fast
as its peer, 2/3 of its evaluation time. :func:`weighted_shard` gives rank r a share
proportional to ``weights[r]`` (its measured samples/s), in whole batches.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fdl.engine.collectives import collective_device
from fdl.engine.data import TrainData, batch_size_of, fetch_batches, index_batches, to_device
from fdl.engine.plan import PlanState, RoundPlan
from fdl.engine.user_collectives import refused
from fdl.errors import UsageError
from fdl.ranges import shortened


@dataclass(frozen=True)
class EvalSet:
    """One set of ``run.evaluate``: its data, ``fn(model, batch) -> {name: mean}``, ``derive``
    (whole-set metrics of the means) and a later set's ``name`` (its metrics ``name/metric``)."""

    data: Any
    fn: Callable[[nn.Module, Any], dict[str, float]]
    derive: Callable[[dict[str, float]], Any] | None = None
    name: str | None = None


@dataclass(eq=False)
class Evaluator:
    """The run's evaluation sets, evaluated together (see the module docstring)."""

    rank: int
    world_size: int
    device: torch.device
    sets: list[EvalSet] = field(default_factory=list)
    every: int | None = None  # global steps between evaluations within an epoch
    last: dict[str, float] = field(default_factory=dict)  # the last evaluation's metrics
    eval_s: float = 0.0  # the time evaluations took

    def add(self, data: Any, fn: Callable[[nn.Module, Any], dict[str, float]], *,
            every: int | None, derive: Callable[[dict[str, float]], Any] | None,
            name: str | None) -> None:
        """Another set (``run.evaluate``'s arguments, checked: a UsageError says what is
        wrong); every set is evaluated at the first set's points."""
        if not callable(fn):
            raise UsageError("run.evaluate(data, fn) takes fn(model, batch) -> dict of means")
        if derive is not None and not callable(derive):
            raise UsageError("run.evaluate(..., derive=fn) takes fn(means) -> dict of metrics, "
                             f"got {type(derive).__name__}")
        if every is not None and (isinstance(every, bool) or not isinstance(every, int)
                                  or every < 1):
            raise UsageError(f"run.evaluate(..., every=N) takes a whole number of steps >= 1, "
                             f"got {every!r}")
        if name is not None and (not isinstance(name, str) or not name.isidentifier()):
            raise UsageError(f"run.evaluate(..., name=) takes a name of letters, digits and _ "
                             f"(not first a digit), got {name!r}")
        if self.sets and (name is None or name in [given.name for given in self.sets]):
            said = "without a name" if name is None else f"named {name!r}"
            raise UsageError(f"run.evaluate(...) was already called {said}: each further set "
                             "needs a name of its own (its metrics are recorded as name/metric)",
                             hint="run.evaluate(val_set, fn) then run.evaluate(train_sample, "
                                  "fn, name='train')")
        if self.sets and every is not None and every != self.every:
            points = f"each {self.every} steps" if self.every else "at epoch ends only"
            raise UsageError(f"run.evaluate(..., every={every}): every set is evaluated at "
                             f"the same points, {points} here (the first call's every)",
                             hint="leave every to the first call")
        size = _size_of(data)
        if size == 0:
            raise UsageError(f"run.evaluate's {'set ' + repr(name) if name else 'data'} holds no "
                             "sample: it would give no metric", hint="pass the evaluation set "
                                                                     "(a dataset or DataLoader "
                                                                     "with samples)")
        if not self.sets:
            self.every = every
        self.sets.append(EvalSet(data, fn, derive, name))

    def every_samples(self, step_samples: int) -> int | None:
        """The samples between evaluations within an epoch (None: at epoch ends only)."""
        return self.every * step_samples if self.sets and self.every else None

    def evaluate(self, model: nn.Module, state: PlanState, *, batch_size: int) -> None:
        """Evaluate ``model`` (the consensus) on every set, sharded by the ranks' measured
        speed (the same on every rank: the fast rank takes more); its time kept apart."""
        begin = time.perf_counter()
        evaluated: dict[str, float] = {}
        for given in self.sets:
            means = evaluate_model(
                model, given.data, given.fn, batch_size=batch_size, device=self.device,
                rank=self.rank, world_size=self.world_size, derive=given.derive,
                weights=[1 / ms for ms in state.ms_per_sample] if state.calibrated else None)
            evaluated.update(means if given.name is None
                             else {f"{given.name}/{key}": v for key, v in means.items()})
        if self.sets:
            self.last = evaluated
        self.eval_s += time.perf_counter() - begin


def _size_of(data: Any) -> int | None:
    """How many samples ``data`` holds (a DataLoader's dataset's), None when it does not say."""
    held = getattr(data, "dataset", data)
    try:
        return len(held)
    except TypeError:
        return None


def evaluation_due(every_samples: int | None, plan: RoundPlan, state: PlanState) -> bool:
    """Whether ``plan`` crosses a multiple of ``every_samples`` (the same on every rank: it is
    the plan's). An epoch's end evaluates anyway."""
    if every_samples is None or plan.last_in_epoch:
        return False
    return (state.samples_seen + plan.num_samples) // every_samples > \
        state.samples_seen // every_samples


def weighted_shard(size: int, *, weights: Sequence[float], rank: int,
                   batch_size: int = 1) -> tuple[int, int]:
    """Rank ``rank``'s contiguous share ``[start, stop)`` of ``size`` items, the shares in
    rank order and in proportion to ``weights`` (one per rank, >= 0, not all 0).

    The ``ceil(size / batch_size)`` batches are dealt by largest remainder (exact fractions),
    so every share is whole batches but the one that ends at ``size``, and each rank's batch
    count is within one of its exact proportion. A rank of weight 0 gets nothing, any rank may
    get nothing, and every item is in exactly one share. Pure: every rank must pass the same
    ``weights`` to get shares that fit together.
    """
    if size < 0 or batch_size < 1:
        raise ValueError(f"weighted_shard: size = {size}, batch_size = {batch_size}: need "
                         f"size >= 0 and batch_size >= 1")
    if not 0 <= rank < len(weights):
        raise ValueError(f"weighted_shard: rank {rank} has no weight among {len(weights)}")
    if not all(math.isfinite(w) and w >= 0 for w in weights) or not any(weights):
        raise ValueError(f"weighted_shard: weights = {list(weights)}: need finite numbers "
                         f">= 0, not all 0")
    counts = _batch_counts(-(-size // batch_size), weights)
    start = min(size, sum(counts[:rank]) * batch_size)
    return start, min(size, start + counts[rank] * batch_size)


def _batch_counts(num_batches: int, weights: Sequence[float]) -> list[int]:
    """``num_batches`` dealt in proportion to ``weights``: each its quota's floor, and the
    rest one each to the largest remainders (the lower rank first among equals)."""
    exact = [Fraction(w) for w in weights]
    quotas = [num_batches * w / sum(exact) for w in exact]
    counts = [math.floor(quota) for quota in quotas]
    by_remainder = sorted(range(len(quotas)), key=lambda r: (counts[r] - quotas[r], r))
    for r in by_remainder[:num_batches - sum(counts)]:
        counts[r] += 1
    return counts


@torch.no_grad()
def evaluate_model(model: nn.Module, data: Any,
                   evaluate: Callable[[nn.Module, Any], dict[str, float]], *, batch_size: int,
                   device: torch.device, rank: int, world_size: int,
                   weights: Sequence[float] | None = None,
                   derive: Callable[[dict[str, float]], Any] | None = None) -> dict[str, float]:
    """The mean of each of ``evaluate``'s metrics over every sample of ``data`` (a dataset, a
    DataLoader, a TrainData), each rank evaluating its :func:`weighted_shard` (``weights``:
    the same on every rank; None: equal). A DataLoader's batch size wins over ``batch_size``,
    and its collate_fn and workers are used. Each metric is averaged over the samples of the
    batches that returned it. ``derive(means) -> {name: number}`` adds metrics computed from
    those means over the whole set (F1 from the rates of true and false positives: a mean of
    each batch's F1 is not the set's), the same on every rank."""
    data = TrainData.of(data, name="eval_data")
    batch_size = data.batch_size or batch_size
    equal = [1.0] * world_size
    start, stop = weighted_shard(len(data), weights=equal if weights is None else weights,
                                 rank=rank, batch_size=batch_size)
    with refused(lambda: "an evaluation runs (each rank evaluates a shard of its own size)"
                 if world_size > 1 else None):
        sums, counts = _shard_sums(model, data, evaluate, device=device, batches=index_batches(
            torch.arange(len(data)), start=start, stop=stop, batch_size=batch_size))
    if world_size > 1:
        sums, counts = _summed_over_ranks(sums, counts, device=device, world_size=world_size)
    means = {key: sums[key] / counts[key] for key in sorted(sums) if counts[key]}
    return means if derive is None else {**means, **derived(derive, means)}


def derived(derive: Callable[[dict[str, float]], Any], means: dict[str, float]) -> dict[str, float]:
    """``derive``'s metrics from ``means`` (a copy: it cannot change them), checked by
    :func:`metrics_of`."""
    return metrics_of(derive(dict(means)), who="run.evaluate's derive",
                      example="derive=lambda means: {'f1': ...}")


def metrics_of(found: Any, *, who: str, example: str) -> dict[str, float]:
    """What an evaluation function returned, as metric names with floats: a mapping of names
    (str) to real numbers (an int that fits a float, a float, a one-element tensor), or one
    UsageError naming what ``who`` returned and what it must return."""
    if not isinstance(found, Mapping):
        raise UsageError(f"{who} returned {_shown(found)}; it returns a dict of metric names "
                         "to numbers", hint=example)
    values = {}
    for key, value in found.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        number = None
        if isinstance(key, str) and isinstance(value, (int, float)) and \
                not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an int past float's range
                number = None
        if number is None:
            raise UsageError(f"{who} returned {key!r}: {_shown(value)}; it returns metric names "
                             "(str) with numbers (an int, a float or a one-element tensor)",
                             hint=example)
        values[key] = number
    return values


def _shown(value: Any) -> str:
    """A value for an error line: :func:`fdl.ranges.shortened` and its type (a tensor by its
    shape)."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"{shortened(value)} (a {type(value).__name__})"


def _shard_sums(model: nn.Module, data: TrainData,
                evaluate: Callable[[nn.Module, Any], dict[str, float]], *,
                device: torch.device,
                batches: list[torch.Tensor]) -> tuple[dict[str, float], dict[str, int]]:
    """Each metric's batch-size-weighted sum over the shard, and its number of samples."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    was_training = model.training
    model.eval()
    try:
        for batch in fetch_batches(data, batches):
            size = batch_size_of(batch)
            found = metrics_of(evaluate(model, to_device(batch, device)),
                               who="run.evaluate's function",
                               example="def evaluate(model, batch): return {'loss': loss.item()}")
            for key, value in found.items():
                sums[key] = sums.get(key, 0.0) + value * size
                counts[key] = counts.get(key, 0) + size
    finally:
        model.train(was_training)
    return sums, counts


def _summed_over_ranks(sums: dict[str, float], counts: dict[str, int], *,
                       device: torch.device,
                       world_size: int) -> tuple[dict[str, float], dict[str, int]]:
    """Every rank's sums and counts added up, over the union of the metrics the ranks saw (a
    rank with an empty shard saw none)."""
    seen: list[list[str] | None] = [None] * world_size
    dist.all_gather_object(seen, sorted(sums))
    keys = sorted({key for names in seen for key in names or []})
    totals = torch.tensor([sums.get(k, 0.0) for k in keys] + [counts.get(k, 0) for k in keys],
                          dtype=torch.float64, device=collective_device(device))
    dist.all_reduce(totals)
    values = totals.tolist()
    return ({key: values[i] for i, key in enumerate(keys)},
            {key: int(values[len(keys) + i]) for i, key in enumerate(keys)})
