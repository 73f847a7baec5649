"""Sync in ``fdl.Trainer``: DDP's wrapper (:class:`DdpSync`), and its all-reduce timed, so that
sync's communication is booked as sync, not compute (:class:`DdpCommMeter`).

:class:`DdpSync` is the :class:`fdl.engine.grad_sync.GradSync` of a step that calls the model
through ``DistributedDataParallel`` (gradients as views of DDP's buckets: no copy into the
buckets and back each step, and no second copy of every gradient on the device). A round some
ranks have no step in (an epoch's uneven last round) runs under DDP's ``join``; micro-batches
but the last run under ``no_sync``.

Under ``sync`` every step's ``backward()`` all-reduces the gradients: DDP hands each bucket of
gradients to a communication hook as soon as the bucket is ready and, before ``backward()``
returns, waits for every bucket's future. :class:`DdpCommMeter` is that hook
(``DistributedDataParallel.register_comm_hook``, torch's public API for it). It does what DDP's
default hook does (``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook``:
divide, then a SUM all-reduce; the division as a multiplication by the reciprocal, as DDP's
reducer does it without a hook) and times it: when the step's last bucket was handed over — the
backward pass has computed every gradient by then — and when the all-reduces had completed. The
time between is the step's communication that no compute overlaps: the collective itself and
the wait for the slowest peer in it. A bucket reduced while the backward pass still computes is
hidden behind it and stays compute, as it would on any device. The round loop's
:class:`~fdl.engine.speed.StepTimer` takes this time out of the step's compute: it is booked as
sync (the round's ``comm_s``) and the slowdown emulation does not multiply it.

On the CPU (gloo) the hook reads ``time.perf_counter`` at the hand-over and in the future's
callback, which runs when the all-reduce has completed; DDP waits for the future the callback
returns, so both are read when ``backward()`` returns. On CUDA a collective's future completes
when the collective is queued, not when it is done: the hook records an event on the current
(compute) stream at the hand-over and one in the callback, which torch runs on a stream that
waits for the collective; :class:`~fdl.engine.speed.StepTimer` reads the two with the step's own
events, and nothing here waits for the device.

What is not timed: DDP's broadcast of module buffers at the start of each forward (models with
BatchNorm; ``broadcast_buffers``) and its one-off bucket rebuild in the second step. They stay in
the step's compute.

When: only under the slowdown emulation (``--simulate-slowdown`` with a factor other than 1),
which must sleep on compute alone. The hook's Python callbacks cost a few percent of a step on
gloo against DDP's own C++ all-reduce (docs/elche.md "Measurements behind the engine's
choices"), so otherwise DDP keeps its own and the all-reduce stays inside the step's time, as a
plain DDP script measures it (``fdl report`` then shows no sync time for a sync run).

Division: DDP's own (hook-less) all-reduce divides by the ranks that still have data when some
rank has run out of it in a round (``join(divide_by_initial_world_size=False)``: an epoch's
uneven last round); with a hook DDP leaves the division to the hook, so the round loop sets
:attr:`DdpCommMeter.ranks_with_data` before each step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fdl.engine.speed import StepComm, mark


class DdpSync:
    """``model`` stepped through DDP's wrapper; ``metered``: its all-reduce through
    :class:`DdpCommMeter` (the slowdown emulation must sleep on compute alone). Without the
    meter DDP keeps its own C++ all-reduce, inside the step's time, as a plain DDP script
    measures it (the hook's Python callbacks cost a step a few percent: docs/elche.md)."""

    def __init__(self, model: nn.Module, *, process_group: Any, device: torch.device,
                 metered: bool) -> None:
        self.model = model
        self.step_model: nn.Module = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            process_group=process_group, gradient_as_bucket_view=True)
        self.meter = DdpCommMeter.attach(self.step_model, process_group=process_group,
                                         device=device) if metered else None

    def begin_step(self) -> None:
        if self.meter is not None:
            self.meter.begin_step()

    def end_step(self) -> StepComm:
        return self.meter.end_step() if self.meter is not None else None

    def before_step(self, *, ranks_with_data: int) -> None:
        if self.meter is not None:  # with a hook DDP leaves the division to it
            self.meter.ranks_with_data = ranks_with_data

    def last_batch(self) -> None:
        return None  # DDP reduces every backward outside no_sync

    def empty_step(self) -> None:
        return None  # a step of no samples: DDP's join shadows it (uneven)

    def uneven(self, steps: Sequence[int], *, rank: int) -> contextlib.AbstractContextManager:
        """DDP needs every rank in every gradient all-reduce: a rank left without samples in an
        epoch's cut last round joins (shadows the collectives) instead of hanging the others;
        the gradient is divided by the ranks that have data, as a plain DDP step on them would
        be."""
        if len(steps) > 1 and 0 in steps and isinstance(self.step_model,
                                                        DistributedDataParallel):
            return self.step_model.join(divide_by_initial_world_size=False)
        return contextlib.nullcontext()

    def parts(self, parts: list[tuple[Any, float]]) -> list[tuple[Any, float]]:
        return parts if len(parts) < 2 else _QuietParts(parts, self.step_model)

    def close(self) -> None:
        self.step_model = self.model  # DDP dropped before the process group goes


