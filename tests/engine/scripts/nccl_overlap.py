"""Does async's average overlap the next round's compute under NCCL? Two ranks, one GPU each.

    python nccl_overlap.py OUT_DIR

Spawns two processes (``torch.multiprocessing.spawn``, ``file://`` rendezvous in OUT_DIR) and
each writes ``OUT_DIR/rank<r>.json``; tests/engine/test_gpu.py reads and judges them. Every
figure comes from CUDA events. Per rank:

1. calibrate: a round of ``STEP_SIZE`` matmul steps timed by StepTimer alone (``solo_first_ms``,
   the first step of a round with nothing else on the device; ``solo_step_ms``, the median), and
   the all-reduce of a buffer grown until it takes at least ``MIN_RATIO`` steps
   (``reduce_ms``; ``calibrated`` false if even the largest buffer is faster);
2. round k (a few steps), then the boundary as async does it: the reduce launched on a side
   stream (which waits for round k's compute, as the averager's pack would), events recorded
   around it on that stream, and round k+1 at once: enough steps to outlast the reduce several
   times over, timed by StepTimer, with events at its start and end on the compute stream;
3. the control: the same boundary and round timed the old way (a device-wide
   ``torch.cuda.synchronize`` after each step and the host clock), whose first step should
   carry the reduce — it shows the setup can tell the two apart.

Written without a machine with two GPUs to run it on (see test_gpu.py).
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

from fdl.engine.speed import StepTimer

WORLD_SIZE = 2
STEP_SIZE = 2048  # one fp32 matmul of this side per step
MIN_RATIO = 10  # the reduce must last this many steps to tell a booked reduce from noise
NUMELS = [2**26, 2**27, 2**28]  # 256 MiB to 1 GiB of float32
MIN_ROUND_MS = 200.0


def event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


def run_round(matrix: torch.Tensor, steps: int) -> StepTimer:
    """``steps`` steps timed as the round loop times them; returns the finished timer."""
    timer = StepTimer(device=matrix.device)
    for _ in range(steps):
        timer.start()
        torch.mm(matrix, matrix)
        timer.stop()
    timer.finish()
    return timer


def launch_reduce(buffer: torch.Tensor,
                  side: torch.cuda.Stream) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    """Async's boundary: the all-reduce queued behind the compute so far, on a side stream,
    with events around it there. Returns (start event, end event); the host does not wait."""
    side.wait_stream(torch.cuda.current_stream(buffer.device))
    began, ended = event(), event()
    with torch.cuda.stream(side):
        began.record(side)
        work = dist.all_reduce(buffer, async_op=True)
        work.wait()  # makes the side stream wait for NCCL's; the host goes on
        ended.record(side)
    return began, ended


def settle(device: torch.device) -> None:
    """Between measurements only: nothing queued, both ranks at the same point."""
    torch.cuda.synchronize(device)
    dist.barrier(device_ids=[device.index])
    torch.cuda.synchronize(device)


def reduce_ms(buffer: torch.Tensor, side: torch.cuda.Stream) -> float:
    settle(buffer.device)
    began, ended = launch_reduce(buffer, side)
    ended.synchronize()
    return began.elapsed_time(ended)


def calibrate(matrix: torch.Tensor, side: torch.cuda.Stream) -> tuple[dict, torch.Tensor]:
    """The solo step, and a buffer whose reduce lasts ``MIN_RATIO`` steps."""
    run_round(matrix, 8)  # warm-up: cuBLAS handles, allocator
    settle(matrix.device)
    solo = run_round(matrix, 32)
    solo_step_ms = statistics.median(solo.step_times_s) * 1000
    buffer, measured_ms = long_reduce(matrix.device, side, min_ms=MIN_RATIO * solo_step_ms)
    return {"solo_first_ms": solo.step_times_s[0] * 1000, "solo_step_ms": solo_step_ms,
            "reduce_ms": measured_ms, "numel": buffer.numel(),
            "calibrated": measured_ms >= MIN_RATIO * solo_step_ms}, buffer


def long_reduce(device: torch.device, side: torch.cuda.Stream, *,
                min_ms: float) -> tuple[torch.Tensor, float]:
    """The smallest buffer of ``NUMELS`` whose reduce lasts ``min_ms`` (the largest if none
    does) and its reduce time. Rank 0's measurement decides, so both ranks pick one size."""
    for numel in NUMELS:
        buffer = torch.ones(numel, device=device)
        reduce_ms(buffer, side)  # warm-up: NCCL communicator, channels
        measured = torch.tensor([reduce_ms(buffer, side)], device=device)
        dist.broadcast(measured, src=0)
        if measured.item() >= min_ms or numel == NUMELS[-1]:
            return buffer, measured.item()
        del buffer  # before allocating the next size
    raise AssertionError("unreachable: the last size always returns")


def overlapped(matrix: torch.Tensor, buffer: torch.Tensor, side: torch.cuda.Stream,
               steps: int) -> dict:
    """Round k, async's boundary, round k+1; the figures of the test."""
    settle(matrix.device)
    run_round(matrix, 4)  # round k (its finish() is the round loop's)
    began, ended = launch_reduce(buffer, side)
    compute_start = event()
    compute_start.record()
    timer = run_round(matrix, steps)  # round k+1
    compute_end = event()
    compute_end.record()
    compute_end.synchronize()
    ended.synchronize()
    return {"first_ms": timer.step_times_s[0] * 1000, "steps": steps,
            "round_ms": timer.busy_s * 1000,
            "reduce_overlapped_ms": began.elapsed_time(ended),
            "reduce_end_to_compute_end_ms": ended.elapsed_time(compute_end),
            "compute_start_to_reduce_end_ms": compute_start.elapsed_time(ended)}


def control(matrix: torch.Tensor, buffer: torch.Tensor, side: torch.cuda.Stream) -> float:
    """The first step after the boundary, timed as before issue 13: host clock and a
    device-wide synchronize, which also waits for the reduce."""
    device = matrix.device
    settle(device)
    run_round(matrix, 4)
    launch_reduce(buffer, side)
    began = time.perf_counter()
    torch.mm(matrix, matrix)
    torch.cuda.synchronize(device)
    first_ms = (time.perf_counter() - began) * 1000
    settle(device)
    return first_ms


def worker(rank: int, out: str) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{Path(out) / 'rendezvous'}",
                            rank=rank, world_size=WORLD_SIZE)
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        matrix = torch.randn(STEP_SIZE, STEP_SIZE, device=device)
        side = torch.cuda.Stream(device)
        result, buffer = calibrate(matrix, side)
        target_ms = max(5 * result["reduce_ms"], MIN_ROUND_MS)
        steps = min(20_000, max(8, math.ceil(target_ms / result["solo_step_ms"])))
        result |= overlapped(matrix, buffer, side, steps)
        result["control_first_ms"] = control(matrix, buffer, side)
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(sys.argv[1],), nprocs=WORLD_SIZE, join=True)
