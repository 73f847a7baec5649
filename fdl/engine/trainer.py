"""``fdl.Trainer``: data-parallel training where a fast device is not held to a slow one's pace.

    trainer = fdl.Trainer(model=build_model, optimizer=build_optimizer, train_step=train_step,
                          train_data=train_set, eval_data=test_set, evaluate=evaluate,
                          batch_size=64, epochs=5, policy="cadence")
    result = trainer.fit()   # TrainResult(model, metrics, history, summary, run_dir)

``python train.py`` trains solo in-process on the best device. Under ``fdl run`` every worker's
``fit()`` joins the process group (torchrun's environment) and trains with the launcher's
settings; precedence: ``fdl run`` flag > fdl.toml > the script's value > default. See
docs/elche.md for the policies, the plan and the formulas.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fdl.engine import summary as artifacts
from fdl.engine.averaging import Averager, broadcast_from_rank0, checksum
from fdl.engine.checkpoint import CheckpointEvery
from fdl.engine.config import EngineConfig, resolve_config
from fdl.engine.epochs import EpochLog
from fdl.engine.evaluation import all_reduce_sum
from fdl.engine.plan import PlanConfig, PlanState, initial_state
from fdl.engine.policies import policy_named
from fdl.engine.progress import ProgressFile
from fdl.engine.recovery import Checkpointer, find_resume_checkpoint, restart_attempt, resume
from fdl.engine.rounds import NUM_STATS, Worker, train
from fdl.engine.timeline import Timeline
from fdl.errors import UsageError
from fdl.settings import ENGINE_DEFAULTS


@dataclass
class TrainResult:
    model: nn.Module  # the consensus model, on the CPU
    metrics: dict[str, float]  # final evaluation
    history: list[dict[str, Any]]  # one record per epoch
    summary: dict[str, Any]  # as written to summary.json
    run_dir: Path | None


@dataclass(kw_only=True)
class Trainer:
    model: Callable[[], nn.Module]
    optimizer: Callable[[Any], torch.optim.Optimizer]
    train_step: Callable[[nn.Module, Any], torch.Tensor]
    train_data: Any
    eval_data: Any = None
    evaluate: Callable[[nn.Module, Any], dict[str, float]] | None = None
    # Defaults of the settings contract (fdl.settings): "a script value equal to the default
    # counts as default", so fdl.toml and FDL_* can still set them.
    batch_size: int = ENGINE_DEFAULTS["batch_size"]
    epochs: int = ENGINE_DEFAULTS["epochs"]
    max_grad_norm: float | None = None
    schedule: Callable[[float], float] | None = None
    policy: str = ENGINE_DEFAULTS["policy"]
    backend: str = ENGINE_DEFAULTS["backend"]
    seed: int = ENGINE_DEFAULTS["seed"]
    checkpoint_every: int | str | None = None  # N epochs, or a time: "10m", "90s", "2h"
    tensorboard: str | None = None  # "on" (RUN_DIR/tensorboard) or a directory
    history: list[dict[str, Any]] = field(default_factory=list, init=False, repr=False)
    _resumed_from: str | None = field(default=None, init=False, repr=False)

    def fit(self) -> TrainResult:
        config = resolve_config(script={
            "policy": self.policy, "backend": self.backend, "epochs": self.epochs,
            "batch_size": self.batch_size, "seed": self.seed,
            "checkpoint_every": self.checkpoint_every, "tensorboard": self.tensorboard},
            max_grad_norm=self.max_grad_norm)
        rank, world_size, local_rank = _dist_env()
        self._validate(config, world_size)
        device = _pick_device(local_rank, config.backend)
        created_group, backend, group = _init_group(config.backend, device, world_size)
        sampler = _node_sampler(config.run_dir, local_rank=local_rank, device=device)
        try:
            return self._fit(config, rank=rank, world_size=world_size, device=device,
                             backend=backend, group=group)
        finally:
            if sampler is not None:
                sampler.stop()
            if created_group and dist.is_initialized():
                # DDP's reducer sits in reference cycles: free it while its process group still
                # exists, not at interpreter exit (a worker once aborted there with "terminate
                # called without an active exception").
                gc.collect()
                dist.destroy_process_group()

    def _validate(self, config: EngineConfig, world_size: int) -> None:
        if not callable(self.model) or not callable(self.optimizer) or not callable(self.train_step):
            raise UsageError("model, optimizer and train_step must be callables",
                             hint="model=lambda: nn.Linear(4, 1), optimizer=lambda p: "
                                  "torch.optim.SGD(p, lr=0.1), train_step=fn(model, batch)")
        if (self.eval_data is None) != (self.evaluate is None):
            raise UsageError("eval_data and evaluate go together: give both or neither")
        needed = world_size * config.batch_size
        if len(self.train_data) < needed:
            raise UsageError(f"train_data has {len(self.train_data)} samples, fewer than one "
                             f"batch per worker ({world_size} x {config.batch_size} = {needed})",
                             hint="use a smaller batch_size or more data")
        slowdown = config.simulate_slowdown
        if slowdown is not None and len(slowdown) != world_size:
            raise UsageError(f"simulate_slowdown has {len(slowdown)} factor(s) for "
                             f"{world_size} worker(s)")

    def _fit(self, config: EngineConfig, *, rank: int, world_size: int, device: torch.device,
             backend: str, group: Any) -> TrainResult:
        torch.manual_seed(config.seed)  # the same initialisation on every rank
        model = self.model().to(device)
        distributed = world_size > 1
        if distributed:
            broadcast_from_rank0([t.data for t in (*model.parameters(), *model.buffers())],
                                 via_host=backend != "nccl", group=group)
        # From here on each rank draws its own random streams (dropout, augmentation): the same
        # masks on every rank would waste the extra replicas.
        torch.manual_seed(rank_seed(config.seed, rank))
        optimizer = self.optimizer(model.parameters())
        policy = policy_named(config.policy)
        step_model: nn.Module = model
        if distributed and policy.wraps_ddp:
            from torch.nn.parallel import DistributedDataParallel

            step_model = DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None,
                process_group=group)
        averager = Averager(model, rank=rank, world_size=world_size, backend=backend,
                            device=device, num_stats=NUM_STATS, group=group,
                            params=policy.averages_params) if distributed else None
        run_dir = config.run_dir
        if run_dir is not None and rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            artifacts.merge_config(run_dir / "config.json", {**config.to_dict(),
                                                             "resolved_backend": backend})
        timeline = Timeline(run_dir, rank=rank)
        epochs_log = EpochLog(self, config, run_dir if rank == 0 else None, rank, world_size)
        worker = Worker(
            rank=rank, world_size=world_size, device=device, model=model,
            step_model=step_model, optimizer=optimizer, train_step=self.train_step,
            dataset=self.train_data, config=config, schedule=self.schedule, timeline=timeline,
            averager=averager, on_epoch_end=epochs_log.epoch_end,
            slowdown=config.simulate_slowdown[rank] if config.simulate_slowdown else 1.0,
            verify=os.environ.get("FDL_VERIFY_REPLICAS") == "1",
            progress=ProgressFile.from_env(run_dir, rank=rank, epochs=config.epochs,
                                           epoch_size=len(self.train_data),
                                           world_size=world_size),
        )
        plan_config = PlanConfig(world_size=world_size, batch_size=config.batch_size,
                                 dataset_size=len(self.train_data), epochs=config.epochs,
                                 policy=config.policy, overhead_target=config.overhead_target)
        state = self._start(worker, plan_config, config, epochs_log)
        started = time.perf_counter()
        epochs_log.begin(worker)
        try:
            state = train(worker, state)
        finally:
            epochs_log.close()
        wall_s = time.perf_counter() - started - epochs_log.eval_s
        worker.step_model = step_model = model  # drop DDP before the process group goes
        final_checksum = checksum(model)
        timeline.event("final", checksum=final_checksum, anchor=state.anchor)
        timeline.close()
        summary = self._summary(worker, config, backend, wall_s, state, final_checksum,
                                epochs_log)
        if run_dir is not None and rank == 0:
            artifacts.write_json_atomic(run_dir / "summary.json", summary)
            artifacts.save_model(run_dir / "model.pt", model)
        model.cpu()
        return TrainResult(model, epochs_log.last_eval, list(self.history), summary, run_dir)

    def _start(self, worker: Worker, plan_config: PlanConfig, config: EngineConfig,
               epochs_log: EpochLog) -> PlanState:
        """The state training starts from: fresh, or a checkpoint's after a crash or with
        ``fdl run --resume`` (see fdl.engine.recovery). Logs a ``start`` event either way."""
        run_dir, attempt = config.run_dir, restart_attempt()
        checkpoint, skipped = find_resume_checkpoint(run_dir, rank=worker.rank,
                                                     world_size=worker.world_size)
        state, resumed_from = initial_state(plan_config), None
        if checkpoint is not None:
            resumed = resume(checkpoint, worker, plan_config)
            if resumed.state.epoch >= plan_config.epochs:
                raise UsageError(f"{checkpoint.path} is at epoch {resumed.state.epoch} and this "
                                 f"run has {plan_config.epochs} epochs: nothing left to train",
                                 hint=f"pass --epochs N with N > {resumed.state.epoch}")
            state, resumed_from = resumed.state, checkpoint.name
            self._resumed_from = resumed_from
            self.history[:] = resumed.history
            epochs_log.restore(resumed.history, start_samples=state.samples_seen)
        if worker.rank == 0 and (attempt > 0 or checkpoint is not None) and run_dir is not None:
            artifacts.rewrite_jsonl(run_dir / "metrics.jsonl", self.history)
            for line in skipped:
                _warn(f"checkpoint skipped: {line}")
            if checkpoint is not None:
                _info(f"resuming from {checkpoint.path} (epoch {state.epoch}, round "
                      f"{state.round_index})")
        worker.timeline.event("start", attempt=attempt, world_size=worker.world_size,
                              resumed_from=resumed_from, epoch=state.epoch,
                              round=state.round_index, skipped=skipped)
        every = CheckpointEvery.parse(config.checkpoint_every)
        if every is not None and run_dir is not None:
            worker.checkpointer = Checkpointer(run_dir, every, self.history)
        return state

    def _summary(self, worker: Worker, config: EngineConfig, backend: str, wall_s: float,
                 state: Any, final_checksum: str, epochs_log: EpochLog) -> dict[str, Any]:
        totals, world = worker.totals, worker.world_size
        row = [0.0] * (4 * world)
        row[4 * worker.rank: 4 * worker.rank + 4] = [totals.samples, totals.busy_s,
                                                     totals.sleep_s, totals.wait_s]
        flat = all_reduce_sum(row, device=worker.device)
        per_rank = [flat[4 * r: 4 * r + 4] for r in range(world)]
        devices = [str(worker.device)] * world
        if world > 1:
            dist.all_gather_object(devices, _device_label(worker.device))
        return artifacts.build_summary(
            config=_with_backend(config, backend), world_size=world, devices=devices,
            wall_s=wall_s, per_rank=per_rank, comm_ms=totals.comm_ms, syncs=totals.syncs,
            eval_metrics=epochs_log.last_eval, final_loss=epochs_log.last_loss,
            extra={"eval_s": epochs_log.eval_s, "seed": config.seed,
                   "anchor_history": [list(item) for item in state.anchor_history],
                   "final_anchor": state.anchor, "checksum": final_checksum,
                   "emulated_sleep_s": [r[2] for r in per_rank],
                   "attempt": restart_attempt(), "resumed_from": self._resumed_from},
        )


def _warn(message: str) -> None:
    from fdl import console

    console.warn(message)


def _info(message: str) -> None:
    from fdl import console

    console.info(message)


def _node_sampler(run_dir: Path | None, *, local_rank: int, device: torch.device) -> Any:
    """Local rank 0's utilisation sampler (timeline/samples-node<n>.jsonl). It must never stop
    training: a run directory it cannot write to only costs the utilisation curves."""
    from fdl.engine.sampler import start_node_sampler

    try:
        return start_node_sampler(run_dir, local_rank=local_rank,
                                  node=int(os.environ.get("GROUP_RANK", "0")), device=device,
                                  local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except OSError as exc:
        _warn(f"utilisation sampler not started: {exc}")
        return None


def _dist_env() -> tuple[int, int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0"))


def _pick_device(local_rank: int, backend: str) -> torch.device:
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    if backend == "nccl":
        raise UsageError("backend 'nccl' needs a CUDA GPU, and this worker has none",
                         hint="use --backend cpu (or auto)")
    return torch.device("cpu")


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s random streams after initialisation (rank 0 keeps ``seed``,
    so a solo run draws what it always drew)."""
    return seed + 1_000_003 * rank


