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

This module is the public face: the settings (``fdl run`` flags > ``FDL_*`` > fdl.toml > the
values given here > defaults) and the group at ``init``, the script's registrations (its
evaluations, hooks and state objects), and the checks of what ``batches`` is given. The parts
of the run are built in one place (fdl.engine.assembly), the round loop calls them
(fdl.engine.rounds, fdl.engine.boundary), and ``finish`` ends the run (fdl.engine.finish).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from fdl.engine.agreement import agree, runtime_facts
from fdl.engine.assembly import Inputs, Start, assemble, start
from fdl.engine.boundary import Boundary
from fdl.engine.checks import (
    check_accumulate,
    check_model_and_optimizer,
    check_optimized,
    check_unwrapped,
    scheduler_warning,
    streaming,
    whole_batches,
)
from fdl.engine.collectives import (
    Group,
    Membership,
    group_timeout,
    join_group,
    leave_group,
    pick_device,
)
from fdl.engine.config import EngineConfig, resolve_config
from fdl.engine.data import TrainData
from fdl.engine.evaluation import Evaluator
from fdl.engine.finish import RunResult, finish_run
from fdl.engine.heap import frozen_heap
from fdl.engine.liveness import liveness, stop_ticking
from fdl.engine.micro_batches import MicroBatches, micro_for_rank
from fdl.engine.parts import Parts
from fdl.engine.peers import keep_store
from fdl.engine.plan import PlanConfig, PlanState, global_step_samples, samples_budget
from fdl.engine.policies import CADENCE, PolicyChoice
from fdl.engine.precision import autocast, precision_for_rank, resolve_precision
from fdl.engine.round_messages import group_store
from fdl.engine.rounds import rounds, unequal_steps
from fdl.engine.steps import CountingScaler, DrivenScheduler
from fdl.engine.user_collectives import refused
from fdl.errors import UsageError

__all__ = ["Run", "RunResult", "init", "rank_seed"]

