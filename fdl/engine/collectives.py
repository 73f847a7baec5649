"""The process group and what travels over it outside an average: joining the group (torchrun's
environment), choosing this worker's device, agreeing on one averaging backend, and the small
collectives the engine needs (a broadcast of the initial weights, sums of figures per rank).

Every rank calls these in the same order; each is one collective (or none when not
distributed), so they never hang a rank that calls them alone.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fdl.engine.device_rules import check_backend
from fdl.engine.p2p import P2P_ENV, P2PChoice, missing_pairs, node_devices, p2p_choice, peer_pairs


@dataclass(frozen=True)
class Membership:
    """Where this process stands in the job, from torchrun's environment (solo: rank 0 of 1)."""

    rank: int
    world_size: int
    local_rank: int
    node: int  # GROUP_RANK: the node's index
    local_world_size: int

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Membership:
        env = os.environ if env is None else env
        return cls(rank=int(env.get("RANK", "0")), world_size=int(env.get("WORLD_SIZE", "1")),
                   local_rank=int(env.get("LOCAL_RANK", "0")),
                   node=int(env.get("GROUP_RANK", "0")),
                   local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")))

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


@dataclass(frozen=True)
class Group:
    """The joined group: the backend every rank averages with and the process group that
    carries the averages (None: the default group)."""

    backend: str  # "nccl" or "cpu"
    process_group: Any = None
    created: bool = False  # this process created the default group (and destroys it)
    p2p: P2PChoice | None = None  # NCCL_P2P_DISABLE as set for NCCL (None: no GPU, no NCCL)


def pick_device(local_rank: int, backend: str) -> torch.device:
    """This worker's device: ``cuda:local_rank`` (modulo the visible GPUs) when CUDA is
    available, else the CPU; ``backend == "nccl"`` without a GPU is a usage error."""
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    check_backend(backend, has_cuda=False)  # fdl run checks it before anything starts
    return torch.device("cpu")


def agreed_backend(requested: str, *, can_nccl: bool, all_can_nccl: Callable[[bool], bool]) -> str:
    """The averaging backend every rank uses. ``auto`` is decided for the whole group:
    ``all_can_nccl(mine)`` is True only if every rank can use NCCL (a GPU and NCCL) — a group
    mixing a CPU worker with GPU workers would otherwise pick gloo on one side and NCCL on the
    other and hang in the first collective."""
    if requested != "auto":
        return requested
    return "nccl" if all_can_nccl(can_nccl) else "cpu"


SEVERAL_NODES_TIMEOUT_S = 300.0  # a collective's wait for a peer, several nodes (auto)


def group_timeout(setting: float | None, membership: Membership) -> timedelta | None:
    """How long the group's collectives wait for a peer: the setting (``--collective-timeout``)
    when given; with several nodes, :data:`SEVERAL_NODES_TIMEOUT_S` (a node that stops answering
    without closing its connections, a laptop whose WiFi dropped, would otherwise hold the other
    for gloo's 30 minutes); on one node, torch's own (None)."""
    if setting is not None:
        return timedelta(seconds=setting)
    if membership.local_world_size < membership.world_size:
        return timedelta(seconds=SEVERAL_NODES_TIMEOUT_S)
    return None


def join_group(requested: str, device: torch.device, world_size: int, *,
               timeout: timedelta | None = None) -> Group:
    """Join the process group (once per process: an existing default group is used as is),
    its collectives waiting up to ``timeout`` for a peer (None: torch's default).

    ``nccl`` and ``cpu`` make the default group of that kind. ``auto`` makes a gloo default
    group (every worker can), agrees on one backend over it (:func:`agreed_backend`) and, when
    every rank can use NCCL, adds an NCCL group for the averaging and DDP."""
    can_nccl = device.type == "cuda" and dist.is_nccl_available()
    if world_size <= 1:
        return Group(agreed_backend(requested, can_nccl=can_nccl, all_can_nccl=bool))
    # before NCCL's first communicator: it reads NCCL_P2P_DISABLE when it is made
    p2p = nccl_p2p(os.environ) if can_nccl and requested != "cpu" else None
    created = not dist.is_initialized()
    if created:
        _bind_world_before_it_exists()
    if requested != "auto":
        if created:
            dist.init_process_group(backend="nccl" if requested == "nccl" else "gloo",
                                    device_id=device if device.type == "cuda" else None,
                                    timeout=timeout)
        return Group(requested, created=created, p2p=p2p if requested == "nccl" else None)
    if created:
        dist.init_process_group(backend="gloo", timeout=timeout)
    backend = agreed_backend(requested, can_nccl=can_nccl, all_can_nccl=all_true)
    return Group(backend, dist.new_group(backend="nccl", timeout=timeout)
                 if backend == "nccl" else None,
                 created=created, p2p=p2p if backend == "nccl" else None)


def nccl_p2p(env: MutableMapping[str, str], *, local_world_size: int | None = None) -> P2PChoice:
    """Check peer access between the GPUs this node's workers train on and, unless the user set
    ``NCCL_P2P_DISABLE``, set it to 1 in ``env`` (this process's environment) where a pair
    lacks it (fdl.engine.p2p says why). Every worker of a node asks the same driver about the
    same GPUs, so they all choose alike."""
    local = Membership.from_env(env).local_world_size if local_world_size is None \
        else local_world_size
    devices = node_devices(local, torch.cuda.device_count())
    checked = len(devices) >= 2 and P2P_ENV not in env
    missing = missing_pairs(peer_pairs(devices, torch.cuda.can_device_access_peer)) \
        if checked else ()
    choice = p2p_choice(missing, env=env, checked=len(devices) >= 2)
    if choice.source == "fdl" and choice.value is not None:
        env[P2P_ENV] = choice.value
    return choice


def _bind_world_before_it_exists() -> None:
    """Import torch.distributed.fsdp before the default group exists. It binds
    ``dist.group.WORLD`` as a default argument when imported (ShardedGradScaler's
    ``process_group``), and torch._dynamo imports it, so an optimizer made after the group would
    import it: the group would then stay referenced past ``destroy_process_group``, its gloo
    threads would live on to the interpreter's teardown, and a worker that had finished training
    would now and then abort there ("terminate called without an active exception", SIGABRT).
    Imported first, it binds None; a torch without it is left alone. Its cost in throughput is
    below the noise of interleaved runs (docs/elche.md "Benchmark").

    Imported with the cyclic collector paused (and the user's objects not frozen): the import
    allocates enough to set off full collections that walk everything torch made, a visible part
    of every worker's start (docs/run.md "Launch latency")."""
    paused = gc.isenabled()
    gc.disable()
    try:
        with contextlib.suppress(ImportError):
            import torch.distributed.fsdp  # noqa: F401
    finally:
        if paused:
            gc.enable()


def leave_group(group: Group) -> None:
    """Destroy the default group if this process created it. DDP's reducer sits in reference
    cycles: it is freed first, while its process group still exists, not at interpreter exit
    (where a worker can abort with "terminate called without an active exception")."""
    if group.created and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def all_true(mine: bool) -> bool:
    """Whether every rank's ``mine`` is True (a MIN all-reduce over the default group)."""
    flag = torch.tensor([1 if mine else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def broadcast_from_rank0(tensors: list[torch.Tensor], *, via_host: bool,
                         group: dist.ProcessGroup | None = None) -> None:
    """Give every rank of ``group`` (default: the default group) the values of its rank 0
    (identical start even if initialisation is random)."""
    broadcast_from(tensors, 0, via_host=via_host, group=group)


def broadcast_from(tensors: list[torch.Tensor], src: int, *, via_host: bool,
                   group: dist.ProcessGroup | None = None) -> None:
    """Give every rank of ``group`` the values of its rank ``src``."""
    for tensor in tensors:
        carrier = tensor.cpu() if via_host and tensor.device.type != "cpu" else tensor
        dist.broadcast(carrier, group=group, group_src=src)
        if carrier is not tensor:
            tensor.copy_(carrier)


def all_reduce_sum(values: Sequence[float], *, device: torch.device) -> list[float]:
    """Element-wise sum over ranks (identity when not distributed), in float64."""
    if not dist.is_initialized():
        return list(values)
    tensor = torch.tensor(list(values), dtype=torch.float64, device=collective_device(device))
    dist.all_reduce(tensor)
    return tensor.tolist()


def all_reduce_max(value: float, *, world_size: int, device: torch.device) -> float:
    """The largest of the ranks' ``value`` (``value`` when not distributed)."""
    if world_size == 1 or not dist.is_initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=collective_device(device))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def exchange_rows(row: Sequence[float], *, rank: int, world_size: int,
                  device: torch.device) -> list[list[float]]:
    """Every rank's ``row`` (all of one length), on every rank, in one collective: each rank
    fills its own row of a zero block and the block is summed."""
    width = len(row)
    block = [0.0] * (width * world_size)
    block[rank * width:(rank + 1) * width] = row
    flat = all_reduce_sum(block, device=device)
    return [flat[r * width:(r + 1) * width] for r in range(world_size)]


def gather_labels(label: str, *, world_size: int) -> list[str]:
    """Every rank's ``label`` (a few words, e.g. its device), in rank order."""
    labels = [label] * world_size
    if world_size > 1:
        dist.all_gather_object(labels, label)
    return labels


def collective_device(device: torch.device) -> torch.device:
    """Where a tensor for a collective over the default group must live: the device under
    NCCL, the host under gloo."""
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    return device if backend == "nccl" else torch.device("cpu")


def device_label(device: torch.device) -> str:
    """``cuda:0 NVIDIA GeForce RTX 4070`` or ``cpu (4 threads)``: what summary.json records."""
    if device.type == "cuda":
        return f"{device} {torch.cuda.get_device_name(device)}"
    return f"cpu ({torch.get_num_threads()} threads)"
