"""``fdl.Trainer``: data-parallel training where a fast device is not held to a slow one's pace.

    trainer = fdl.Trainer(model=build_model, optimizer=build_optimizer, train_step=train_step,
                          train_data=train_set, eval_data=test_set, evaluate=evaluate,
                          batch_size=64, epochs=5, policy="cadence")
    result = trainer.fit()   # a RunResult(model, metrics, history, summary, run_dir)

``python train.py`` trains solo in-process on the best device. Under ``fdl run`` every worker's
``fit()`` joins the process group (torchrun's environment) and trains with the launcher's
settings; precedence: ``fdl run`` flag > fdl.toml > the script's value > default. See
docs/elche.md for the policies, the plan and the formulas.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fdl.engine.data import batch_size_of
from fdl.engine.loop import Run, RunResult, init
from fdl.errors import UsageError
from fdl.settings import ENGINE_DEFAULTS

#: ``fit()``'s result: ``run.finish()``'s, its model moved to the CPU
TrainResult = RunResult


@dataclass(kw_only=True)
class Trainer:
    """Data-parallel training of ``model()`` on ``train_data`` (a map-style dataset).

    * ``optimizer``: a factory. Given a function of one parameter named ``model``, fdl passes
      the model (``optimizer=lambda model: AdamW(groups_of(model))``); any other gets the
      model's parameters as a list, which it may walk more than once
      (``optimizer=lambda params: torch.optim.SGD(params, lr=0.1)``).
    * ``train_step(model, batch) -> loss``: a scalar tensor that requires grad; fdl runs
      backward, clipping (``max_grad_norm``) and the optimizer step. Under ``cadence`` and
      ``async`` the ranks run different numbers of steps between averages, so nothing in a
      step may wait for the other ranks: no collective in ``train_step`` (one called through
      ``torch.distributed`` stops the run with an error naming its line), no ``SyncBatchNorm``
      in the model, no ``ZeroRedundancyOptimizer`` (fdl refuses the last two before training;
      ``sync`` allows all three, as plain DDP does, but for a collective of ``train_step``'s in
      the round that ends an epoch whose batches do not split evenly over the ranks).
    * ``train_step`` may also return a dict of scalars with a ``loss``: the loss is trained
      on, every entry logged (``run.log``: the timeline, TensorBoard's ``step/<name>``).
    * ``evaluate(model, batch) -> {name: mean over the batch}`` on ``eval_data``, at every
      epoch's end, the means taken over every sample; ``eval_derive(means) -> {name: number}``
      adds metrics of the whole set (``run.evaluate(..., derive=)``: F1 from the means of
      true-positive, false-positive and false-negative indicators).
    * ``schedule(progress) -> multiplier`` of each param group's LR, ``progress`` the run's
      fraction done (equal on every rank); or ``scheduler(optimizer) -> LRScheduler``, a
      torch LR scheduler the engine steps once per global step (``world_size x batch_size``
      samples, as ``max_steps`` counts them; ``run.batches(..., scheduler=)``); a factory
      with a parameter named ``total_steps`` also gets the run's global steps
      (``run.total_steps``: ``fdl run``'s ``--epochs`` and budgets applied), to size it with:
      ``scheduler=lambda opt, total_steps: OneCycleLR(opt, 0.1, total_steps=total_steps)``.
    * ``callbacks``: objects with any of ``on_epoch_end(record)`` (the epoch's
      ``metrics.jsonl`` record, after the evaluation; the model holds the epoch's consensus,
      under async a round into the next epoch), ``on_average(model)`` (an average just
      landed in the model: where an EMA of the consensus updates) and ``state_dict`` /
      ``load_state_dict`` (then checkpointed and restored on resume).
    * ``micro_batch_size`` (``fdl run --micro-batch``): each batch computed in parts of N
      samples, each part's loss weighted by its share and the gradients accumulated, so the
      step is the batch's (BatchNorm's statistics aside); one per rank (``"16,64"``: a small
      card computes the batch a large one sets) or ``"auto"`` (on CUDA, halved after each
      out-of-memory error until a step fits).
    * ``num_workers``, ``collate_fn``, ``pin_memory`` (default: on for CUDA) and ``prefetch``
      (batches per worker): how each rank's batches are made, ahead of its steps, by loader
      processes kept for the whole run (a DataLoader given as ``train_data`` brings its own).
      ``drop_last=True`` (or a DataLoader's): whole batches only, each epoch's remainder left
      out (a model with BatchNorm refuses a batch of one sample).
    * ``precision`` (``auto``, ``fp32``, ``bf16``, ``fp16`` or one per rank: ``"bf16,fp32"``)
      and the budgets ``max_steps`` (global steps of ``world_size x batch_size`` samples),
      ``max_samples`` and ``max_time`` (seconds or ``"10m"``) end the run before ``epochs``.

    Everything this does is a loop on :func:`fdl.init`'s API (``fdl.engine.loop``): a script
    that needs its own loop (accumulation, a GradScaler of its own, an evaluation cadence)
    writes that instead, with the same engine underneath.

    ``fit()`` trains and returns a :class:`~fdl.engine.finish.RunResult`; settings from
    ``fdl run`` flags, ``FDL_*`` and fdl.toml win over the values given here (docs/run.md).
    """

    model: Callable[[], nn.Module]
    optimizer: Callable[[Any], torch.optim.Optimizer]
    train_step: Callable[[nn.Module, Any], torch.Tensor]
    train_data: Any
    eval_data: Any = None
    evaluate: Callable[[nn.Module, Any], dict[str, float]] | None = None
    eval_derive: Callable[[dict[str, float]], Any] | None = None  # whole-set metrics of the means
    # Defaults of the settings contract (fdl.settings): "a script value equal to the default
    # counts as default", so fdl.toml and FDL_* can still set them.
    batch_size: int = ENGINE_DEFAULTS["batch_size"]
    epochs: int = ENGINE_DEFAULTS["epochs"]
    max_grad_norm: float | None = None
    schedule: Callable[[float], float] | None = None
    scheduler: Callable[..., Any] | None = None  # a torch LR scheduler's factory (optimizer[, total_steps])
    policy: str = ENGINE_DEFAULTS["policy"]
    backend: str = ENGINE_DEFAULTS["backend"]
    seed: int = ENGINE_DEFAULTS["seed"]
    precision: str = ENGINE_DEFAULTS["precision"]  # auto | fp32 | bf16 | fp16, or one per rank
    # Each batch in micro-batches of N (gradients accumulated): N, "16,64" (one per rank) or
    # "auto" (the largest that fits on each GPU); None: the batch at once.
    micro_batch_size: int | str | None = None
    max_steps: int | None = None  # budgets that end the run before `epochs` (fdl.init's)
    max_samples: int | None = None
    max_time: float | str | None = None
    checkpoint_every: int | str | None = None  # N epochs, or a time: "10m", "90s", "2h"
    tensorboard: str | None = None  # "on" (RUN_DIR/tensorboard) or a directory
    callbacks: list[Any] = field(default_factory=list)
    # Loader options (run.batches'): worker processes, collate_fn, pinned batches, prefetch,
    # whole batches only.
    num_workers: int | None = None
    collate_fn: Callable[[list[Any]], Any] | None = None
    pin_memory: bool | None = None
    prefetch: int | None = None
    drop_last: bool | None = None
    history: list[dict[str, Any]] = field(default_factory=list, init=False, repr=False)

    def fit(self) -> RunResult:
        """Train to the end (every rank under ``fdl run``; in-process alone) and return the
        consensus model, the final evaluation, the epoch history and the summary."""
        self._validate()
        run = init(policy=self.policy, backend=self.backend, seed=self.seed,
                   batch_size=self.batch_size, epochs=self.epochs, precision=self.precision,
                   checkpoint_every=self.checkpoint_every, tensorboard=self.tensorboard,
                   max_grad_norm=self.max_grad_norm, micro_batch_size=self.micro_batch_size)
        try:
            result = self._train(run)
        except BaseException:
            run.abandon()
            raise
        self.history[:] = result.history
        result.model.cpu()
        return RunResult(result.model, result.metrics, list(result.history), result.summary,
                         result.run_dir)

    def _train(self, run: Run) -> RunResult:
        """The Trainer's loop on fdl.init's API: what a loop script writes by hand."""
        run.check_data(self.train_data)
        model = self.model().to(run.device)  # fdl.init seeded torch: the same on every rank
        optimizer = build_optimizer(self.optimizer, model)
        base_lrs = [group["lr"] for group in optimizer.param_groups]  # before any resume
        if self.eval_data is not None:
            run.evaluate(self.eval_data, self.evaluate, derive=self.eval_derive)
        self._attach(run, model)
        clip, scaler = run.config.max_grad_norm, run.scaler
        checked = False
        for batch in run.batches(self.train_data, model=model, optimizer=optimizer,
                                 max_steps=self.max_steps, max_samples=self.max_samples,
                                 max_time=self.max_time, num_workers=self.num_workers,
                                 collate_fn=self.collate_fn, pin_memory=self.pin_memory,
                                 prefetch=self.prefetch, drop_last=self.drop_last, ddp=True,
                                 scheduler=self._scheduler(run, optimizer)):
            if self.schedule is not None:
                scale = self.schedule(run.progress)
                for group, base in zip(optimizer.param_groups, base_lrs, strict=True):
                    group["lr"] = base * scale
            out, loss = self._backward(run, batch, optimizer, check=not checked)
            checked = True
            if scaler is not None:  # fp16: this rank's own loss scale
                scaler.unscale_(optimizer)
            if clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            if out:
                run.log(**out)
            run.log(loss=loss)
        return run.finish()

    def _backward(self, run: Run, batch: Any, optimizer: torch.optim.Optimizer, *,
                  check: bool) -> tuple[dict[str, Any], torch.Tensor]:
        """The step's forward and backward passes, in this rank's micro-batches: each part's
        loss weighted by its share of the batch, gradients accumulated (under DDP, reduced
        once, with the last part). Under ``--micro-batch auto`` on CUDA an out-of-memory error
        drops the step's gradients and redoes it in halved parts. Returns the step's other
        scalars and its loss (detached), each the batch's weighted mean."""
        micro = run.micro_batches
        while True:
            optimizer.zero_grad(set_to_none=True)
            try:
                return self._backward_parts(run, run.micro_parts(batch), check=check)
            except torch.cuda.OutOfMemoryError:
                if not micro.shrink(batch_size_of(batch)):
                    raise
            optimizer.zero_grad(set_to_none=True)  # out of the handler: its frames are freed
            if run.device.type == "cuda":
                torch.cuda.empty_cache()

    def _backward_parts(self, run: Run, parts: list[tuple[Any, float]], *,
                        check: bool) -> tuple[dict[str, Any], torch.Tensor]:
        model, scaler = run.step_model, run.scaler
        scalars: dict[str, Any] = {}
        total: torch.Tensor | None = None
        for part, weight in parts:  # the gradients reduced with the last part's backward
            with run.autocast():
                out = self.train_step(model, part)
            loss = out.get("loss") if isinstance(out, dict) else out
            if check:
                _check_loss(loss)
                check = False
            scaled = loss * weight if weight != 1.0 else loss
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
            total = scaled.detach() if total is None else total + scaled.detach()
            if isinstance(out, dict):
                for name, value in out.items():
                    if name != "loss":
                        value = value.detach() if isinstance(value, torch.Tensor) else value
                        scalars[name] = scalars.get(name, 0.0) + value * weight
        assert total is not None
        return scalars, total

    def _attach(self, run: Run, model: nn.Module) -> None:
        """Each callback's hooks on the run; those with a state_dict into checkpoints."""
        for index, callback in enumerate(self.callbacks):
            hooks = [getattr(callback, name, None) for name in ("on_epoch_end", "on_average")]
            if not any(callable(hook) for hook in hooks):
                raise UsageError(f"callbacks[{index}] ({type(callback).__name__}) has neither "
                                 "on_epoch_end(record) nor on_average(model)")
            if callable(hooks[0]):
                run.at_epoch_end(hooks[0])
            if callable(hooks[1]):
                run.after_average(lambda hook=hooks[1]: hook(model))
            if callable(getattr(callback, "state_dict", None)):
                run.state(**{f"callback{index}": callback})

    def _scheduler(self, run: Run, optimizer: torch.optim.Optimizer) -> Any:
        """The torch LR scheduler the factory makes (None without one), given the run's
        global steps when it asks for ``total_steps``."""
        if self.scheduler is None:
            return None
        if "total_steps" not in _parameter_names(self.scheduler):
            return self.scheduler(optimizer)
        return self.scheduler(optimizer, total_steps=run.total_steps(
            self.train_data, max_steps=self.max_steps, max_samples=self.max_samples,
            drop_last=self.drop_last))

    def _validate(self) -> None:
        if not callable(self.model) or not callable(self.optimizer) or not callable(self.train_step):
            raise UsageError("model, optimizer and train_step must be callables",
                             hint="model=lambda: nn.Linear(4, 1), optimizer=lambda p: "
                                  "torch.optim.SGD(p, lr=0.1), train_step=fn(model, batch)")
        if self.scheduler is not None and not callable(self.scheduler):
            raise UsageError("scheduler takes a factory of the optimizer",
                             hint="scheduler=lambda opt: torch.optim.lr_scheduler.OneCycleLR("
                                  "opt, max_lr=0.1, total_steps=N)")
        if self.scheduler is not None and self.schedule is not None:
            raise UsageError("schedule and scheduler both set the learning rate: give one")
        if (self.eval_data is None) != (self.evaluate is None):
            raise UsageError("eval_data and evaluate go together: give both or neither")
        if self.eval_derive is not None and self.evaluate is None:
            raise UsageError("eval_derive computes metrics from evaluate's means: give "
                             "eval_data and evaluate too")


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise UsageError(
            "train_step must return a scalar loss tensor that requires grad (or a dict with "
            "one as 'loss'), got "
            + (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
               else type(loss).__name__),
            hint="return e.g. torch.nn.functional.cross_entropy(model(x), y)")


def build_optimizer(factory: Any, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer ``factory`` makes for ``model``. A factory whose one parameter is named
    ``model`` gets the model itself (recipes that group parameters by module type:
    ``optimizer=lambda model: ...``); any other gets the model's parameters as a list, which it
    may walk more than once (nanoGPT's ``configure_optimizers`` walks them twice, decay for
    matrices and none for the rest: given a one-shot generator, its second group came out
    empty and those parameters never trained, silently)."""
    names = _parameter_names(factory)
    return factory(model if names[:1] == ["model"] else list(model.parameters()))


def _parameter_names(factory: Any) -> list[str]:
    """The names of ``factory``'s parameters (none for a builtin without a signature)."""
    try:
        return list(inspect.signature(factory).parameters)
    except (TypeError, ValueError):
        return []