# The plan's length for a stream with a time budget alone: the time ends it long before.
STREAM_WITHOUT_SAMPLE_BUDGET = 2**53


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
               evaluator=Evaluator(membership.rank, membership.world_size, device),
               precision=mine, scaler=CountingScaler(device.type) if mine == "fp16" else None,
               micro_batches=micro)


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s random streams after initialisation (rank 0 keeps ``seed``,
    so a solo run draws what it always drew)."""
    return seed + 1_000_003 * rank


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
    evaluator: Evaluator  # run.evaluate's sets
    precision: str = "fp32"  # this rank's: fp32, bf16 or fp16 (fdl.engine.precision)
    scaler: CountingScaler | None = None  # fp16's GradScaler, this rank's own
    # This rank's micro-batches (fdl.engine.micro_batches): fdl.Trainer computes each batch in
    # them; a loop of its own asks run.micro_parts(batch).
    micro_batches: MicroBatches = field(default_factory=lambda: MicroBatches(None))
    state_objects: dict[str, Any] = field(default_factory=dict)  # run.state's, by name
    # what the script asked for ("autocast", "micro_parts"): a loop that never did computed in
    # fp32 and whole batches, whatever --precision and --micro-batch said
    _asked: set[str] = field(default_factory=set)
    _parts: Parts | None = None  # built when run.batches starts (fdl.engine.assembly)
    _final: PlanState | None = None
    _started: float = 0.0
    _start: Start | None = None  # where training started (a checkpoint's user state)
    _finished: RunResult | None = None
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
    def history(self) -> list[dict[str, Any]]:
        """One record per epoch so far (the recorder's, read-only: a copy)."""
        return list(self._parts.recorder.history) if self._parts is not None else []

    @property
    def progress(self) -> float:
        """The run's fraction done in [0, 1]: samples over the run's samples (its epochs or
        its step or sample budget), or, with a time budget, elapsed over it if further."""
        parts = self._parts
        if parts is None:
            return 0.0
        if self._final is not None:
            return 1.0
        total = parts.plan_config.num_samples
        done = parts.tallies.position / total if total else 0.0
        if self.config.max_time:  # a time budget: whichever is further
            done = max(done, parts.tallies.elapsed_s() / self.config.max_time)
        return min(1.0, done)

    @property
    def step_model(self) -> nn.Module:
        """The module a step calls: DDP's wrapper under sync in fdl.Trainer, else the model."""
        if self._parts is None:
            raise UsageError("run.step_model exists once run.batches(...) has started")
        return self._parts.replica.step_model

    def micro_parts(self, batch: Any) -> list[tuple[Any, float]]:
        """``batch`` in this rank's micro-batches (``--micro-batch``), each with its share of
        the batch: weight each part's mean loss by it and backward each, iterating the parts
        in order; ``[(batch, 1.0)]`` without micro-batches. Under sync the gradients are
        all-reduced with the last part's backward (fdl.engine.grad_sync)."""
        self._asked.add("micro_parts")
        parts = self.micro_batches.parts(batch)
        return self._parts.replica.sync.parts(parts) if self._parts is not None else parts

    def autocast(self) -> contextlib.AbstractContextManager:
        """This rank's precision for the forward pass (fp32: nothing changes)."""
        self._asked.add("autocast")
        return autocast(self.device, self.precision)

    def log(self, **scalars: Any) -> None:
        """Per-step scalars: a number or a one-element tensor each (no wait for the device)."""
        if self._parts is None:
            raise UsageError("run.log(...) is for the steps of run.batches(...)")
        for name, value in scalars.items():
            self._parts.tallies.logged.add(name, value)

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
        if self._parts is not None:
            raise UsageError("call run.evaluate(...) before run.batches(...) starts")
        self.evaluator.add(data, fn, every=every, derive=derive, name=name)

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
            if self._start is not None and name in self._start.user_state:
                obj.load_state_dict(self._start.user_state[name])

    # What the round needs of the script's registrations (fdl.engine.parts.ScriptHooks).

    def averaged(self) -> None:
        for fn in self._after_average:
            fn()

    def epoch_ended(self, record: dict[str, Any]) -> None:
        for fn in self._at_epoch_end:
            fn(dict(record))

    def user_state(self) -> dict[str, Any]:
        return self.state_objects

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
        if self._parts is not None:
            raise UsageError(
                "run.batches(...) runs once per run: this run's batches were already asked for",
                hint="for phases (pretraining, then fine-tuning), loop over one run.batches(...) "
                     "and switch on run.progress or the epoch; or train each phase as its own "
                     "fdl run")
        check_accumulate(accumulate)
        check_model_and_optimizer(model, optimizer)
        check_unwrapped(model)
        check_optimized(model, optimizer)
        train = None if streaming(data) else TrainData.of(data)
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
        if self.world_size == 1 and self.config.policy.decides:  # nothing to measure or gain
            self._policy_choice = PolicyChoice(CADENCE, "one worker: nothing to average or "
                                               "balance", 0.0, 0.0, 0.0, 0.0)
            self.config = replace(self.config, policy=CADENCE)
        inputs = Inputs(train, stream, model, optimizer, accumulate, ddp, driven,
                        self._plan_config(train, stream, accumulate))
        return self._rounds(inputs)

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
        check_accumulate(accumulate)
        train = None if streaming(data) else TrainData.of(data)
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
        return whole_batches(samples_budget(
            max_steps=config.max_steps, max_samples=config.max_samples,
            world_size=self.world_size, batch_size=config.batch_size, accumulate=accumulate),
            train, config.batch_size)

    def _plan_config(self, train: TrainData | None, stream: Any,
                     accumulate: int) -> PlanConfig:
        """The plan of the run's samples: its epochs (a stream: one "epoch" of the budget, a
        time alone as good as endless), the step (``accumulate`` batches), the budget and
        evaluations within an epoch bounding a round."""
        config = self.config
        budget = self._sample_budget(config, train, accumulate)
        if train is None:
            size, epochs, budget = budget or STREAM_WITHOUT_SAMPLE_BUDGET, 1, None
        else:
            size, epochs = train.epoch_samples(config.batch_size), config.epochs
        return PlanConfig(world_size=self.world_size, batch_size=config.batch_size * accumulate,
                          dataset_size=size, epochs=epochs, max_samples=budget,
                          policy=config.policy, overhead_target=config.overhead_target,
                          round_cap=self.evaluator.every_samples(self._global_step(accumulate)))

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

    def _rounds(self, inputs: Inputs) -> Iterator[Any]:
        parts = self._parts = assemble(
            inputs, config=self.config, membership=self.membership, group=self.group,
            device=self.device, precision=self.precision, evaluator=self.evaluator,
            script=self, seed_after=rank_seed(self.config.seed, self.rank))
        if inputs.scheduler is not None:  # its count goes into checkpoints, and comes back
            self.state_objects["fdl_lr_scheduler"] = inputs.scheduler.scheduler
        elif self.rank == 0 and self.world_size > 1:
            warning = scheduler_warning(inputs.optimizer, self.config.policy)
            if warning is not None:
                _console().warn(warning)
        if inputs.stream is not None:  # its position goes into checkpoints
            self.state_objects["fdl_stream"] = inputs.stream
        if self.scaler is not None:
            self.scaler.watch = parts.replica.steps
        self._start = start(parts)
        self.state(**self.state_objects)  # load what is registered already
        boundary = Boundary()
        self._started = time.perf_counter()
        parts.recorder.begin(parts.tallies.totals)
        try:
            with frozen_heap(), refused(lambda: unequal_steps(parts)):
                self._final = yield from rounds(parts, self._start.state, boundary)
        finally:
            parts.recorder.close()
            self._policy_choice = boundary.choice or self._policy_choice

    # ---- the end ------------------------------------------------------------------------

    def finish(self) -> RunResult:
        """After the last batch: every rank's figures into ``summary.json``, the consensus
        model saved (rank 0), the group left. Returns the same :class:`RunResult` when called
        again."""
        if self._finished is not None:
            return self._finished
        parts, state = self._parts, self._final
        if parts is None or state is None or self._start is None:
            raise UsageError("run.finish() comes after the last batch of run.batches(...)",
                             hint="iterate run.batches(...) to its end (set epochs or a "
                                  "budget instead of leaving the loop early)")
        whole = self.config.batch_size
        try:
            result = finish_run(parts, state, started=self._started,
                                choice=self._policy_choice,
                                resumed_from=self._start.resumed_from,
                                micro_batch_size=self.micro_batches.label(whole)
                                if "micro_parts" in self._asked else whole,
                                p2p=self.group.p2p,
                                in_precision="autocast" in self._asked)
        finally:
            self._close()
        self._finished = result
        if self.membership.rank == 0:
            for line in unapplied_settings(parts.precisions, result.summary,
                                           micro_batches=self.micro_batches, batch_size=whole):
                _console().warn(line)
        return result

    def _close(self) -> None:
        if self._parts is not None:
            self._parts.close()
        stop_ticking()  # no thread of fdl's left inside a store call at the interpreter's exit
        leave_group(self.group)

    def abandon(self) -> None:
        """Leave the group without a summary (the script failed)."""
        if self._finished is None:
            if self._parts is not None:
                self._parts.recorder.close()
            self._close()


def unapplied_settings(asked: list[str], summary: dict[str, Any], *, micro_batches: MicroBatches,
                       batch_size: int) -> list[str]:
    """A line for each setting a rank was given and its script never applied (``asked``: every
    rank's precision as given; ``summary``: what the ranks computed in): a loop that never
    entered ``run.autocast()`` or never asked ``run.micro_parts(batch)``."""
    lines = []
    plain = [rank for rank, (given, used) in enumerate(zip(asked, summary["precision"],
                                                           strict=True)) if given != used]
    if plain:
        lines.append(f"--precision {','.join(asked)}: the script never entered run.autocast(), "
                     f"so rank(s) {', '.join(map(str, plain))} computed in fp32 (the run's "
                     f"summary says so); wrap the forward pass in `with run.autocast():`")
    if micro_batches.size is not None and micro_batches.size < batch_size and \
            summary["micro_batch_size"][0] == batch_size:
        lines.append(f"--micro-batch {micro_batches.size}: the script never asked "
                     f"run.micro_parts(batch), so it computed whole batches of {batch_size}; "
                     f"backward each part of `for part, weight in run.micro_parts(batch):`")
    return lines


def _console() -> Any:
    from fdl import console

    return console
