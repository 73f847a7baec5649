"""Weighted averaging of replicas across ranks: the ``cpu`` and ``nccl`` backends.

One collective per averaging event carries everything: ``w_r x`` (parameters, then floating
buffers such as BatchNorm statistics, flattened) and a block of per-rank numbers (the round's
timing stats) in which rank r fills only its own row. A SUM all-reduce then yields the weighted
average ``sum_r w_r theta_r`` (weights = samples in the round, summing to 1) and every rank's
stats, identical on every rank — so every rank plans the next round alike.

* ``cpu``: the flat buffer lives in host memory and is reduced over a gloo group. Copies into and
  out of it are blocking, so no device-to-host copy is read before it completes and no
  host-to-device copy is pending when the next snapshot is taken (flodl 0.3 raced here).
* ``nccl``: the flat buffer lives on the GPU and is reduced by NCCL.

Integer buffers (``num_batches_tracked``) are reduced with MAX at blocking averages. After a
blocking average every replica holds exactly the reduced bits (``checksum`` proves it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn


class Averager:
    """The flat buffers of one model replica and the collectives over them."""

    def __init__(self, model: nn.Module, *, rank: int, world_size: int, backend: str,
                 device: torch.device, num_stats: int, params: bool = True):
        """``params=False`` averages buffers only (``sync``: DDP keeps parameters identical,
        and re-averaging identical values could change their last bits)."""
        self.rank, self.world_size, self.num_stats = rank, world_size, num_stats
        self.tensors = ([p.data for p in model.parameters()] if params else []) + [
            b for b in model.buffers() if b.is_floating_point()]
        self.int_tensors = [b for b in model.buffers() if not b.is_floating_point()]
        self.numel = sum(t.numel() for t in self.tensors)
        self.via_host = backend != "nccl"
        buffer_device = device if backend == "nccl" else torch.device("cpu")
        size = self.numel + world_size * num_stats
        self.flat = torch.zeros(size, dtype=torch.float32, device=buffer_device)
        self.snapshot = torch.zeros(self.numel, dtype=torch.float32, device=buffer_device)
        self.bytes = self.flat.numel() * self.flat.element_size()

    @torch.no_grad()
    def pack(self, *, weight: float, stats: Sequence[float], keep_snapshot: bool) -> None:
        """Fill the buffer with ``weight x theta`` and this rank's stats row."""
        offset = 0
        for tensor in self.tensors:  # blocking copies: complete before the buffer is read
            count = tensor.numel()
            self.flat[offset:offset + count].copy_(tensor.reshape(-1))
            offset += count
        if keep_snapshot:
            self.snapshot.copy_(self.flat[:self.numel])
        self.flat[:self.numel].mul_(weight)
        self.flat[self.numel:].zero_()
        row = self.numel + self.rank * self.num_stats
        self.flat[row:row + self.num_stats] = torch.tensor(list(stats), dtype=torch.float32)

    def all_reduce(self, *, async_op: bool) -> dist.Work | None:
        return dist.all_reduce(self.flat, op=dist.ReduceOp.SUM, async_op=async_op)

    def stats(self) -> list[list[float]]:
        """Every rank's stats row, after the reduction completed."""
        block = self.flat[self.numel:].view(self.world_size, self.num_stats)
        return block.cpu().tolist()

    @torch.no_grad()
    def load_average(self) -> None:
        """theta := the reduced average (blocking copies), and integer buffers := their max."""
        offset = 0
        for tensor in self.tensors:
            count = tensor.numel()
            tensor.copy_(self.flat[offset:offset + count].view_as(tensor))
            offset += count
        for tensor in self.int_tensors:
            reduce_in_place(tensor, op=dist.ReduceOp.MAX, via_host=self.via_host)

    @torch.no_grad()
    def apply_delta(self) -> None:
        """Async: theta += average - snapshot, keeping the local progress made meanwhile."""
        delta = self.flat[:self.numel] - self.snapshot
        offset = 0
        for tensor in self.tensors:
            count = tensor.numel()
            tensor.add_(delta[offset:offset + count].view_as(tensor).to(tensor.device,
                                                                         tensor.dtype))
            offset += count

    def distance_from_average(self) -> float:
        """||snapshot - average|| / ||average||: how far this replica had drifted when it was
        packed (the divergence guard's measure). Call after the reduction completed."""
        average = self.flat[:self.numel]
        norm = float(average.norm())
        return float((self.snapshot - average).norm()) / norm if norm > 0 else 0.0


def reduce_in_place(tensor: torch.Tensor, *, op: dist.ReduceOp, via_host: bool) -> None:
    """all_reduce ``tensor``; over gloo a GPU tensor goes through a (blocking) host copy."""
    if via_host and tensor.device.type != "cpu":
        host = tensor.cpu()
        dist.all_reduce(host, op=op)
        tensor.copy_(host)
    else:
        dist.all_reduce(tensor, op=op)


def broadcast_from_rank0(tensors: list[torch.Tensor], *, via_host: bool) -> None:
    """Give every rank rank 0's values (identical start even if initialisation is random)."""
    for tensor in tensors:
        if via_host and tensor.device.type != "cpu":
            host = tensor.cpu()
            dist.broadcast(host, src=0)
            tensor.copy_(host)
        else:
            dist.broadcast(tensor, src=0)


def checksum(model: nn.Module) -> str:
    """sha256 over every parameter and buffer's bytes: equal strings = bitwise equal replicas."""
    digest = hashlib.sha256()
    for tensor in [*model.parameters(), *model.buffers()]:
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]
