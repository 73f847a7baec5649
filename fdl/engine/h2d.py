"""Host-to-device copies one batch ahead, on a side stream (CUDA only).

On the compute stream, a batch's copy waits for the previous step's kernels and the step's
kernels wait for the copy: the copy's time is added to every step (a 128-image CIFAR batch is
1.5 MB, ~0.1 ms at 12 GB/s; an ImageNet-sized one 77 MB, ~6 ms: computed, not measured).
:class:`DeviceCopies` issues batch i+1's copy on a stream of its own as batch i is handed to the
step, so the copy runs while batch i computes. The order is kept with an event per batch: the
compute stream waits for it on the GPU (``wait_event``), the host never waits for the device (no
synchronize on the step path). Each batch's memory is marked as used by the compute stream
(``record_stream``) so the caching allocator does not hand it out again while a kernel still
reads it.

The copy is asynchronous only from pinned host memory: a DataLoader's workers pin their batches
when ``pin_memory`` is on (the default on CUDA, fdl.engine.data); a batch made in the training
process is pageable and its copy blocks the host, on the side stream all the same. One batch
more is on the device at a time than without the copies ahead.

The CUDA calls go through :class:`CudaStreams`, the one place that names them; tests give a
recording stand-in (this project's CI has no GPU) and ``tests/engine/test_gpu.py`` runs the
real one.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from fdl.engine.data import map_tensors, to_device


class CudaStreams:
    """The CUDA stream API :class:`DeviceCopies` uses, as torch.cuda has it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self) -> Any:
        return torch.cuda.Stream(device=self.device)

    def current(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def on(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def record_event(self, stream: Any) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def used_by(self, tensor: torch.Tensor, stream: Any) -> None:
        if tensor.is_cuda:
            tensor.record_stream(stream)


class DeviceCopies:
    """A rank's side stream for host-to-device copies, kept for the run."""

    def __init__(self, device: torch.device, *, streams: Any = None) -> None:
        self.device = device
        self.streams = CudaStreams(device) if streams is None else streams
        self._stream = self.streams.new_stream()

    @classmethod
    def for_device(cls, device: torch.device) -> DeviceCopies | None:
        """One for a CUDA device; None elsewhere (a CPU batch needs no copy)."""
        return cls(device) if device.type == "cuda" else None

    def ahead(self, fetch: Callable[[], Any], count: int) -> Callable[[], Any]:
        """A fetch of ``count`` batches on the device: each call returns the next batch of
        ``fetch()``, its copy issued on the side stream one call earlier (the first one now)
        and waited for by the current stream; then it issues the next batch's copy. Never
        calls ``fetch`` more than ``count`` times (a slice's last batch prefetches nothing)."""
        pending: deque[tuple[Any, Any]] = deque()
        left = count

        def issue() -> None:
            nonlocal left
            if left <= 0:
                return
            left -= 1
            host = fetch()
            with self.streams.on(self._stream):
                moved = to_device(host, self.device)
                pending.append((moved, self.streams.record_event(self._stream)))

        def next_batch() -> Any:
            if not pending:
                issue()
            if not pending:
                raise StopIteration("the slice's batches are all taken")
            moved, event = pending.popleft()
            current = self.streams.current()
            self.streams.wait(current, event)
            map_tensors(moved, lambda tensor: self.streams.used_by(tensor, current))
            issue()  # the next copy runs while this batch computes
            return moved

        return next_batch

