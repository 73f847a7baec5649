"""GPU / NCCL layer (opt-in): skipped without CUDA; ``scripts/test-gpu`` runs them all on a GPU
machine, with real fdl runs beside them (docs/run.md "The GPU check" says when they last ran,
where, and what they showed).

What they hold: the events of a round add up to its wall time and the step timer never
synchronizes the device (work on another stream is never booked as a step); each policy trains
over NCCL; a CUDA run's checkpoint (CUDA RNG state, CUDA optimizer state) loads as data and
``--resume`` continues it; async's average, launched through the engine's Averager at a
boundary, finishes during the next round's compute without delaying its first step (over the
host on one GPU, over NCCL with two: scripts/async_overlap.py measures with CUDA events); a
CUDA worker and a CPU worker agree on the ``cpu`` backend; a pass of loader workers' batches,
taken off the step's thread, lands pinned and in order on the device; an average encoded on
the wire (bf16, int8, int4) lands over NCCL as over the host; with two GPUs, replicas
identical after every average. Tests that need two GPUs skip saying so.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import clean_env, run_fdl, started

from fdl.engine.speed import RunningMean, StepTimer
from fdl.rundir.timeline import read_events

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
SCRIPTS = Path(__file__).parent / "scripts"


def train(tmp_path: Path, nproc: int, *flags: str) -> Path:
    """``fdl run`` of the engine's test script with ``nproc`` workers (0: one per core, on the
    CPU)."""
    out, run_dir = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    proc = run_fdl("run", "--nproc-per-node", str(nproc or "cpu"), "--run-dir", str(run_dir),
                   *flags,
                   str(SCRIPTS / "elche_train.py"), str(out), "--batch-norm", cwd=tmp_path,
                   env={"FDL_VERIFY_REPLICAS": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.mark.parametrize("policy", ["sync", "cadence", "async"])
def test_one_gpu_trains_with_nccl(tmp_path, policy):
    run_dir = train(tmp_path, 1, "--policy", policy, "--backend", "nccl")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["devices"][0].startswith("cuda:0")
    assert summary["eval"]["accuracy"] > 0.6


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize(("policy", "backend"), [("cadence", "nccl"), ("async", "nccl"),
                                                 ("cadence", "cpu"), ("sync", "nccl")])
def test_two_gpus_replicas_identical(tmp_path, policy, backend):
    run_dir = train(tmp_path, 2, "--policy", policy, "--backend", backend,
                    "--simulate-slowdown", "1,2.5")
    events = [read_events(run_dir, r) for r in (0, 1)]
    finals = [next(e["checksum"] for e in ev if e["kind"] == "final") for ev in events]
    assert finals[0] == finals[1]
    checks = [[e["checksum"] for e in ev if e["kind"] == "sync" and "checksum" in e]
              for ev in events]
    assert checks[0] == checks[1]


def test_cpu_workers_on_a_gpu_host_train_on_the_cpu(tmp_path):
    """--nproc-per-node cpu on a GPU box: every worker trains on the CPU, as the plan says (the
    GPU is hidden from them), not all of them on the one GPU."""
    run_dir = train(tmp_path, 0, "--policy", "cadence", "--batch-size", "8")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["backend"] == "cpu"
    assert summary["devices"] and all(d.startswith("cpu") for d in summary["devices"])


def test_a_cuda_run_resumes_from_its_checkpoint_loaded_as_data(tmp_path):
    """Checkpoints of a CUDA run (CUDA RNG state, optimizer state of CUDA tensors) load with
    weights_only=True, and `fdl run --resume` continues the run on the GPU."""
    out, run_dir = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    script = str(SCRIPTS / "recovery_train.py")
    first = run_fdl("run", "--nproc-per-node", "1", "--backend", "nccl", "--epochs", "2",
                    "--checkpoint-every", "1", "--run-dir", str(run_dir), script, str(out),
                    "2048", cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    rank_state = torch.load(next((run_dir / "checkpoints").glob("ckpt-r*")) / "rank0.pt",
                            weights_only=True)
    assert rank_state["rng"]["cuda"].dtype == torch.uint8
    again = run_fdl("run", "--resume", str(run_dir), "--epochs", "3", cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    result = json.loads((out / "rank0.json").read_text())
    assert [row["epoch"] for row in result["history"]] == [1, 2, 3]
    assert result["summary"]["resumed_from"].startswith("ckpt-r")


def timed_round(device: torch.device, step: Callable[[], object], steps: int, *,
                slowdown: float = 1.0, slept: list[float] | None = None) -> StepTimer:
    """A round as the round loop times it: ``start``/``stop`` around each step, ``finish``;
    each emulated sleep asked for is recorded in ``slept`` (and slept)."""
    asked = slept if slept is not None else []

    def sleep(seconds: float) -> None:
        asked.append(seconds)
        time.sleep(seconds)

    timer = StepTimer(slowdown=slowdown, mean=RunningMean(), device=device, sleep=sleep)
    for _ in range(steps):
        timer.start()
        step()
        timer.stop()
    timer.finish()
    return timer


def gpu_bound_step(device: torch.device) -> Callable[[], object]:
    matrix = torch.randn(4096, 4096, device=device)
    return lambda: [torch.mm(matrix, matrix) for _ in range(4)]


def host_bound_step(device: torch.device) -> Callable[[], object]:
    """Collating a batch on the host and copying it over dominates; the kernels are short."""
    host = torch.randn(512, 512)
    return lambda: (host @ host @ host).to(device).sum()


@pytest.mark.parametrize("make_step", [gpu_bound_step, host_bound_step],
                         ids=["gpu-bound", "host-bound"])
def test_event_timing_matches_the_wall_time_of_a_round(make_step):
    """The sum of the steps' event intervals is the round's wall time (measured around it with
    a synchronize on both sides), whether the kernels or the host work set the pace."""
    device = torch.device("cuda", 0)
    step = make_step(device)
    timed_round(device, step, 3)  # warm-up
    torch.cuda.synchronize(device)
    began = time.perf_counter()
    timer = timed_round(device, step, 20)
    torch.cuda.synchronize(device)
    wall_s = time.perf_counter() - began
    assert timer.steps == 20 and len(timer.step_times_s) == 20
    assert timer.busy_s <= wall_s
    assert timer.busy_s == pytest.approx(wall_s, rel=0.15)


def sleep_cycles(device: torch.device, seconds: float) -> int:
    """How many ``torch.cuda._sleep`` cycles last ``seconds`` on this GPU (a spin kernel of one
    block: it holds a stream without competing for the SMs, like a collective in flight)."""
    began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    began.record()
    torch.cuda._sleep(10_000_000)
    ended.record()
    ended.synchronize()
    return int(10_000_000 * seconds * 1000 / began.elapsed_time(ended))


@pytest.mark.parametrize("slowdown", [1.0, 2.5])
def test_the_timer_never_synchronizes_the_device(monkeypatch, slowdown):
    """While another stream runs 0.5 s of work (what async's reduce does at a boundary), a round
    of short steps is timed and read without waiting for it: ``torch.cuda.synchronize`` would
    raise, the side work is still running when the figures are read, and no step carries it."""
    device = torch.device("cuda", 0)
    matrix = torch.randn(2048, 2048, device=device)
    step = lambda: torch.mm(matrix, matrix)  # noqa: E731
    timed_round(device, step, 3)  # warm-up
    solo = timed_round(device, step, 5)
    cycles = sleep_cycles(device, 0.5)
    torch.cuda.synchronize(device)

    def forbidden(*args, **kwargs):
        raise AssertionError("StepTimer called torch.cuda.synchronize")

    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    side = torch.cuda.Stream(device)
    side_done = torch.cuda.Event()
    with torch.cuda.stream(side):
        torch.cuda._sleep(cycles)
        side_done.record(side)
    slept: list[float] = []
    timer = timed_round(device, step, 5, slowdown=slowdown, slept=slept)
    assert not side_done.query(), "the round waited for the other stream"
    assert all(s <= 3 * max(solo.step_times_s) + 1e-3 for s in timer.step_times_s), \
        (timer.step_times_s, solo.step_times_s)
    assert (0 < len(slept) <= 5) if slowdown > 1 else not slept  # an oversleep skips one
    # the sleep booked is the sleep measured: what was asked, and what the OS overslept
    assert sum(slept) <= timer.sleep_s <= sum(slept) + 5 * 0.002
    side_done.synchronize()


def overlap(tmp_path: Path, backend: str) -> list[dict]:
    proc = subprocess.run([sys.executable, str(SCRIPTS / "async_overlap.py"), str(tmp_path),
                           backend], capture_output=True, text=True, env=clean_env(),
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]


def check_overlap(result: dict, *, shared_gpu: bool) -> None:
    """Round k's reduce, launched at the boundary through the engine's Averager, ends after
    round k+1 began and before its compute ends, and round k+1's first step does not carry it.

    On a GPU of its own the first step takes what a first step takes alone. Two ranks sharing
    one GPU (the cpu backend's test) time-slice it between two processes, so a step of one can
    wait for the other's work: on an H100 the first step took 2.1 ms against 0.35 ms alone,
    beside a 93 ms reduce. There the bound is a quarter of the reduce (at least 2.5 steps, by
    the calibration's MIN_RATIO): a first step that waited for the reduce takes all of it."""
    shown = json.dumps(result)  # whole, where pytest would cut a dict short
    assert result["calibrated"], f"no model averaged slowly enough to tell: {shown}"
    assert result["compute_start_to_reduce_end_ms"] > 0, shown
    assert result["reduce_end_to_compute_end_ms"] > 0, shown
    if shared_gpu:
        assert result["first_ms"] <= result["reduce_ms"] / 4, shown
    else:
        assert result["first_ms"] <= 3 * result["solo_first_ms"] + 0.5, shown


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_async_nccl_reduce_overlaps_the_next_rounds_compute(tmp_path):
    for result in overlap(tmp_path, "nccl"):
        check_overlap(result, shared_gpu=False)


def test_async_host_average_overlaps_the_next_rounds_compute_on_the_gpu(tmp_path):
    """The cpu backend (a GPU box averaging through the host, as beside a CPU worker): two
    ranks on one GPU, the gloo reduce in the background while the GPU computes."""
    for result in overlap(tmp_path, "cpu"):
        check_overlap(result, shared_gpu=True)


def test_a_cuda_worker_and_a_cpu_worker_agree_on_the_cpu_backend(tmp_path):
    """backend auto in a group of a CUDA worker and a CPU worker (CUDA hidden from it): both
    average through the host, and one average leaves them bitwise identical."""
    port = free_port()
    with ExitStack() as running:  # a rank that hangs (or a failed assert) is killed on the way out
        procs = [running.enter_context(started(
            [sys.executable, str(SCRIPTS / "mixed_group.py"), str(tmp_path)],
            env=clean_env({"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                           **({"CUDA_VISIBLE_DEVICES": ""} if rank else {})}),
            stderr=subprocess.PIPE, text=True)) for rank in range(2)]
        for proc in procs:
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-3000:]
    seen = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [s["device"].split(":")[0] for s in seen] == ["cuda", "cpu"]
    assert {s["backend"] for s in seen} == {"cpu"}
    assert seen[0]["checksum"] == seen[1]["checksum"]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_copies_ahead_on_a_side_stream_keep_the_batches_and_never_synchronize():
    """fdl.engine.h2d on the real streams: pinned host batches copied one ahead on the side
    stream arrive intact and in order for a step on the compute stream, with no host
    synchronization anywhere on the way (torch's sync debug mode raises on one)."""
    from fdl.engine.h2d import DeviceCopies

    device = torch.device("cuda", 0)
    host = [torch.randn(256, 1024).pin_memory() for _ in range(6)]
    weights = torch.randn(1024, 1024, device=device)
    source = iter(host)
    fetch = DeviceCopies(device).ahead(lambda: next(source), len(host))
    outputs = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in host:
            batch = fetch()
            outputs.append(batch @ weights)  # the step, on the compute stream
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for batch, out in zip(host, outputs, strict=True):
        assert torch.allclose(out.cpu(), batch @ weights.cpu(), atol=1e-3, rtol=1e-4)


class Rows(torch.utils.data.Dataset):
    """Sample i: a row of 1024 values that say i (made in a loader worker)."""

    def __len__(self) -> int:
        return 96

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((1024,), float(index))


def test_a_pass_taken_off_the_step_s_thread_lands_pinned_and_in_order_on_the_device():
    """fdl.engine.batch_loader with real loader workers and pinned memory: the batches a thread
    of fdl's own takes from the DataLoader come pinned, in the slice's order, and copied ahead on
    the side stream reach the step intact, with no host synchronization on the step's side."""
    import threading

    from torch.utils.data import DataLoader

    from fdl.engine.batch_loader import BatchLoader
    from fdl.engine.data import TrainData
    from fdl.engine.h2d import DeviceCopies

    device = torch.device("cuda", 0)
    lists = [list(range(start, start + 8)) for start in range(0, 96, 8)][::-1]
    # small integer weights: every product and sum is exact in fp32 (rows up to 95, sums under
    # 2**24), so the device's result equals the host's whatever order each adds in; with randn
    # weights, rows of 90 sum to thousands and the orders' rounding passes any fixed tolerance
    weights = torch.randint(-3, 4, (1024, 1024), device=device).float()
    seen: list[torch.Tensor] = []
    with BatchLoader(TrainData.of(DataLoader(Rows(), batch_size=8, num_workers=2,
                                             pin_memory=True))) as loader:
        batches = loader.batches(lists)

        def take() -> torch.Tensor:
            batch = next(batches)
            seen.append(batch)
            return batch

        fetch = DeviceCopies(device).ahead(take, len(lists))
        outputs, taking = [], False
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in lists:
                outputs.append(fetch() @ weights)  # the step, on the compute stream
                # the pass's thread takes two ahead at most: alive while steps remain
                taking = taking or "fdl-batches" in {t.name for t in threading.enumerate()}
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert taking  # the batches were taken off the step's thread
    assert all(batch.is_pinned() for batch in seen)
    assert [batch[:, 0].tolist() for batch in seen] == [[float(i) for i in part] for part in lists]
    for batch, out in zip(seen, outputs, strict=True):
        assert torch.equal(out.cpu(), batch @ weights.cpu())


def test_a_cuda_replica_averaged_over_the_host_keeps_its_buffers_pinned_and_off_the_card():
    """--backend cpu on a tight card: the flat buffer and async's snapshot in page-locked host
    memory, nothing of fdl's on the device (fdl_memory_bytes' split)."""
    from torch import nn

    from fdl.engine.averaging import Averager

    model = nn.Linear(64, 64).cuda()
    averager = Averager(model, rank=0, world_size=1, backend="cpu",
                        device=torch.device("cuda", 0), num_stats=4, snapshot=True)
    assert averager.flat.is_pinned() and averager.snapshot is not None
    assert averager.snapshot.is_pinned()
    on_device, on_host = averager.memory_bytes()
    assert on_device == 0 and on_host > 0


def land_two_averages(tmp_path: Path, backend: str, device: torch.device,
                      wire: str) -> list[list[torch.Tensor]]:
    """A group of one over ``backend``: a replica moved twice, each move averaged with the
    parameters encoded on the wire (``wire``), gathered asynchronously and landed; the
    parameters after each landing, on the host."""
    from torch import nn

    from fdl.engine.averaging import Averager

    dist.init_process_group(backend, init_method=f"file://{tmp_path}/rdzv-{backend}", rank=0,
                            world_size=1)
    try:
        torch.manual_seed(3)
        model = nn.Sequential(nn.Linear(300, 129), nn.ReLU(), nn.Linear(129, 7)).to(device)
        averager = Averager(model, rank=0, world_size=1,
                            backend="nccl" if backend == "nccl" else "cpu", device=device,
                            num_stats=2, snapshot=False, wire=wire)
        assert averager.wire is not None and averager.wire.sent.device.type == device.type
        landed = []
        for move in range(2):
            noise = torch.Generator().manual_seed(move)
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(0.01 * torch.randn(param.shape, generator=noise).to(device))
            averager.pack(weight=1.0, stats=[1.0, float(move)], keep_snapshot=False)
            pending = averager.all_reduce(async_op=True)
            assert pending is not None and pending.wait()
            averager.load_average()
            assert averager.stats() == [[1.0, float(move)]]
            landed.append([p.detach().cpu().clone() for p in model.parameters()])
        return landed
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("wire", ["bf16", "int8", "int4"])
def test_an_average_encoded_on_the_wire_lands_over_nccl_as_over_the_host(tmp_path, wire):
    """--average-dtype bf16|int8|int4 under nccl: the displacements encoded on the card,
    gathered over NCCL and decoded there land the same parameters, a second average carrying
    the error the first dropped, as the same replica averaged over gloo on the host."""
    on_card = land_two_averages(tmp_path, "nccl", torch.device("cuda", 0), wire)
    on_host = land_two_averages(tmp_path, "gloo", torch.device("cpu"), wire)
    for card_params, host_params in zip(on_card, on_host, strict=True):
        for card, host in zip(card_params, host_params, strict=True):
            torch.testing.assert_close(card, host, rtol=0, atol=1e-6)
