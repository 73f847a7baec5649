"""El Che in the user's own training loop: ``fdl.init()``, ``run.batches(...)``, ``run.finish()``.

::

    import fdl
    run = fdl.init()                     # under fdl run: joins the group; alone: solo
    model = build_model().to(run.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for batch in run.batches(train_set, model=model, optimizer=optimizer, batch_size=64,
                             epochs=3):
        with run.autocast():             # this rank's precision
            loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step(); optimizer.zero_grad()
        run.log(loss=loss)               # summed on the device, read once per round
    result = run.finish()                # result.model: the consensus, identical on every rank

``run.batches`` is the engine (fdl.engine.rounds): it yields this rank's share of each round on
``run.device``, the script's code between two batches is the step, and between rounds it
averages ``model`` (blocking or in the background, by policy). A round ends on an optimizer
step (fdl.engine.steps), so ``accumulate=k`` makes every step k batches. ``fdl.Trainer``
(fdl.engine.trainer) is a loop written on this API. On entry, every rank takes rank 0's weights
and then draws its own random streams; ``run.progress`` is the run's fraction done, equal on
every rank, what a schedule must use (ranks run different numbers of steps).

What a run is made of, in the order ``batches`` builds it: the settings (``fdl run`` flags >
``FDL_*`` > fdl.toml > the values given here > defaults), the group (at ``init``), the replica
(the model with rank 0's weights, DDP or the gradient all-reduce under sync, the averaging
buffers), the start (fresh, or a checkpoint's with ``fdl run --resume`` or after a restart),
the round loop, and at ``finish`` the summary, the consensus model and the group's end.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fdl.engine.agreement import agree, data_facts, runtime_facts
from fdl.engine.averaging import Averager, checksum
from fdl.engine.batch_loader import BatchLoader
from fdl.engine.collectives import (
    Group,
    Membership,
    broadcast_from_rank0,
    device_label,
    exchange_rows,
    gather_labels,
    group_timeout,
    join_group,
    leave_group,
    pick_device,
)
from fdl.engine.config import EngineConfig, resolve_config
from fdl.engine.data import TrainData
from fdl.engine.ddp_comm import DdpCommMeter
from fdl.engine.epochs import EpochLog
from fdl.engine.grad_sync import GradSync
from fdl.engine.h2d import DeviceCopies
from fdl.engine.heap import frozen_heap
from fdl.engine.liveness import liveness, stop_ticking
from fdl.engine.micro_batches import MicroBatches, micro_for_rank
from fdl.engine.p2p import P2PChoice
from fdl.engine.peers import keep_store
from fdl.engine.plan import (
    PlanConfig,
    PlanState,
    auto_undecided,
    global_step_samples,
    initial_state,
    samples_budget,
)
from fdl.engine.policies import CADENCE, Policy, PolicyChoice
from fdl.engine.precision import autocast, precision_for_rank, resolve_precision
from fdl.engine.recovery import Checkpointer, find_resume_checkpoint, restart_attempt, resume
from fdl.engine.round_messages import group_store
from fdl.engine.rounds import NUM_STATS, Replica, rounds
from fdl.engine.state import RankFigures
from fdl.engine.steps import CountingScaler, DrivenScheduler, StepWatch
from fdl.engine.user_collectives import refused
from fdl.errors import UsageError
from fdl.rundir import config as run_config
from fdl.rundir import metrics
from fdl.rundir.checkpoints import CheckpointEvery
from fdl.rundir.model import save_model
from fdl.rundir.progress import ProgressFile
from fdl.rundir.summary import build_summary, write_summary
from fdl.rundir.timeline import Timeline

# The plan's length for a stream with a time budget alone: the time ends it long before.
STREAM_WITHOUT_SAMPLE_BUDGET = 2**53


@dataclass
class RunResult:
    """What ``run.finish()`` returns on every rank."""

    model: nn.Module  # the consensus model (the script's own module, on its device)
    metrics: dict[str, float]  # the last evaluation
    history: list[dict[str, Any]]  # one record per epoch
    summary: dict[str, Any]  # as written to summary.json
    run_dir: Path | None


def init(*, policy: str | None = None, backend: str | None = None, seed: int | None = None,
         batch_size: int | None = None, epochs: int | None = None,
         precision: str | None = None, checkpoint_every: int | str | None = None,
         tensorboard: str | None = None, max_grad_norm: float | None = None,
         micro_batch_size: int | str | None = None) -> Run:
    """Join the run: under ``fdl run`` this worker's place in the process group (torchrun's
    environment), alone a solo run on the best device. The values given here are the
    script's; ``fdl run`` flags, ``FDL_*`` and fdl.toml win over them (docs/run.md). Seeds
    torch with the run's seed, so a model built next is the same on every rank (rank 0's is
    broadcast anyway when ``batches`` starts)."""
    script = {"policy": policy, "backend": backend, "seed": seed, "batch_size": batch_size,
              "epochs": epochs, "precision": precision, "checkpoint_every": checkpoint_every,
              "tensorboard": tensorboard, "micro_batch_size": micro_batch_size}
    config = resolve_config(script=script, max_grad_norm=max_grad_norm)
    membership = Membership.from_env()
    device = pick_device(membership.local_rank, config.backend)
    mine = resolve_precision(precision_for_rank(config.precision, membership.rank,
                                                membership.world_size), device)
    group = join_group(config.backend, device, membership.world_size,
                       timeout=group_timeout(config.collective_timeout, membership))
    if group.p2p is not None and group.p2p.source == "fdl" and group.p2p.value == "1" and \
            membership.local_rank == 0:
        _console().info(f"NCCL peer-to-peer off on this node: {group.p2p.reason} "
                        "(NCCL_P2P_DISABLE=1; NCCL_P2P_DISABLE=0 forces it on)")
    agree(runtime_facts(config), world_size=membership.world_size)
    keep_store(group_store() if membership.world_size > 1 else None)  # to tell of a failure
    if membership.world_size > 1 and config.policy.local_steps and group_store() is not None:
        liveness(group_store())  # every rank ticks from here on (fdl.engine.liveness)
    torch.manual_seed(config.seed)
    micro = MicroBatches.of(micro_for_rank(config.micro_batch_size, membership.rank,
                                           membership.world_size), device)
    return Run(script=script, config=config, membership=membership, device=device, group=group,
               precision=mine, scaler=CountingScaler(device.type) if mine == "fp16" else None,
               micro_batches=micro)


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s random streams after initialisation (rank 0 keeps ``seed``,
    so a solo run draws what it always drew)."""
    return seed + 1_000_003 * rank


