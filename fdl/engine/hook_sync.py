"""``sync`` in the user's own loop: the gradients are averaged as the step's last backward runs.

fdl.Trainer calls the model through DDP, whose hooks all-reduce gradient buckets during
backward. A loop script calls its own model, so there is no DDP forward to hook. Instead fdl
does what DDP's reducer does, through public autograd API: the parameters are laid out, in
reverse order (about the order backward finishes them), in buckets of flat buffers (the first
:data:`FIRST_BUCKET_BYTES`, then :data:`BUCKET_BYTES` each, DDP's sizes). Each parameter's
post-accumulate-grad hook copies its gradient into its bucket, divided by the ranks with data in
the same pass; a bucket whose gradients are all there has its all-reduce started
(asynchronously, in bucket order on every rank), so it runs while backward still computes the
earlier layers. When the backward has finished every gradient, the last hook waits for the
all-reduces and points each gradient at its reduced part of the bucket (a view, as DDP's
``gradient_as_bucket_view``: no copy back, no second copy of the gradients). DDP's arithmetic,
once per optimizer step (an accumulating loop reduces after the k-th batch, as DDP under
``no_sync``), and before the script's code after ``backward()`` runs, so clipping and an fp16
GradScaler's inf check see the mean on every rank, as under DDP (the scalers, starting alike and
seeing the same gradients, stay alike).

The engine arms the sync before it hands out a step's last batch (:meth:`HookSync.last_batch`). A
parameter that gets no gradient in that backward keeps its bucket from starting: then the
optimizer's pre-step hook reduces what is left, an absent gradient as zeros (after the
script's clipping: a model with unused parameters clips its own gradient, a documented
difference from DDP's ``find_unused_parameters``).

On CUDA with NCCL the buckets live on the GPU: a bucket's copies are queued on the compute
stream, NCCL's stream waits for them, and the compute stream waits for NCCL's before the
optimizer step (``Work.wait``): nothing waits for the device on the host. Over gloo
(``--backend cpu``) a GPU's buckets are in host memory, so each copy waits for its gradient.
Each step's all-reduce is timed as DDP's is (fdl.engine.ddp_sync): from the last bucket handed
over to the all-reduces done, the part no compute hides, booked as sync, not compute:
:class:`HookSync` is the step timer's ``CommClock``.

A round some ranks have fewer steps in (:meth:`HookSync.uneven`): a rank out of samples joins
the others' remaining all-reduces with zeros, then takes the parameters of a rank that made
every step, as DDP's ``join`` does for fdl.Trainer (``_sync_final_model``): its optimizer did
not step, so its replica would otherwise stay behind (its optimizer state stays its own, as under
DDP). Micro-batches (:meth:`HookSync.parts`): iterating the parts holds the reduction back until
the last part's backward, so clipping still sees the mean.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fdl.engine.collectives import broadcast_from
from fdl.engine.speed import StepComm, mark

FIRST_BUCKET_BYTES = 1 << 20  # DDP's first bucket: small, so the first all-reduce starts early
BUCKET_BYTES = 25 << 20  # DDP's bucket_cap_mb


@dataclass
class Bucket:
    """Consecutive parameters (in backward's order) sharing one flat buffer."""

    flat: torch.Tensor
    params: list[int]  # indices into HookSync.params
    waiting: int = 0  # gradients of the armed backward still to come
    work: Any = field(default=None, repr=False)  # the all-reduce in flight


class HookSync:
    """The gradient all-reduce of one model and optimizer, and what it timed this step (a
    :class:`fdl.engine.grad_sync.GradSync`)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 device: torch.device, via_host: bool, process_group: Any = None):
        self.step_model = model  # the script calls its own model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.process_group = process_group
        self.ranks_with_data = dist.get_world_size(process_group)
        self.device = device
        self.via_host = via_host
        self._cuda = device.type == "cuda"
        self.buckets, self._where = _layout(
            self.params, torch.device("cpu") if via_host else device)
        self._comm: StepComm = None
        self._armed = False
        self._copied: list[bool] = []  # which gradients of the armed backward are in
        self._waiting = 0  # gradients the armed backward has still to finish
        self._launched = 0  # buckets whose all-reduce has started, in order
        self._handed: Any = None  # when the last bucket was handed over
        self._reduced = False  # this step's gradients are the mean already
        self._handles = [p.register_post_accumulate_grad_hook(partial(self._accumulated, i))
                         for i, p in enumerate(self.params)]
        self._handles.append(optimizer.register_step_pre_hook(self._before_step))

    def before_step(self, *, ranks_with_data: int) -> None:
        self.ranks_with_data = ranks_with_data

    def last_batch(self) -> None:
        self.arm()

    def arm(self) -> None:
        """The next backward is the step's last: reduce as soon as its gradients are there."""
        self._armed, self._waiting, self._launched, self._reduced = \
            True, len(self.params), 0, False
        self._copied = [False] * len(self.params)
        for bucket in self.buckets:
            bucket.waiting, bucket.work = len(bucket.params), None

    def _accumulated(self, index: int, _: torch.Tensor) -> None:
        if not self._armed or self._copied[index]:
            return
        self._copy_in(index)
        bucket = self.buckets[self._where[index][0]]
        bucket.waiting -= 1
        if not bucket.waiting:
            self._launch_ready()
        self._waiting -= 1
        if not self._waiting:
            self._finish()

    def _before_step(self, *_: Any) -> None:
        if self._armed and not self._reduced:  # a parameter without a gradient held a bucket
            for index in range(len(self.params)):
                if not self._copied[index]:
                    self._copy_in(index)
            for bucket in self.buckets:
                bucket.waiting = 0
            self._launch_ready()
            self._finish()
        self._armed, self._reduced = False, False

    def _copy_in(self, index: int) -> None:
        """Parameter ``index``'s gradient, divided by the ranks with data, into its part of its
        bucket (zeros: none). The division rides on the copy, as a multiplication by the
        reciprocal (DDP's reducer does the same): one pass over the gradient, where a copy then
        a ``div_`` of the bucket would take two, the second the dearer on a CPU (docs/elche.md,
        "Measurements behind the engine's choices")."""
        param, part = self.params[index], self._part(index)
        grad, scale = param.grad, 1.0 / self.ranks_with_data
        if grad is None:
            part.zero_()
        elif _same_memory(grad, part):  # last step's view, accumulated into in place
            part.mul_(scale)
        elif grad.device == part.device:
            torch.mul(grad.reshape(-1), scale, out=part)
        else:  # a GPU's gradient into a host bucket (gloo): no mul across devices
            part.copy_(grad.reshape(-1)).mul_(scale)
        self._copied[index] = True

    def _launch_ready(self) -> None:
        """Start the all-reduce of each bucket that is ready, in bucket order (the same
        collectives in the same order on every rank, whatever order backward ran in)."""
        while self._launched < len(self.buckets) and not self.buckets[self._launched].waiting:
            bucket = self.buckets[self._launched]
            self._handed = mark(self.device)
            bucket.work = dist.all_reduce(bucket.flat, group=self.process_group, async_op=True)
            self._launched += 1

    def _finish(self) -> None:
        """Wait for the all-reduces (on CUDA: the compute stream waits for NCCL's) and point
        each gradient at its mean."""
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.work = None
        for index, param in enumerate(self.params):
            reduced = self._part(index).view_as(param)
            if reduced.dtype == param.dtype and reduced.device == param.device and \
                    param.is_contiguous():
                param.grad = reduced
            elif param.grad is not None and not _same_memory(param.grad, reduced):
                param.grad.copy_(reduced)
            else:
                param.grad = reduced.to(param.device, param.dtype)
        self._comm = self._span(self._handed, mark(self.device))
        self._reduced = True

    def hold(self) -> bool:
        """No reduction until :meth:`arm` (a micro-batch that is not the batch's last);
        returns whether the sync was armed."""
        armed, self._armed = self._armed, False
        return armed

    def parts(self, parts: list[tuple[Any, float]]) -> list[tuple[Any, float]]:
        return parts if len(parts) < 2 else MicroParts(parts, self)

    def empty_step(self) -> None:
        self.shadow(ranks_with_data=self.ranks_with_data)

    def shadow(self, *, ranks_with_data: int) -> None:
        """Join the all-reduces of a step of the ranks that still step, with zeros (this rank
        has no data left in the round): bucket by bucket, as theirs."""
        self.ranks_with_data = ranks_with_data
        for bucket in self.buckets:
            bucket.flat.zero_()
            dist.all_reduce(bucket.flat, group=self.process_group)

    @contextlib.contextmanager
    def uneven(self, steps: Sequence[int], *, rank: int) -> Iterator[None]:
        """The rank's steps, then the others' remaining all-reduces joined and, when the ranks'
        steps differ, the parameters of a rank that made every step (the module docstring)."""
        yield
        most = max(steps)
        for index in range(steps[rank], most):
            self.shadow(ranks_with_data=sum(count > index for count in steps))
        if any(count < most for count in steps):  # the plan's: alike on every rank
            broadcast_from([p.data for p in self.step_model.parameters()], steps.index(most),
                           via_host=self.via_host, group=self.process_group)

    def _part(self, index: int) -> torch.Tensor:
        bucket, offset = self._where[index]
        return self.buckets[bucket].flat[offset:offset + self.params[index].numel()]

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


class MicroParts(list):
    """A batch's micro-batches under the hook reducer: iterating them holds the all-reduce
    back until the last part (the engine armed it for the batch: it is the step's last), so
    the earlier parts' backward passes only accumulate. A batch that is not its step's last
    was never armed and stays so."""

    def __init__(self, parts: list[tuple[Any, float]], sync: HookSync) -> None:
        super().__init__(parts)
        self._sync = sync

    def __iter__(self) -> Iterator[tuple[Any, float]]:
        armed = self._sync.hold()
        for index, part in enumerate(list.__iter__(self)):
            if armed and index == len(self) - 1:
                self._sync.arm()
            yield part


def _layout(params: list[nn.Parameter],
            device: torch.device) -> tuple[list[Bucket], list[tuple[int, int]]]:
    """The buckets of ``params`` in reverse order, and where each parameter is (bucket,
    offset). A bucket holds one reduction dtype (float64 for float64 parameters, else
    float32: parameters in half precision are averaged in float32, as the averages are)."""
    groups: list[tuple[torch.dtype, list[int]]] = []
    size = cap = 0
    for index in reversed(range(len(params))):
        dtype = torch.float64 if params[index].dtype == torch.float64 else torch.float32
        nbytes = params[index].numel() * (8 if dtype == torch.float64 else 4)
        if not groups or groups[-1][0] != dtype or (size and size + nbytes > cap):
            groups.append((dtype, []))
            size, cap = 0, FIRST_BUCKET_BYTES if len(groups) == 1 else BUCKET_BYTES
        groups[-1][1].append(index)
        size += nbytes
    where: list[tuple[int, int]] = [(0, 0)] * len(params)
    buckets = []
    for number, (dtype, members) in enumerate(groups):
        offset = 0
        for index in members:
            where[index] = (number, offset)
            offset += params[index].numel()
        buckets.append(Bucket(torch.zeros(offset, dtype=dtype, device=device), members))
    return buckets, where


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.data_ptr() == b.data_ptr() and a.numel() == b.numel()
