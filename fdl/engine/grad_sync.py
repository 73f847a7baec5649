"""``sync`` in the user's own loop: the gradients are averaged as the step's last backward ends.

fdl.Trainer calls the model through DDP, whose hooks all-reduce gradient buckets during
backward. A loop script calls its own model, so there is no DDP forward to hook. Instead, each
parameter's post-accumulate-grad hook (public autograd API) counts the gradients a backward has
finished, and when the step's last batch's backward has finished every one of them, one flat
all-reduce, divided by the ranks with data, replaces each gradient with the mean: DDP's
arithmetic, once per optimizer step (an accumulating loop reduces after the k-th batch, as DDP
under ``no_sync``), and before the script's code after ``backward()`` runs, so clipping and an
fp16 GradScaler's inf check see the mean on every rank, as under DDP (the scalers, starting
alike and seeing the same gradients, stay alike).

The engine arms the sync before it hands out a step's last batch (:meth:`GradSync.arm`). A
parameter that gets no gradient in that backward keeps the count from finishing: then the
optimizer's pre-step hook reduces (after the script's clipping: a model with unused parameters
clips its own gradient, a documented difference from DDP's ``find_unused_parameters``).

On CUDA with NCCL the buffer lives on the GPU and the all-reduce is queued on the stream:
nothing waits for the device. Over gloo (``--backend cpu``) a GPU's gradients go through host
memory. Each step's all-reduce is timed apart from compute (sync, not compute), as
fdl.engine.ddp_comm does for DDP: :class:`GradSync` is the step timer's ``CommClock``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fdl.engine.speed import StepComm, mark


class GradSync:
    """The gradient all-reduce of one model and optimizer, and what it timed this step."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 device: torch.device, via_host: bool, process_group: Any = None):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.process_group = process_group
        self.ranks_with_data = dist.get_world_size(process_group)
        self.device = device
        self.via_host = via_host
        self._cuda = device.type == "cuda"
        self._buffer_device = torch.device("cpu") if via_host else device
        self._comm: StepComm = None
        self._waiting = 0  # gradients the armed backward has still to finish
        self._reduced = False  # this step's gradients are the mean already
        self._handles = [p.register_post_accumulate_grad_hook(self._accumulated)
                         for p in self.params]
        self._handles.append(optimizer.register_step_pre_hook(self._before_step))

    def arm(self) -> None:
        """The next backward is the step's last: reduce as soon as it has finished."""
        self._waiting, self._reduced = len(self.params), False

    def _accumulated(self, _: torch.Tensor) -> None:
        if self._waiting:
            self._waiting -= 1
            if not self._waiting:
                self._reduce_grads()

    def _before_step(self, *_: Any) -> None:
        if not self._reduced:  # a parameter without a gradient kept the count from finishing
            self._reduce_grads()
        self._waiting, self._reduced = 0, False

    def _reduce_grads(self) -> None:
        started = mark(self.device)
        flat = torch.cat([self._grad(p).reshape(-1) for p in self.params]).to(
            self._buffer_device, self._dtype())
        self._reduce(flat)
        offset = 0
        for param in self.params:
            count = param.numel()
            reduced = flat[offset:offset + count].view_as(param).to(param.device, param.dtype)
            if param.grad is None:
                param.grad = reduced
            else:
                param.grad.copy_(reduced)
            offset += count
        self._comm = self._span(started, mark(self.device))
        self._reduced = True

    def shadow(self, *, ranks_with_data: int) -> None:
        """Join one all-reduce of the ranks that still step, with zeros (this rank has no data
        left in the round)."""
        self.ranks_with_data = ranks_with_data
        numel = sum(p.numel() for p in self.params)
        self._reduce(torch.zeros(numel, dtype=self._dtype(), device=self._buffer_device))

    def _reduce(self, flat: torch.Tensor) -> None:
        flat.div_(self.ranks_with_data)
        dist.all_reduce(flat, group=self.process_group)

    def _grad(self, param: nn.Parameter) -> torch.Tensor:
        return param.grad if param.grad is not None else torch.zeros_like(param)

    def _dtype(self) -> torch.dtype:
        return torch.float64 if any(p.dtype == torch.float64 for p in self.params) \
            else torch.float32

    def begin_step(self) -> None:
        self._comm = None

    def end_step(self) -> StepComm:
        return self._comm

    def _span(self, start: Any, end: Any) -> StepComm:
        return (start, end) if self._cuda else max(0.0, end - start)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