class _QuietParts(list):
    """A batch's micro-batches under DDP: iterating them runs each part but the last under
    ``no_sync`` (gradients accumulated locally), the last one reduces them all."""

    def __init__(self, parts: list[tuple[Any, float]], ddp: nn.Module) -> None:
        super().__init__(parts)
        self._ddp = ddp

    def __iter__(self) -> Iterator[tuple[Any, float]]:
        for index, part in enumerate(list.__iter__(self)):
            if index < len(self) - 1 and isinstance(self._ddp, DistributedDataParallel):
                with self._ddp.no_sync():
                    yield part
            else:
                yield part


class DdpCommMeter:
    """The communication hook of one DDP model, and what it timed in the current step."""

    def __init__(self, *, process_group: Any, device: torch.device):
        self.process_group = process_group  # None: the default group
        self.world_size = dist.get_world_size(process_group)
        self.ranks_with_data = self.world_size
        self.device = device
        self._cuda = device.type == "cuda"
        self._handed: float | torch.cuda.Event | None = None  # the last bucket handed over
        self._done: float | torch.cuda.Event | None = None  # its all-reduce (CPU: all) done

    @classmethod
    def attach(cls, model: DistributedDataParallel, *, process_group: Any,
               device: torch.device) -> DdpCommMeter:
        """A meter registered as ``model``'s communication hook (before its first backward)."""
        meter = cls(process_group=process_group, device=device)
        model.register_comm_hook(meter, DdpCommMeter.hook)
        return meter

    # Not annotated: DDP checks the hook's annotations against the real classes, and this
    # module's (``from __future__ import annotations``) are strings.
    def hook(self, bucket):
        """DDP's default all-reduce of ``bucket`` (the mean over the ranks with data), timed."""
        tensor = bucket.buffer()
        tensor.mul_(1.0 / self.ranks_with_data)  # as DDP's own reducer: cheaper than a div_
        self._handed = mark(self.device)
        work = dist.all_reduce(tensor, group=self.process_group, async_op=True)

        def done(future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            self._completed()
            return future.value()[0]

        return work.get_future().then(done)

    def begin_step(self) -> None:
        self._handed = self._done = None

    def end_step(self) -> StepComm:
        """The step's exposed communication: seconds on the CPU, the pair of events that bracket
        it on CUDA; None when the step handed over no bucket."""
        if self._handed is None or self._done is None:
            return None
        if self._cuda:
            return (self._handed, self._done)
        return max(0.0, self._done - self._handed)

    def _completed(self) -> None:
        """An all-reduce finished (CPU: in gloo's thread; CUDA: queued after the collective)."""
        now = mark(self.device)
        if self._cuda or self._done is None:
            self._done = now  # CUDA: NCCL reduces the buckets in order, the last ends last
        else:
            self._done = max(self._done, now)