def agreed_backend(requested: str, *, can_nccl: bool, all_can_nccl: Callable[[bool], bool]) -> str:
    """The averaging backend every rank uses. ``auto`` is decided for the whole group:
    ``all_can_nccl(mine)`` is True only if every rank can use NCCL (a GPU and NCCL) — a group
    mixing a CPU worker with GPU workers would otherwise pick gloo on one side and NCCL on the
    other and hang in the first collective."""
    if requested != "auto":
        return requested
    return "nccl" if all_can_nccl(can_nccl) else "cpu"


def _init_group(requested: str, device: torch.device, world_size: int) -> tuple[bool, str, Any]:
    """Join the process group; returns (created it, backend, the group averaging uses).

    ``nccl`` and ``cpu`` make the default group of that kind. ``auto`` makes a gloo default
    group (every worker can), agrees on one backend over it (:func:`agreed_backend`) and, when
    every rank can use NCCL, adds an NCCL group for the averaging and DDP."""
    can_nccl = device.type == "cuda" and dist.is_nccl_available()
    if world_size <= 1:
        return False, agreed_backend(requested, can_nccl=can_nccl, all_can_nccl=bool), None
    created = not dist.is_initialized()
    if requested != "auto":
        if created:
            dist.init_process_group(backend="nccl" if requested == "nccl" else "gloo",
                                    device_id=device if device.type == "cuda" else None)
        return created, requested, None
    if created:
        dist.init_process_group(backend="gloo")
    backend = agreed_backend(requested, can_nccl=can_nccl, all_can_nccl=_all_true)
    return created, backend, dist.new_group(backend="nccl") if backend == "nccl" else None


def _all_true(mine: bool) -> bool:
    flag = torch.tensor([1 if mine else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} {torch.cuda.get_device_name(device)}"
    return f"cpu ({torch.get_num_threads()} threads)"


def _with_backend(config: EngineConfig, backend: str) -> EngineConfig:
    from dataclasses import replace

    return replace(config, backend=backend)