@dataclass
class _Evaluation:
    data: Any
    fn: Callable[[nn.Module, Any], dict[str, float]]
    every: int | None = None  # global steps between evaluations within an epoch
    derive: Callable[[dict[str, float]], Any] | None = None  # metrics of the whole set's means
    name: str | None = None  # a later set's: its metrics are "<name>/<metric>"


@dataclass(eq=False)
class Run:
    """One worker's part of a run; made by :func:`init`.

    * ``device``, ``rank``, ``world_size``: where this worker trains and its place in the group.
    * ``precision`` (``fp32``, ``bf16`` or ``fp16``: ``fdl run --precision``, one per rank or
      ``auto``) and ``autocast()``, the context of the forward pass in it; ``scaler``: an fp16
      rank's GradScaler (None otherwise). Parameters, optimizer state and averages stay fp32.
    * ``progress``: the run's fraction done, in [0, 1], equal on every rank at the same point of
      a round: drive schedules with it (``lr = base * cosine(run.progress)``).
    * ``batches(data, model=, optimizer=, batch_size=, epochs=, accumulate=, max_steps=,
      max_samples=, max_time=)``: the engine (its docstring says what ``data`` may be).
    * ``log(**scalars)``: per-step scalars (the ``loss`` is the epoch's train loss and shown
      live); summed on the device and read once per round.
    * ``evaluate(data, fn, every=None, derive=None, name=None)``: evaluate the consensus model
      at every epoch's end (and every N global steps), sharded over the ranks by their
      measured speed; ``fn(model, batch) -> {name: mean over the batch}``; ``derive(means)``
      adds metrics of the whole set (F1 from the rates of true and false positives); again
      with a ``name``, another set (its metrics ``<name>/<metric>``).
    * ``after_average(fn)``, ``at_epoch_end(fn)``: call ``fn`` when an average lands in the
      model, and with each epoch's record (the model then holds the epoch's consensus; under
      async, which runs through epoch ends, when the epoch's average lands, a round later).
    * ``state(**objects)``: objects with ``state_dict``/``load_state_dict`` (an EMA, a
      GradScaler, a scheduler) saved in checkpoints and loaded on resume.
    * ``micro_parts(batch)``: the batch in this rank's ``--micro-batch`` parts, each with its
      share of the loss (fdl.Trainer computes every batch in them).
    * ``finish()``: the summary, the consensus model and the group's end; a :class:`RunResult`.
    """

    script: dict[str, Any]
    config: EngineConfig
    membership: Membership
    device: torch.device
    group: Group
    precision: str = "fp32"  # this rank's: fp32, bf16 or fp16 (fdl.engine.precision)
    scaler: CountingScaler | None = None  # fp16's GradScaler, this rank's own
    # This rank's micro-batches (fdl.engine.micro_batches): fdl.Trainer computes each batch in
    # them; a loop of its own asks run.micro_parts(batch).
    micro_batches: MicroBatches = field(default_factory=lambda: MicroBatches(None))
    history: list[dict[str, Any]] = field(default_factory=list)
    replica: Replica | None = None
    state_objects: dict[str, Any] = field(default_factory=dict)
    _evaluations: list[_Evaluation] = field(default_factory=list)
    _epochs_log: EpochLog | None = None
    _final: PlanState | None = None
    _started: float = 0.0
    _resumed_from: str | None = None
    _user_state: dict[str, Any] | None = None  # a checkpoint's, for objects registered later
    _sampler: Any = None
    _finished: RunResult | None = None
    _plan_config: PlanConfig | None = None
    _precisions: list[str] = field(default_factory=list)
    _ddp: bool = False  # run.batches(ddp=True): sync steps through DDP's wrapper
    _policy_choice: PolicyChoice | None = None  # --policy auto's, once made
    _after_average: list[Callable[[], None]] = field(default_factory=list)
    _at_epoch_end: list[Callable[[dict[str, Any]], None]] = field(default_factory=list)

    @property
    def rank(self) -> int:
        return self.membership.rank

    @property
    def world_size(self) -> int:
        return self.membership.world_size

    @property
    def progress(self) -> float:
        """The run's fraction done in [0, 1]: samples over the run's samples (its epochs or
        its step or sample budget), or, with a time budget, elapsed over it if further."""
        replica = self.replica
        if replica is None:
            return 0.0
        if self._final is not None:
            return 1.0
        total = self._plan_config.num_samples if self._plan_config else 0
        done = replica.position / total if total else 0.0
        if self.config.max_time:  # a time budget: whichever is further
            done = max(done, replica.elapsed_s() / self.config.max_time)
        return min(1.0, done)

    @property
    def step_model(self) -> nn.Module:
        """The module a step calls: DDP's wrapper under sync in fdl.Trainer, else the model."""
        if self.replica is None:
            raise UsageError("run.step_model exists once run.batches(...) has started")
        return self.replica.step_model

    def micro_parts(self, batch: Any) -> list[tuple[Any, float]]:
        """``batch`` in this rank's micro-batches (``--micro-batch``), each with its share of
        the batch: weight each part's mean loss by it and backward each; ``[(batch, 1.0)]``
        without micro-batches. Under sync a loop's gradients are reduced after the step's
        first backward, so parts are refused there: use ``accumulate=k``."""
        parts = self.micro_batches.parts(batch)
        if len(parts) > 1 and self.replica is not None and \
                isinstance(self.replica.comm_meter, GradSync):
            raise UsageError("micro-batches in a loop of its own under --policy sync: the "
                             "gradients are all-reduced after the step's first backward",
                             hint="run.batches(..., batch_size=B // k, accumulate=k) computes "
                                  "the same step in k parts")
        return parts

    def autocast(self) -> contextlib.AbstractContextManager:
        """This rank's precision for the forward pass (fp32: nothing changes)."""
        return autocast(self.device, self.precision)

    def log(self, **scalars: Any) -> None:
        """Per-step scalars: a number or a one-element tensor each (no wait for the device)."""
        if self.replica is None:
            raise UsageError("run.log(...) is for the steps of run.batches(...)")
        for name, value in scalars.items():
            self.replica.logged.add(name, value)

    def evaluate(self, data: Any, fn: Callable[[nn.Module, Any], dict[str, float]], *,
                 every: int | None = None,
                 derive: Callable[[dict[str, float]], Any] | None = None,
                 name: str | None = None) -> None:
        """Evaluate the consensus model on ``data`` (a dataset or a DataLoader) with ``fn`` at
        every epoch's end and, with ``every=N``, also each N global steps (each ``world_size x
        batch_size x accumulate`` samples, as ``max_steps`` counts them) at the first average
        after them (async makes that one blocking; sync evaluates the replicas DDP keeps
        identical). Call it before ``batches`` starts. Each rank evaluates a share of
        ``data`` in proportion to its measured speed; the means over every sample go to the
        epoch's record, the timeline (``eval`` events), TensorBoard and ``result.metrics``.
        ``derive(means) -> {name: number}`` adds metrics of the whole set computed from those
        means, on every rank: a metric that is no mean of per-batch values (F1) comes from
        means that are (the rates of true positives, false positives and false negatives).
        Call it again with a ``name`` for another set (nanoGPT's train and val splits): each
        set is evaluated at the same points, its metrics recorded as ``<name>/<metric>`` (the
        first set's without a name keep theirs); ``every`` is the first call's."""
        if not callable(fn):
            raise UsageError("run.evaluate(data, fn) takes fn(model, batch) -> dict of means")
        if derive is not None and not callable(derive):
            raise UsageError("run.evaluate(..., derive=fn) takes fn(means) -> dict of metrics, "
                             f"got {type(derive).__name__}")
        if every is not None and (isinstance(every, bool) or not isinstance(every, int)
                                  or every < 1):
            raise UsageError(f"run.evaluate(..., every=N) takes a whole number of steps >= 1, "
                             f"got {every!r}")
        if self.replica is not None:
            raise UsageError("call run.evaluate(...) before run.batches(...) starts")
        if name is not None and (not isinstance(name, str) or not name.isidentifier()):
            raise UsageError(f"run.evaluate(..., name=) takes a name of letters, digits and _ "
                             f"(not first a digit), got {name!r}")
        names = [evaluation.name for evaluation in self._evaluations]
        if self._evaluations and (name is None or name in names):
            said = "without a name" if name is None else f"named {name!r}"
            raise UsageError(f"run.evaluate(...) was already called {said}: each further set "
                             "needs a name of its own (its metrics are recorded as name/metric)",
                             hint="run.evaluate(val_set, fn) then run.evaluate(train_sample, "
                                  "fn, name='train')")
        if self._evaluations:  # every set at the first's points
            first = self._evaluations[0].every
            if every is not None and every != first:
                points = f"each {first} steps" if first else "at epoch ends only"
                raise UsageError(f"run.evaluate(..., every={every}): every set is evaluated at "
                                 f"the same points, {points} here (the first call's every)",
                                 hint="leave every to the first call")
            every = first
        self._evaluations.append(_Evaluation(data, fn, every, derive, name))

    def after_average(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` each time an average has landed in this rank's model (every policy; a
        place for an EMA of the consensus). Under cadence and async the model is then the
        average (async: plus this rank's steps since it was launched)."""
        if not callable(fn):
            raise UsageError("run.after_average(fn) takes a function of no arguments")
        self._after_average.append(fn)

    def at_epoch_end(self, fn: Callable[[dict[str, Any]], None]) -> None:
        """Call ``fn(record)`` at every epoch's end, after the evaluation, with the epoch's
        record (``metrics.jsonl``'s line: loss, eval, throughput; the same on every rank)."""
        if not callable(fn):
            raise UsageError("run.at_epoch_end(fn) takes a function of the epoch's record")
        self._at_epoch_end.append(fn)

    def state(self, **objects: Any) -> None:
        """Put objects with ``state_dict``/``load_state_dict`` into this rank's checkpoints;
        on resume each is loaded (now, when the checkpoint is already read)."""
        for name, obj in objects.items():
            if not (callable(getattr(obj, "state_dict", None))
                    and callable(getattr(obj, "load_state_dict", None))):
                raise UsageError(f"run.state({name}=...) takes an object with state_dict() and "
                                 f"load_state_dict(), got {type(obj).__name__}")
            self.state_objects[name] = obj
            if self._user_state is not None and name in self._user_state:
                obj.load_state_dict(self._user_state[name])

    # ---- the engine ---------------------------------------------------------------------

    def batches(self, data: Any, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                batch_size: int | None = None, epochs: int | None = None,
                max_steps: int | None = None, max_samples: int | None = None,
                max_time: float | str | None = None, accumulate: int = 1,
                open_shard: Callable[[Any], Any] | None = None,
                num_workers: int | None = None,
                collate_fn: Callable[[list[Any]], Any] | None = None,
                pin_memory: bool | None = None, prefetch: int | None = None,
                drop_last: bool | None = None, scheduler: Any = None,
                ddp: bool = False) -> Iterator[Any]:
        """This rank's batches of every round, on ``run.device``; ``model`` is averaged
        between rounds. ``accumulate=k``: the loop steps the optimizer every k batches (a
        step, and the plan's unit, is k batches). A budget ends the run before ``epochs`` do:
        ``max_steps`` global steps (each ``world_size x batch_size x accumulate`` samples, as
        one step of plain DDP, however El Che spreads them), ``max_samples``, or ``max_time``
        (seconds or ``"10m"``: the round after the clocks pass it is the last). ``fdl run
        --epochs/--max-steps/--max-samples/--max-time`` override these.
        ``data`` is a map-style dataset (``len()`` and ``[i]``: each epoch visits every sample
        once, in an order drawn from the seed), or data without ``len()`` that needs a budget:
        a list of shard files (each claimed by one rank once per epoch, read with
        ``open_shard(path) -> samples``, by default one sample per text line), an
        ``IterableDataset`` (each rank iterates its own copy), or a ``fdl.engine.shards``
        stream of the run's batch size.
        Loader options (they win over a DataLoader's): ``num_workers`` processes that fetch
        and collate this rank's batches ahead of the step, kept from round to round;
        ``collate_fn``; ``pin_memory`` (default: on for a CUDA device), so the copy to the
        device does not block; ``prefetch`` batches per worker; ``drop_last`` (a DataLoader's
        by default): every batch whole, an epoch's last partial batch left out (a different
        remainder each epoch) and a sample budget cut to whole batches, for a model that
        refuses a batch of one (BatchNorm) or a compiled one that should see one size.
        ``scheduler``: a torch LR scheduler made on ``optimizer``, stepped by the engine once
        per global step (as ``max_steps`` counts them) before each step, so the script does
        not call its ``step()``; size it with :meth:`total_steps` (as a DDP script sizes it,
        ``epochs x len(data) // (world_size x batch_size x accumulate)``, with fdl run's
        overrides). It goes into checkpoints.
        ``ddp=True`` (fdl.Trainer): under sync the
        step calls ``run.step_model``, DDP's wrapper, instead of averaging gradients in the
        optimizer's step."""
        if self.replica is not None:
            raise UsageError(
                "run.batches(...) runs once per run: this run's batches were already asked for",
                hint="for phases (pretraining, then fine-tuning), loop over one run.batches(...) "
                     "and switch on run.progress or the epoch; or train each phase as its own "
                     "fdl run")
        _check_accumulate(accumulate)
        _check_unwrapped(model)
        _check_optimized(model, optimizer)
        train = None if _streaming(data) else TrainData.of(data)
        options = {"num_workers": num_workers, "collate_fn": collate_fn,
                   "pin_memory": pin_memory, "prefetch": prefetch, "drop_last": drop_last}
        if train is not None:
            train = train.with_options(device=self.device, **options)
        elif any(value is not None for value in options.values()):
            raise UsageError(f"loader options ({', '.join(k for k, v in options.items() if v is not None)}) "
                             f"are for a map-style dataset; streaming data makes its batches "
                             f"as it reads", hint="give the stream's own loader its workers")
        self.config = self._settings(train, batch_size=batch_size, epochs=epochs,
                                     max_steps=max_steps, max_samples=max_samples,
                                     max_time=max_time)
        stream = self._stream(data, open_shard) if train is None else None
        if train is not None:
            self.check_data(train, accumulate=accumulate)
        driven = None if scheduler is None else DrivenScheduler.of(
            scheduler, optimizer,
            samples_per_step=self._global_step(accumulate))
        return self._rounds(train, model, optimizer, accumulate=accumulate, ddp=ddp,
                            stream=stream, scheduler=driven)

    def total_steps(self, data: Any, *, batch_size: int | None = None,
                    epochs: int | None = None, max_steps: int | None = None,
                    max_samples: int | None = None, accumulate: int = 1,
                    drop_last: bool | None = None) -> int:
        """The global steps (``world_size x batch_size x accumulate`` samples each, as
        ``max_steps`` counts them) that ``run.batches`` given the same ``data`` and settings
        will run, ``fdl run``'s ``--epochs``/``--batch-size``/``--max-steps``/``--max-samples``
        applied: the count a scheduler handed to ``run.batches(scheduler=)`` reaches at the
        run's end, so size it with this (a OneCycleLR's ``total_steps``). A time budget may
        end the run sooner; streaming data needs a step or sample budget."""
        _check_accumulate(accumulate)
        train = None if _streaming(data) else TrainData.of(data)
        if train is not None:
            train = train.with_options(device=self.device, drop_last=drop_last)
        config = self._settings(train, batch_size=batch_size, epochs=epochs,
                                max_steps=max_steps, max_samples=max_samples, max_time=None)
        budget = self._sample_budget(config, train, accumulate)
        if train is None and budget is None:
            raise UsageError("streaming data (shards or an IterableDataset) has no length: "
                             "its steps come from a step or sample budget",
                             hint="pass max_steps=N or max_samples=N here and to run.batches")
        samples = budget if train is None else PlanConfig(
            world_size=self.world_size, batch_size=config.batch_size * accumulate,
            dataset_size=train.epoch_samples(config.batch_size), epochs=config.epochs,
            max_samples=budget, policy=config.policy).num_samples
        return samples // global_step_samples(world_size=self.world_size,
                                              batch_size=config.batch_size,
                                              accumulate=accumulate)

    def _sample_budget(self, config: EngineConfig, train: TrainData | None,
                       accumulate: int) -> int | None:
        """The plan's sample budget under ``config`` (its step and sample budgets; None:
        none), cut to whole batches when ``train`` drops the last partial one."""
        return _whole_batches(samples_budget(
            max_steps=config.max_steps, max_samples=config.max_samples,
            world_size=self.world_size, batch_size=config.batch_size, accumulate=accumulate),
            train, config.batch_size)

    def _global_step(self, accumulate: int) -> int:
        """One global step's samples under the run's settings (:func:`global_step_samples`)."""
        return global_step_samples(world_size=self.world_size,
                                   batch_size=self.config.batch_size, accumulate=accumulate)

    def _settings(self, train: TrainData | None, **given: Any) -> EngineConfig:
        """The run's settings for ``run.batches``' values (those given; a DataLoader's batch
        size stands for the script's), under fdl run's flags, FDL_* and fdl.toml."""
        if given.get("batch_size") is None and train is not None and \
                train.batch_size is not None:
            given["batch_size"] = train.batch_size  # a DataLoader's batch size: the script's
        return self._configured(**{k: v for k, v in given.items() if v is not None})

    def _stream(self, data: Any, open_shard: Callable[[Any], Any] | None) -> Any:
        """The stream of batches of data without ``len()`` (:func:`_streaming` said so)."""
        from torch.utils.data import IterableDataset

        from fdl.engine.shards import IterableStream, ShardStream, read_lines

        config = self.config
        if isinstance(data, IterableDataset):
            stream = IterableStream(data, batch_size=config.batch_size)
        elif isinstance(data, (list, tuple)):  # shard paths
            stream = ShardStream(list(data), batch_size=config.batch_size, seed=config.seed,
                                 rank=self.rank, world_size=self.world_size,
                                 open_shard=open_shard or read_lines)
        else:  # a ShardStream or IterableStream the script made
            stream = data
            if stream.batch_size != config.batch_size:
                raise UsageError(f"the stream's batch_size is {stream.batch_size}, the run's "
                                 f"{config.batch_size}", hint="make them the same")
        if config.max_steps is None and config.max_samples is None and config.max_time is None:
            raise UsageError("streaming data (shards or an IterableDataset) has no length: "
                             "give the run a budget",
                             hint="run.batches(..., max_steps=N) or max_samples / max_time, "
                                  "or fdl run --max-steps N")
        return stream

    def _configured(self, **script: Any) -> EngineConfig:
        config = resolve_config(script={**self.script, **script},
                                max_grad_norm=self.config.max_grad_norm)
        # the group is joined: the backend it agreed on stays
        return replace(config, backend=self.config.backend)

    def check_data(self, data: Any, *, accumulate: int = 1) -> None:
        """Raise UsageError unless ``data`` (a dataset, a DataLoader: what it holds) can feed
        every worker a step of this run."""
        train = data if isinstance(data, TrainData) else TrainData.of(data)
        size, needed = train.epoch_samples(self.config.batch_size), self._global_step(accumulate)
        if size < needed:
            whole = " in whole batches (drop_last)" if train.drop_last else ""
            raise UsageError(f"the training data has {size} samples{whole}, fewer than one "
                             f"batch per worker ({self.world_size} x {self.config.batch_size}"
                             + (f" x {accumulate}" if accumulate > 1 else "") + f" = {needed})",
                             hint="use a smaller batch_size or more data")
        slowdown = self.config.simulate_slowdown
        if slowdown is not None and len(slowdown) != self.world_size:
            raise UsageError(f"simulate_slowdown has {len(slowdown)} factor(s) for "
                             f"{self.world_size} worker(s)")

    def _rounds(self, data: Any, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                accumulate: int, ddp: bool, stream: Any,
                scheduler: DrivenScheduler | None = None) -> Iterator[Any]:
        config, run_dir = self.config, self.config.run_dir
        if run_dir is not None and self.rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            run_config.merge_engine(run_dir, {**config.to_dict(),
                                              "resolved_backend": self.group.backend})
        self._sampler = _node_sampler(run_dir, self.membership, device=self.device)
        self._epochs_log = EpochLog(self, config, run_dir if self.rank == 0 else None,
                                    self.rank, self.world_size,
                                    at_epoch_end=self._at_epoch_end)
        loader = BatchLoader(data) if data is not None else None
        self._ddp = ddp
        if self.world_size == 1 and config.policy.decides:  # nothing to measure, nothing to gain
            self._policy_choice = PolicyChoice(CADENCE, "one worker: nothing to average or "
                                               "balance", 0.0, 0.0, 0.0, 0.0)
            config = self.config = replace(config, policy=CADENCE)
        replica = self.replica = self._replica(loader, model, optimizer, accumulate=accumulate,
                                               ddp=ddp, stream=stream)
        replica.scheduler = scheduler
        if scheduler is not None:  # its count goes into checkpoints, and comes back
            self.state_objects["fdl_lr_scheduler"] = scheduler.scheduler
        elif self.rank == 0 and self.world_size > 1:
            _warn_of_a_scheduler(optimizer, config.policy)
        step_size = config.batch_size * accumulate
        budget = self._sample_budget(config, data, accumulate)
        if stream is not None:  # one "epoch" of the budget (a time alone: as good as endless)
            size, epochs = budget or STREAM_WITHOUT_SAMPLE_BUDGET, 1
            budget = None
            self.state_objects["fdl_stream"] = stream  # its position goes into checkpoints
        else:
            size, epochs = data.epoch_samples(config.batch_size), config.epochs
        plan_config = self._plan_config = PlanConfig(
            world_size=self.world_size, batch_size=step_size, dataset_size=size,
            epochs=epochs, max_samples=budget, policy=config.policy,
            overhead_target=config.overhead_target, round_cap=replica.evaluate_every)
        replica.config = replace(config, epochs=epochs)
        self._epochs_log.epochs_total = plan_config.num_epochs
        precisions = gather_labels(self.precision, world_size=self.world_size) \
            if self.world_size > 1 else [self.precision]
        self._precisions = precisions
        if replica.progress is not None:
            replica.progress.precisions = precisions
            replica.progress.epochs = plan_config.num_epochs
            replica.progress.total = plan_config.num_samples
        if self.scaler is not None:
            self.scaler.watch = replica.steps
        state = self._start(replica, plan_config)
        self._started = time.perf_counter()
        self._epochs_log.begin(replica)
        try:
            with frozen_heap(), refused(lambda: _unequal_steps(replica)):
                self._final = yield from rounds(replica, state)
        finally:
            self._epochs_log.close()

    def _replica(self, data: Any, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 accumulate: int, ddp: bool, stream: Any) -> Replica:
        """This rank's replica: ``model`` with rank 0's weights, the sync policy's gradient
        all-reduce, the averaging buffers; from here on each rank draws its own random
        streams (dropout, augmentation: the same masks on every rank would waste replicas)."""
        config, group, device = self.config, self.group, self.device
        rank, world_size = self.rank, self.world_size
        if not isinstance(model, nn.Module) or not isinstance(optimizer, torch.optim.Optimizer):
            raise UsageError("run.batches(..., model=, optimizer=) takes the nn.Module and the "
                             "torch.optim.Optimizer the loop trains with")
        distributed, policy = self.membership.distributed, config.policy
        if distributed:  # the same data and model everywhere, before rank 0's weights go out
            agree(data_facts(data.data if data is not None else None, model, seed=config.seed),
                  world_size=world_size)
            broadcast_from_rank0([t.data for t in (*model.parameters(), *model.buffers())],
                                 via_host=group.backend != "nccl", group=group.process_group)
        torch.manual_seed(rank_seed(config.seed, rank))
        if distributed and policy.local_steps:
            refuse_collectives_in_steps(model, optimizer, policy=policy.name)
        step_model: nn.Module = model
        comm_meter: DdpCommMeter | GradSync | None = None
        if distributed and policy.wraps_ddp:
            step_model, comm_meter = self._sync_step(model, optimizer, ddp=ddp)
        averager = self._averager(model, policy) if distributed else None
        run_dir = config.run_dir
        return Replica(
            rank=rank, world_size=world_size, device=device, model=model,
            step_model=step_model, optimizer=optimizer,
            base_lrs=[g["lr"] for g in optimizer.param_groups], dataset=data, config=config,
            timeline=Timeline(run_dir, rank=rank), averager=averager,
            on_epoch_end=self._epochs_log.epoch_end if self._epochs_log else _no_epoch_end,
            epoch_figures=self._epochs_log.figures if self._epochs_log else None,
            slowdown=config.simulate_slowdown[rank] if config.simulate_slowdown else 1.0,
            comm_meter=comm_meter, steps=StepWatch.on(optimizer), accumulate=accumulate,
            after_average=self._after_average, stream=stream, on_policy=self._chose,
            copies=DeviceCopies.for_device(device) if stream is None else None,
            evaluate_every=(self._evaluations[0].every * self._global_step(accumulate)
                            if self._evaluations and self._evaluations[0].every else None),
            on_evaluate=self._epochs_log.evaluate_now if self._epochs_log else None,
            verify=_verify(),
            on_scalars=self._epochs_log.scalars if self._epochs_log else None,
            progress=ProgressFile.from_env(run_dir, rank=rank, epochs=config.epochs,
                                           epoch_size=len(data) if stream is None else 1,
                                           world_size=world_size),
        )

    def _sync_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                   ddp: bool) -> tuple[nn.Module, DdpCommMeter | GradSync | None]:
        """What a step needs under sync: with ``ddp`` (fdl.Trainer) DDP's wrapper, metered
        under emulation; in a loop script, the gradient all-reduce in the optimizer's step."""
        config, group, device = self.config, self.group, self.device
        if not ddp:
            return model, GradSync(model, optimizer, device=device,
                                   via_host=group.backend != "nccl",
                                   process_group=group.process_group)
        from torch.nn.parallel import DistributedDataParallel

        # Gradients as views of DDP's buckets: no copy into the buckets and back each step, and
        # no second copy of every gradient on the device (the 6 GB card's memory).
        step_model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            process_group=group.process_group, gradient_as_bucket_view=True)
        if config.simulate_slowdown is not None and \
                any(factor != 1 for factor in config.simulate_slowdown):
            # The emulation must sleep on compute only: DDP's all-reduce is timed apart
            # (fdl.engine.ddp_comm). Its Python hook costs ~5% of a step on gloo (measured
            # there), so without emulation DDP keeps its own C++ all-reduce and the
            # all-reduce is inside the step's time, as a plain DDP script measures it.
            return step_model, DdpCommMeter.attach(step_model,
                                                   process_group=group.process_group,
                                                   device=device)
        return step_model, None

    def _averager(self, model: nn.Module, policy: Policy) -> Averager:
        """The averaging buffers ``policy`` needs (sync: buffers only; async: a snapshot)."""
        group = self.group
        return Averager(model, rank=self.rank, world_size=self.world_size,
                        backend=group.backend, device=self.device, num_stats=NUM_STATS,
                        group=group.process_group, params=policy.averages_params,
                        snapshot=policy.background, wire=self.config.average_dtype,
                        outer=self._outer())

    def _outer(self) -> tuple[float, float] | None:
        """The outer optimizer's learning rate and momentum (None: none)."""
        config = self.config
        return None if config.outer_optimizer == "none" else (config.outer_lr,
                                                               config.outer_momentum)

    def _chose(self, replica: Replica, choice: PolicyChoice) -> None:
        """``--policy auto`` chose (fdl.engine.rounds, alike on every rank, right after a
        blocking average: every replica holds the same model): build what the policy needs
        (sync: DDP or the gradient all-reduce, buffers-only averaging; async: the snapshot)
        and say so once."""
        self._policy_choice, policy = choice, choice.policy
        if policy.wraps_ddp:
            replica.step_model, replica.comm_meter = self._sync_step(
                replica.model, replica.optimizer, ddp=self._ddp)
        if replica.averager is not None and (policy.wraps_ddp or policy.background):
            replica.averager = self._averager(replica.model, policy)
        if self.rank == 0:
            _console().info(f"policy auto: {policy.name}: {choice.reason}")

    def _start(self, replica: Replica, plan_config: PlanConfig) -> PlanState:
        """The state training starts from — fresh, or a checkpoint's after a crash or with
        ``fdl run --resume`` (see fdl.engine.recovery). Logs a ``start`` event either way."""
        config, attempt = self.config, restart_attempt()
        run_dir = config.run_dir
        checkpoint, skipped = find_resume_checkpoint(run_dir, rank=replica.rank,
                                                     world_size=replica.world_size)
        state = initial_state(plan_config)
        if checkpoint is not None:
            resumed = resume(checkpoint, replica, plan_config)
            if resumed.state.finished:
                raise UsageError(f"{checkpoint.path} is at epoch {resumed.state.epoch} "
                                 f"({resumed.state.samples_seen} samples) and this run has "
                                 f"{plan_config.epochs} epochs"
                                 + (f" and a budget of {plan_config.max_samples} samples"
                                    if plan_config.max_samples else "")
                                 + ": nothing left to train",
                                 hint=f"pass --epochs N with N > {resumed.state.epoch}, or a "
                                      "larger --max-steps/--max-samples")
            state, self._resumed_from = resumed.state, checkpoint.name
            self.history[:] = resumed.history
            assert self._epochs_log is not None
            self._epochs_log.restore(resumed.history, start_samples=state.samples_seen)
            self._user_state = resumed.user_state
            self.state(**self.state_objects)  # load what is registered already
        if replica.rank == 0 and (attempt > 0 or checkpoint is not None) and run_dir is not None:
            metrics.rewrite_epochs(run_dir, self.history)
            for line in skipped:
                _console().warn(f"checkpoint skipped: {line}")
            if checkpoint is not None:
                _console().info(f"resuming from {checkpoint.path} (epoch {state.epoch}, round "
                                f"{state.round_index})")
        replica.timeline.event("start", attempt=attempt, world_size=replica.world_size,
                               resumed_from=self._resumed_from, epoch=state.epoch,
                               round=state.round_index, skipped=skipped)
        every = CheckpointEvery.parse(config.checkpoint_every)
        if every is not None and run_dir is not None:
            replica.checkpointer = Checkpointer(run_dir, every, self.history,
                                                user_state=self.state_objects)
        return state

    # ---- the end ------------------------------------------------------------------------

    def finish(self) -> RunResult:
        """After the last batch: every rank's figures into ``summary.json``, the consensus
        model saved (rank 0), the group left. Returns the same :class:`RunResult` when called
        again."""
        if self._finished is not None:
            return self._finished
        replica, state, epochs_log = self.replica, self._final, self._epochs_log
        if replica is None or state is None or epochs_log is None:
            raise UsageError("run.finish() comes after the last batch of run.batches(...)",
                             hint="iterate run.batches(...) to its end (set epochs or a "
                                  "budget instead of leaving the loop early)")
        try:
            result = self._summarise(replica, state, epochs_log)
        finally:
            self._close()
        self._finished = result
        return result

    def _summarise(self, replica: Replica, state: PlanState, epochs_log: EpochLog) -> RunResult:
        wall_s = time.perf_counter() - self._started - epochs_log.eval_s
        replica.step_model = replica.model  # drop DDP before the process group goes
        final_checksum = checksum(replica.model)
        replica.timeline.event("final", checksum=final_checksum, anchor=state.anchor)
        replica.timeline.close()
        choice, policy = self._policy_choice, replica.config.policy
        if policy.decides:  # auto ended before it chose: it trained as cadence
            choice = auto_undecided(state)
            policy = choice.policy
        summary = _summary(replica, replace(self.config, backend=self.group.backend,
                                            policy=policy),
                           wall_s=wall_s, state=state, final_checksum=final_checksum,
                           epochs_log=epochs_log, resumed_from=self._resumed_from,
                           precisions=self._precisions, micro_batches=self.micro_batches,
                           p2p=self.group.p2p, policy_choice=choice)
        run_dir = self.config.run_dir
        if run_dir is not None and self.rank == 0:
            write_summary(run_dir, summary)
            save_model(run_dir, replica.model)
        return RunResult(replica.model, epochs_log.last_eval, list(self.history), summary,
                         run_dir)

    def _close(self) -> None:
        for part in (self.replica.steps if self.replica else None,
                     getattr(self.replica, "comm_meter", None),
                     getattr(self.replica, "dataset", None)):
            close = getattr(part, "close", None)
            if close is not None:
                close()
        if self._sampler is not None:
            self._sampler.stop()
            self._sampler = None
        stop_ticking()  # no thread of fdl's left inside a store call at the interpreter's exit
        leave_group(self.group)

    def abandon(self) -> None:
        """Leave the group without a summary (the script failed)."""
        if self._finished is None:
            if self._epochs_log is not None:
                self._epochs_log.close()
            self._close()

    # What the epoch's end (fdl.engine.epochs) reads of the script.
    @property
    def evaluations(self) -> list[_Evaluation]:
        return list(self._evaluations)



#: wrappers that run collectives of their own in forward or backward (torch's DDP and FSDP)
COLLECTIVE_WRAPPERS = ("DistributedDataParallel", "FullyShardedDataParallel", "FSDPModule")


def _whole_batches(budget: int | None, train: TrainData | None, batch_size: int) -> int | None:
    """A sample budget cut to whole batches when ``train`` drops the last partial batch (its
    last step would otherwise take the rest); UsageError when none is left."""
    if budget is None or train is None or not train.drop_last:
        return budget
    if budget < batch_size:
        raise UsageError(f"a budget of {budget} samples holds no whole batch of {batch_size}, "
                         "and drop_last trains on whole batches only",
                         hint="raise max_samples, or leave drop_last off")
    return budget - budget % batch_size


def _check_accumulate(accumulate: Any) -> None:
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise UsageError(f"accumulate must be a whole number >= 1, got {accumulate!r}")


def _check_unwrapped(model: nn.Module) -> None:
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


def _check_optimized(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that steps parameters outside ``model`` (a learnable temperature or
    a head kept beside it): fdl averages, checkpoints and restores the model's parameters
    only, so the ranks' copies of those would drift apart, silently (a 2-worker cadence run
    ended with two different temperatures)."""
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


def _streaming(data: Any) -> bool:
    """Whether ``data`` is data without ``len()`` that run.batches streams (fdl.engine.shards):
    an IterableDataset, a list of shard paths, or a stream."""
    from torch.utils.data import IterableDataset

    from fdl.engine.shards import IterableStream, ShardStream

    return isinstance(data, (IterableDataset, ShardStream, IterableStream)) or (
        isinstance(data, (list, tuple)) and bool(data)
        and all(isinstance(item, (str, os.PathLike)) for item in data))


def _no_epoch_end(epoch: int, replica: Replica, state: PlanState) -> Callable[[], None]:
    return _nothing


def _nothing() -> None:
    return None


def _warn_of_a_scheduler(optimizer: torch.optim.Optimizer, policy: Policy) -> None:
    """Say (once, rank 0) that a torch LR scheduler made on ``optimizer`` runs at each rank's
    own pace when the ranks step unequally (cadence, async, auto's calibration): stepped
    every batch, the fast rank runs through its schedule sooner, and a OneCycleLR sized by the
    batches of one rank raises on the fast rank once it passes its total. torch's schedulers
    leave ``initial_lr`` in every param group they are made on (the optimizer's state_dict
    holds it): a scheduler stepped at epoch ends, which every rank reaches alike, is fine."""
    if (policy.local_steps or policy.decides) and any(
            "initial_lr" in group for group in getattr(optimizer, "param_groups", [])):
        _console().warn(
            f"an LR scheduler was made on the optimizer: under --policy {policy.name} each rank "
            "steps at its own pace, so a scheduler stepped every batch runs through its "
            "schedule sooner on the fast rank (and OneCycleLR stops it once it passes its "
            "total): hand it to run.batches(..., scheduler=) and fdl steps it once per global "
            "step on every rank, step it at epoch ends (run.at_epoch_end), or set the LR "
            "from run.progress, which every rank shares")


def _unequal_steps(replica: Replica) -> str | None:
    """Why a collective in a step cannot pair up now (fdl.engine.user_collectives), or None:
    alone, and under sync in a round cut evenly, every rank's steps meet. Sync's round that
    ends an epoch whose batches do not split evenly gives a rank one step fewer (it joins
    DDP's all-reduce, as torch's join does, but a collective of the script's is left alone)."""
    if replica.world_size == 1:
        return None
    if replica.policy.local_steps:
        return (f"--policy {replica.policy.name} trains (its ranks take different numbers of "
                f"steps between averages)")
    plan = replica.round_plan
    if plan is not None and len({piece.steps for piece in plan.slices}) > 1:
        steps = ", ".join(str(piece.steps) for piece in plan.slices)
        return (f"this round of --policy {replica.policy.name} is cut unevenly (its ranks take "
                f"{steps} steps: the epoch's batches do not split evenly)")
    return None


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


def _summary(replica: Replica, config: EngineConfig, *, wall_s: float, state: PlanState,
             final_checksum: str, epochs_log: EpochLog, resumed_from: str | None,
             precisions: list[str], micro_batches: MicroBatches,
             p2p: P2PChoice | None = None,
             policy_choice: PolicyChoice | None = None) -> dict[str, Any]:
    """summary.json's document, with every rank's figures for the run (one collective)."""
    world = replica.world_size
    memory = _memory_row(replica, micro_batches.label(config.batch_size))
    rows = exchange_rows(replica.totals.figures().to_row() + memory, rank=replica.rank,
                         world_size=world, device=replica.device)
    per_rank = [RankFigures.from_row(row[:-len(memory)]) for row in rows]
    memories = [[int(value) for value in row[-len(memory):]] for row in rows]
    devices = gather_labels(device_label(replica.device), world_size=world) if world > 1 \
        else [str(replica.device)]
    outer = replica.averager.outer if replica.averager is not None else None
    totals = replica.totals
    return build_summary(
        config=config, world_size=world, devices=devices, wall_s=wall_s,
        samples=[int(r.samples) for r in per_rank], busy_s=[r.busy_s for r in per_rank],
        comm_ms=totals.comm_ms, step_comm_s=[r.comm_s for r in per_rank], syncs=totals.syncs,
        eval_metrics=epochs_log.last_eval, final_loss=epochs_log.last_loss,
        precisions=precisions,
        extra={"eval_s": epochs_log.eval_s, "seed": config.seed,
               "anchor_history": [list(item) for item in state.anchor_history],
               "final_anchor": state.anchor, "checksum": final_checksum,
               "emulated_sleep_s": [r.sleep_s for r in per_rank],
               "data_wait_s": [r.data_s for r in per_rank],
               "micro_batch_size": [m[0] for m in memories],
               "peak_memory_bytes": [m[1] if m[1] >= 0 else None for m in memories],
               "fdl_memory_bytes": [{"device": m[2], "host": m[3]} for m in memories],
               "ddp_comm_s": [r.comm_s for r in per_rank],
               # what crosses the link: an average's bytes (as sent: encoded on the wire, fewer)
               # and, for sync, the gradients DDP all-reduces every step (float32)
               "average_bytes": replica.averager.bytes if replica.averager is not None else 0,
               "average_dtype": config.average_dtype,
               # the outer optimizer and how many steps it took (0: none, or sync's averages)
               "outer_optimizer": {"name": config.outer_optimizer, "lr": config.outer_lr,
                                   "momentum": config.outer_momentum,
                                   "steps": outer.steps if outer is not None else 0},
               "gradient_bytes": sum(p.numel() * p.element_size()
                                     for p in replica.model.parameters() if p.requires_grad),
               "accumulate": replica.accumulate, "samples_planned": state.config.num_samples,
               "attempt": restart_attempt(), "resumed_from": resumed_from,
               # node 0's NCCL_P2P_DISABLE and why (each node checks its own GPUs)
               "nccl_p2p": p2p.to_dict() if p2p is not None else None,
               # --policy auto: what it chose and from which figures (None: a policy was given)
               "policy_choice": policy_choice.to_dict() if policy_choice is not None
               else None},
    )


def _memory_row(replica: Replica, micro: int) -> list[float]:
    """This rank's micro-batch size, its device's peak allocated bytes (-1 off CUDA) and fdl's
    own averaging memory on the device and in host memory: whole numbers a float64 row carries
    exactly, exchanged with the run's figures."""
    device = replica.device
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else -1
    own = replica.averager.memory_bytes() if replica.averager is not None else (0, 0)
    return [float(micro), float(peak), float(own[0]), float(own[1])]


def _verify() -> bool:
    return os.environ.get("FDL_VERIFY_REPLICAS") == "1"


def _node_sampler(run_dir: Path | None, membership: Membership, *,
                  device: torch.device) -> Any:
    """Local rank 0's utilisation sampler (fdl.engine.sampler). It must never stop
    training: a run directory it cannot write to only costs the utilisation curves."""
    from fdl.engine.sampler import start_node_sampler

    try:
        return start_node_sampler(run_dir, local_rank=membership.local_rank,
                                  node=membership.node, device=device,
                                  local_world_size=membership.local_world_size)
    except OSError as exc:
        _console().warn(f"utilisation sampler not started: {exc}")
        return None


def _console() -> Any:
    from fdl import console

    return console
