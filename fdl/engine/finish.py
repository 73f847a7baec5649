"""A run's end, after its last round: every rank's figures for the run in one collective, the
typed summary (fdl.rundir.summary.RunSummary) and, on rank 0, ``summary.json`` and the
consensus model (``model.pt``); the :class:`RunResult` every rank returns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fdl.engine.averaging import checksum
from fdl.engine.collectives import device_label, exchange_rows, gather_labels
from fdl.engine.p2p import P2PChoice
from fdl.engine.parts import Parts
from fdl.engine.plan import PlanState, auto_undecided
from fdl.engine.policies import PolicyChoice
from fdl.engine.recovery import restart_attempt
from fdl.engine.state import RankEnd
from fdl.rundir.model import save_model
from fdl.rundir.summary import OuterStep, RankSummary, RunSummary, write_summary


@dataclass
class RunResult:
    """What ``run.finish()`` (and ``fdl.Trainer.fit()``) returns on every rank."""

    model: nn.Module  # the consensus model (the script's own module; fit(): on the CPU)
    metrics: dict[str, float]  # the last evaluation
    history: list[dict[str, Any]]  # one record per epoch
    summary: dict[str, Any]  # as written to summary.json
    run_dir: Path | None


def finish_run(parts: Parts, state: PlanState, *, started: float,
               choice: PolicyChoice | None, resumed_from: str | None, micro_batch_size: int,
               p2p: P2PChoice | None, in_precision: bool = True) -> RunResult:
    """The run's end on every rank (the module docstring); ``started`` is when training
    started (the evaluations' time is left out of the wall time); ``micro_batch_size`` and
    ``in_precision``: what this rank computed in (a loop that never asked for its micro-parts
    or its autocast computed whole batches in fp32, and the summary says so)."""
    wall_s = time.perf_counter() - started - parts.evaluator.eval_s
    parts.replica.sync.close()  # DDP's wrapper dropped before the process group goes
    model = parts.replica.model
    final_checksum = checksum(model)
    parts.timeline.event("final", checksum=final_checksum, anchor=state.anchor)
    parts.timeline.close()
    if parts.config.policy.decides:  # auto ended before it chose: it trained as cadence
        choice = auto_undecided(state)
    policy = choice.policy.name if choice is not None and parts.config.policy.decides \
        else parts.config.policy.name
    summary = RunSummary(
        policy=policy, backend=parts.replica.group.backend,
        emulated_slowdown=parts.config.simulate_slowdown, epochs=parts.config.epochs,
        wall_s=wall_s, ranks=_ranks(parts, micro_batch_size, in_precision), syncs=parts.tallies.totals.syncs,
        comm_ms=parts.tallies.totals.comm_ms, eval=parts.evaluator.last,
        final_loss=parts.recorder.last_loss, eval_s=parts.evaluator.eval_s,
        seed=parts.config.seed, anchor_history=list(state.anchor_history),
        final_anchor=state.anchor, checksum=final_checksum,
        average_bytes=parts.replica.averager.bytes if parts.replica.averager else 0,
        average_dtype=parts.config.average_dtype, outer_optimizer=_outer(parts),
        gradient_bytes=sum(p.numel() * p.element_size()
                           for p in model.parameters() if p.requires_grad),
        accumulate=parts.feed.accumulate, samples_planned=state.config.num_samples,
        attempt=restart_attempt(), resumed_from=resumed_from,
        nccl_p2p=p2p.to_dict() if p2p is not None else None,
        policy_choice=choice.to_dict() if choice is not None else None)
    document = summary.to_dict()
    run_dir = parts.config.run_dir
    if run_dir is not None and parts.rank == 0:
        write_summary(run_dir, document)
        save_model(run_dir, model)
    return RunResult(model, parts.evaluator.last, list(parts.recorder.history), document,
                     run_dir)


def _ranks(parts: Parts, micro_batch_size: int, in_precision: bool) -> list[RankSummary]:
    """Every rank's part of the run, in one collective (and, with several ranks, one gather of
    the devices' names)."""
    world, device, averager = parts.world_size, parts.device, parts.replica.averager
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    own = averager.memory_bytes() if averager is not None else (0, 0)
    mine = RankEnd(parts.tallies.totals.figures, micro_batch_size, peak, *own, in_precision)
    ends = [RankEnd.from_row(row) for row in exchange_rows(
        mine.to_row(), rank=parts.rank, world_size=world, device=device)]
    devices = gather_labels(device_label(device), world_size=world) if world > 1 \
        else [str(device)]
    return [RankSummary(device=name, precision=precision if end.in_precision else "fp32",
                        samples=int(end.figures.samples),
                        busy_s=end.figures.busy_s, emulated_sleep_s=end.figures.sleep_s,
                        data_wait_s=end.figures.data_s, ddp_comm_s=end.figures.comm_s,
                        micro_batch_size=end.micro_batch_size,
                        peak_memory_bytes=end.peak_memory_bytes,
                        fdl_device_bytes=end.fdl_device_bytes, fdl_host_bytes=end.fdl_host_bytes)
            for end, name, precision in zip(ends, devices, parts.precisions, strict=True)]


def _outer(parts: Parts) -> OuterStep:
    config, averager = parts.config, parts.replica.averager
    outer = averager.outer if averager is not None else None
    return OuterStep(name=config.outer_optimizer, lr=config.outer_lr,
                     momentum=config.outer_momentum, steps=outer.steps if outer else 0)
