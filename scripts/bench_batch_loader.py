"""scripts/bench-batch-loader: what DataLoader workers cost per round, measured on this machine.

A round's slice is 10-100 batches. Three ways to fetch one, each run --repeat times round-robin,
medians printed (ms): in this process (fdl.engine.data.slice_batches, no workers), a DataLoader
started for the slice (slice_batches on a TrainData with workers), and the workers a
BatchLoader keeps between slices. "first" is the wait for the first batch (in the round's first
step), "all" the whole slice. --ballast-mib grows the process as a training process is grown
(fork copies the page tables: a fresh loader's workers start slower in a bigger process).
Samples are 3x32x32 floats, normalised per sample in __getitem__, batches of 32.

Usage: python scripts/bench_batch_loader.py [--workers 2] [--repeat 7] [--ballast-mib 0]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import Dataset

from fdl.engine.batch_loader import BatchLoader
from fdl.engine.data import TrainData, slice_batches

BATCH_SIZE = 32


class Images(Dataset):
    def __init__(self, size: int):
        self.x = torch.randn(size, 3, 32, 32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        x = self.x[index]
        return ((x - x.mean()) / (x.std() + 1e-5)).flip(-1), index


def timed(batches: Callable[[], Iterator]) -> tuple[float, float]:
    """(first batch, whole slice) in ms; the clock starts before the slice is asked for."""
    started = time.perf_counter()
    first = None
    for _ in batches():
        first = first if first is not None else time.perf_counter() - started
    return first * 1e3, (time.perf_counter() - started) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--ballast-mib", type=int, default=0)
    args = parser.parse_args()
    ballast = torch.ones(args.ballast_mib * 2**18)  # noqa: F841  (held: the process's size)
    dataset = Images(20_000)
    order = torch.randperm(len(dataset))
    plain = TrainData(dataset=dataset)
    workers = TrainData(dataset=dataset, num_workers=args.workers)
    kept = BatchLoader(workers)
    timed(lambda: kept.slice_batches(order, start=0, stop=BATCH_SIZE, batch_size=BATCH_SIZE))
    ways = {
        "this process": lambda n: slice_batches(plain, order, start=0, stop=n * BATCH_SIZE,
                                                batch_size=BATCH_SIZE),
        "fresh loader": lambda n: slice_batches(workers, order, start=0, stop=n * BATCH_SIZE,
                                                batch_size=BATCH_SIZE),
        "kept workers": lambda n: kept.slice_batches(order, start=0, stop=n * BATCH_SIZE,
                                                     batch_size=BATCH_SIZE),
    }
    print(f"{args.workers} workers, {torch.get_num_threads()} threads, "
          f"ballast {args.ballast_mib} MiB, batches of {BATCH_SIZE}")
    for num_batches in (10, 100):
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
        for _ in range(args.repeat):
            for name, way in ways.items():
                runs[name].append(timed(lambda way=way, n=num_batches: way(n)))
        for name, times in runs.items():
            first = statistics.median(t[0] for t in times)
            whole = statistics.median(t[1] for t in times)
            print(f"{num_batches:4d} batches  {name:<13} first {first:7.1f} ms   "
                  f"all {whole:7.1f} ms")
    kept.close()


if __name__ == "__main__":
    main()
