"""The body of scripts/bench-fetch (see that file for what it measures)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from gpu_pair_train import Augmented, PlainStep
from torch.utils.data import DataLoader

from fdl.engine import batch_loader
from fdl.engine.batch_loader import BatchLoader
from fdl.engine.data import TrainData, map_tensors
from fdl.engine.h2d import DeviceCopies

ROOT = Path(__file__).resolve().parent.parent
BATCH = 128
WORKERS = 2
SKIPPED = 10  # the first steps (cold kernels, the workers' first batches) are not timed
PATHS = ("plain", "fdl", "fdl, no thread", "fdl, the thread pins")
CUDA_ONLY = ("fdl, the thread pins",)  # pinning needs CUDA
TAKEN_AHEAD = batch_loader.TakenAhead  # the engine's, kept: each run patches the name


class TakenHere:
    """A pass taken on the step's own thread: :class:`batch_loader.TakenAhead`'s interface,
    the engine before the taking thread (the ``fdl, no thread`` path)."""

    def __init__(self, source: Iterator[Any]) -> None:
        self._source = source

    def __iter__(self) -> TakenHere:
        return self

    def __next__(self) -> Any:
        return next(self._source)

    def stop(self) -> None:
        pass


def pinned_by_the_thread(source: Iterator[Any]) -> Any:
    """A pass whose taking thread also pins each batch (the DataLoader's own pin thread off):
    one thread between the workers and the step instead of two (``fdl, the thread pins``)."""
    return TAKEN_AHEAD(map_tensors(batch, lambda tensor: tensor.pin_memory())
                       for batch in source)


def one_run(path: str, data: Augmented, step: PlainStep, *, batches: int,
            sleep_s: float) -> dict[str, float]:
    """``batches`` steps on ``path``'s batches: the time per step, and the time the step's
    thread spent getting each batch onto the device (from asking for it to its copy issued)."""
    device, pinned = step.device, step.device.type == "cuda"
    lists = [list(range(i * BATCH, (i + 1) * BATCH)) for i in range(batches)]
    loader: BatchLoader | None = None
    if path == "plain":
        source = iter(DataLoader(data, batch_sampler=lists, num_workers=WORKERS,
                                 pin_memory=pinned))
        fetch: Callable[[], Any] = lambda: tuple(t.to(device, non_blocking=True)  # noqa: E731
                                                 for t in next(source))
    else:
        taker = {"fdl": TAKEN_AHEAD, "fdl, no thread": TakenHere,
                 "fdl, the thread pins": pinned_by_the_thread}[path]
        with mock.patch.object(batch_loader, "TakenAhead", taker):
            loader = BatchLoader(TrainData.of(DataLoader(
                data, batch_size=BATCH, num_workers=WORKERS,
                pin_memory=pinned and path not in CUDA_ONLY)))
            taken = loader.batches(lists)
        copies = DeviceCopies.for_device(device)
        fetch = copies.ahead(lambda: next(taken), batches) if copies else lambda: next(taken)
    waits, began = [], 0.0
    try:
        for index in range(batches):
            asked = time.perf_counter()
            batch = fetch()
            waited = time.perf_counter() - asked
            if index == SKIPPED:
                step.synchronize()
                began = time.perf_counter()
            elif index > SKIPPED:
                waits.append(waited)
            step(*batch, sleep_s)
        step.synchronize()
    finally:
        if loader is not None:
            loader.close()
    elapsed = time.perf_counter() - began
    return {"step_ms": 1000 * elapsed / (batches - SKIPPED),
            "wait_fraction": sum(waits) / elapsed,
            "median_wait_ms": 1000 * statistics.median(waits)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--sleep-ms", default="3,0",
                        help="the emulated extra step time of each regime, comma-separated")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--out", type=Path,
                        default=ROOT / "runs" / time.strftime("bench-fetch-%Y%m%dT%H%M%SZ",
                                                              time.gmtime()))
    args = parser.parse_args()
    try:
        sleeps = [float(part) for part in args.sleep_ms.split(",")]
    except ValueError:
        parser.error(f"--sleep-ms {args.sleep_ms!r}: comma-separated milliseconds, e.g. 3,0")
    if args.batches <= SKIPPED + 1 or args.repeat < 1 or any(s < 0 for s in sleeps):
        parser.error(f"--batches must be > {SKIPPED + 1}, --repeat >= 1, --sleep-ms >= 0")
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = Augmented(args.batches * BATCH, seed=1)
    step = PlainStep(device)
    paths = [p for p in PATHS if device.type == "cuda" or p not in CUDA_ONLY]
    rows = []
    for sleep_ms in sleeps:
        runs: dict[str, list[dict[str, float]]] = {path: [] for path in paths}
        for repeat in range(args.repeat):  # round-robin, the order turned every other time
            for path in paths if repeat % 2 == 0 else paths[::-1]:
                runs[path].append(one_run(path, data, step, batches=args.batches,
                                          sleep_s=sleep_ms / 1000))
        plain_ms = statistics.median(r["step_ms"] for r in runs["plain"])
        for path in paths:
            cell = {key: statistics.median(r[key] for r in runs[path]) for key in runs[path][0]}
            rows.append({"sleep_ms": sleep_ms, "path": path, **cell,
                         "of_plain": plain_ms / cell["step_ms"], "runs": runs[path]})
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    lines = [f"bench-fetch on {device_name}, torch {torch.__version__}: {args.batches} batches "
             f"of {BATCH}, {WORKERS} loader workers, medians of {args.repeat}", "",
             "| extra step | path | ms a step | rate of plain | data wait | median wait |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['sleep_ms']:g} ms | {r['path']} | {r['step_ms']:.2f} | {r['of_plain']:.2f} | "
              f"{r['wait_fraction']:.1%} | {r['median_wait_ms']:.2f} ms |" for r in rows]
    table = "\n".join(lines)
    (args.out / "bench-fetch.md").write_text(table + "\n")
    (args.out / "bench-fetch.json").write_text(json.dumps(
        {"device": device_name, "torch": torch.__version__, "batches": args.batches,
         "repeat": args.repeat, "rows": rows}, indent=1) + "\n")
    print(table)
    print(f"\nbench-fetch: wrote {args.out / 'bench-fetch.md'} and bench-fetch.json")


if __name__ == "__main__":
    main()
