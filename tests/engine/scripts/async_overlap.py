"""Does async's average overlap the next round's compute? Two ranks, driven through the engine's
own averaging code (fdl.engine.averaging.Averager: ``pack``, ``all_reduce(async_op=True)``, the
next round, then ``wait`` and ``apply_delta``, as fdl.engine.rounds.average does at a boundary).

    python async_overlap.py OUT_DIR nccl   # one GPU per rank (two GPUs)
    python async_overlap.py OUT_DIR cpu    # both ranks on cuda:0, averaging through the host (gloo)

Spawns two processes (``file://`` rendezvous in OUT_DIR); each writes ``OUT_DIR/rank<r>.json``
and tests/engine/test_gpu.py judges them. Every figure is on the GPU's clock, from CUDA events:
the compute stream's events around round k+1, and the reduce's end marked on a side stream the
moment it is known (NCCL: the side stream waits for the reduce's work; gloo: a thread that waits
for the work records it on an idle stream, where it completes at once). Per rank:

1. calibrate: a round of matmul steps timed by StepTimer alone (``solo_first_ms``, the first
   step of a round with nothing else running; ``solo_step_ms``, the median), and a model whose
   blocking average (pack, reduce, load) lasts at least ``MIN_RATIO`` steps, grown until it does
   (``reduce_ms``; ``calibrated`` false if even the largest model averages faster);
2. round k, the boundary as async does it, round k+1 long enough to outlast the reduce several
   times over; then the reduce is collected and applied (``apply_delta``).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from fdl.engine.averaging import Averager
from fdl.engine.speed import StepTimer
from fdl.engine.state import REPORT_FIELDS

WORLD_SIZE = 2
STEP_SIZE = 2048  # one fp32 matmul of this side per step
MIN_RATIO = 10  # the reduce must last this many steps to tell a booked reduce from noise
WIDTHS = [2048, 4096, 8192, 16384]  # a model of 8 square layers: 34M to 2.1G values
MIN_ROUND_MS = 200.0
STATS = [1.0] * len(REPORT_FIELDS)


def event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


def run_round(matrix: torch.Tensor, steps: int) -> StepTimer:
    timer = StepTimer(device=matrix.device)
    for _ in range(steps):
        timer.start()
        torch.mm(matrix, matrix)
        timer.stop()
    timer.finish()
    return timer


def build(width: int, device: torch.device) -> nn.Module:
    return nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(8))).to(device)


def settle(device: torch.device) -> None:
    """Between measurements only: nothing queued, both ranks at the same point."""
    torch.cuda.synchronize(device)
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()
    torch.cuda.synchronize(device)


def blocking_average_ms(averager: Averager, device: torch.device) -> float:
    settle(device)
    began = time.perf_counter()
    averager.pack(weight=0.5, stats=STATS, keep_snapshot=True)
    averager.all_reduce(async_op=False)
    averager.load_average()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - began) * 1000


def calibrate(matrix: torch.Tensor, backend: str, rank: int) -> tuple[dict, Averager]:
    device = matrix.device
    run_round(matrix, 8)  # warm-up: cuBLAS handles, allocator
    settle(device)
    solo = run_round(matrix, 32)
    solo_step_ms = statistics.median(solo.step_times_s) * 1000
    averager = None
    for width in WIDTHS:
        averager = None  # the smaller size's buffers go first
        torch.cuda.empty_cache()
        averager = Averager(build(width, device), rank=rank, world_size=WORLD_SIZE,
                            backend=backend, device=device, num_stats=len(STATS))
        blocking_average_ms(averager, device)  # warm-up: communicator, buffers
        measured = torch.tensor([blocking_average_ms(averager, device)],
                                device=device if backend == "nccl" else "cpu")
        dist.broadcast(measured, src=0)  # rank 0 decides: both ranks pick one size
        if measured.item() >= MIN_RATIO * solo_step_ms:
            break
    assert averager is not None
    return {"solo_first_ms": solo.step_times_s[0] * 1000, "solo_step_ms": solo_step_ms,
            "reduce_ms": measured.item(), "numel": averager.numel,
            "calibrated": measured.item() >= MIN_RATIO * solo_step_ms}, averager


def overlapped(matrix: torch.Tensor, averager: Averager, backend: str, steps: int) -> dict:
    """Round k, the boundary as async does it (pack, the reduce in the background), round k+1
    timed as the round loop times it, then the average collected and applied. The reduce's end
    is marked on a side stream: behind NCCL's work (the side stream waits for it), or for gloo
    the moment a poll between steps finds the work done (an event on an idle stream completes
    when it is recorded), from this thread, as the round loop would see it."""
    device = matrix.device
    side = torch.cuda.Stream(device)
    settle(device)
    run_round(matrix, 4)  # round k
    boundary = event()
    boundary.record()
    averager.pack(weight=0.5, stats=STATS, keep_snapshot=True)
    work = averager.all_reduce(async_op=True)
    ended = event()
    if backend == "nccl":
        with torch.cuda.stream(side):
            work.wait()  # the side stream waits for NCCL's; the host goes on
            ended.record(side)
    marked = backend == "nccl"
    compute_start = event()
    compute_start.record()
    timer = StepTimer(device=device)  # round k+1
    for _ in range(steps):
        timer.start()
        torch.mm(matrix, matrix)
        timer.stop()
        if not marked and work.is_completed():
            ended.record(side)
            marked = True
    timer.finish()
    compute_end = event()
    compute_end.record()
    work.wait()  # the next boundary collects the average ...
    if not marked:
        ended.record(side)
    averager.apply_delta()  # ... and applies it
    compute_end.synchronize()
    ended.synchronize()
    return {"first_ms": timer.step_times_s[0] * 1000, "steps": steps,
            "next_steps_ms": [t * 1000 for t in timer.step_times_s[1:6]],
            "round_median_ms": statistics.median(timer.step_times_s) * 1000,
            "round_ms": timer.busy_s * 1000,
            "reduce_overlapped_ms": boundary.elapsed_time(ended),
            "reduce_end_to_compute_end_ms": ended.elapsed_time(compute_end),
            "compute_start_to_reduce_end_ms": compute_start.elapsed_time(ended)}


def worker(rank: int, out: str, backend: str) -> None:
    device = torch.device("cuda", rank if backend == "nccl" else 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl" if backend == "nccl" else "gloo",
                            init_method=f"file://{Path(out) / 'rendezvous'}", rank=rank,
                            world_size=WORLD_SIZE)
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        matrix = torch.randn(STEP_SIZE, STEP_SIZE, device=device)
        result, averager = calibrate(matrix, backend, rank)
        target_ms = max(5 * result["reduce_ms"], MIN_ROUND_MS)
        steps = min(50_000, max(8, math.ceil(target_ms / result["solo_step_ms"])))
        result |= overlapped(matrix, averager, backend, steps)
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(sys.argv[1], sys.argv[2]), nprocs=WORLD_SIZE, join=True)
