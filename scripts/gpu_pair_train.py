"""The training script of scripts/test-gpu's CUDA + CPU pair: a small CNN on CIFAR-shaped synthetic
images (3x32x32, 10 classes, the label a fixed random projection of the image, so there is
something to learn), trained by fdl.Trainer with the settings fdl run gives it.

    fdl run --nproc-per-node 1 scripts/gpu_pair_train.py --samples 20000
    fdl run --nproc-per-node 1 scripts/gpu_pair_train.py --augment --workers 2   # the loader
    fdl run --nproc-per-node 1 --micro-batch auto scripts/gpu_pair_train.py --batch-size 4096 \
        --memory-gib 0.5                                                # micro-batch auto-fit
    python scripts/gpu_pair_train.py --augment --workers 2 --loader-rate    # the loader alone
    python scripts/gpu_pair_train.py --augment --workers 2 --plain-loop     # PyTorch's own loop

The data is made from a fixed seed on every node alike (the same length and order everywhere, as
El Che needs). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import fdl
from fdl.engine.precision import autocast, resolve_precision

CLASSES = 10
EPOCHS = 3


def make_data(num_samples: int, *, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(num_samples, 3, 32, 32, generator=generator)
    projection = torch.randn(3 * 8 * 8, CLASSES, generator=torch.Generator().manual_seed(0))
    pooled = F.avg_pool2d(images, 4).flatten(1)
    return TensorDataset(images, (pooled @ projection).argmax(dim=1))


class Augmented(torch.utils.data.Dataset):
    """CIFAR's training transform on stored 8-bit images, per sample in ``__getitem__`` (what a
    DataLoader's workers do for a real CIFAR run): a random 32x32 crop of the image padded by 4,
    a random horizontal flip, then to float and normalised. Labels as :func:`make_data`'s."""

    def __init__(self, num_samples: int, *, seed: int) -> None:
        base = make_data(num_samples, seed=seed)
        images, self.labels = base.tensors
        self.images = ((images.clamp(-2, 2) + 2) * 63.75).to(torch.uint8)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        padded = F.pad(self.images[index], (4, 4, 4, 4))
        top, left = torch.randint(0, 9, (2,)).tolist()
        image = padded[:, top:top + 32, left:left + 32]
        if torch.rand(()) < 0.5:
            image = image.flip(2)
        return (image.float() / 63.75 - 2), self.labels[index]


def build_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
        nn.Flatten(), nn.Linear(64 * 16, 128), nn.ReLU(), nn.Linear(128, CLASSES))


def train_step(model: nn.Module, batch) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(model(images), labels)


def evaluate(model: nn.Module, batch) -> dict[str, float]:
    images, labels = batch
    return {"accuracy": (model(images).argmax(dim=1) == labels).float().mean().item()}


def plain_loader(data: torch.utils.data.Dataset, *, batch_size: int,
                 workers: int) -> torch.utils.data.DataLoader:
    """A DataLoader as a user writes one: shuffled, pinned when CUDA is there, its workers kept
    across epochs."""
    return torch.utils.data.DataLoader(
        data, batch_size=batch_size, shuffle=True, num_workers=workers,
        pin_memory=torch.cuda.is_available(), persistent_workers=workers > 0)


def loader_rate(data: torch.utils.data.Dataset, *, batch_size: int, workers: int,
                epochs: int) -> float:
    """Samples per second that a plain DataLoader alone delivers of ``data`` (shuffled, pinned
    when CUDA is there, workers kept across epochs), timed from its first batch: what the
    loader can feed a step at most, whatever fdl does around it."""
    loader = plain_loader(data, batch_size=batch_size, workers=workers)
    began, samples = None, 0
    for _ in range(epochs):
        for images, _labels in loader:
            if began is None:
                began = time.perf_counter()
            else:
                samples += len(images)
    return samples / (time.perf_counter() - began)


class PlainStep:
    """One optimizer step of the pair's CNN as a user writes it (SGD with momentum, seeded), in
    the precision fdl's ``auto`` picks for the device (bf16 on CUDA of compute capability 8.0 or
    later), then ``sleep_s`` slept (an emulated slower step, as ``--simulate-slowdown``
    sleeps). Shared by :func:`plain_loop` and scripts/bench-fetch."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.precision = resolve_precision("auto", device)
        torch.manual_seed(0)
        self.model = build_model().to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, sleep_s: float = 0.0) -> None:
        with autocast(self.device, self.precision):
            loss = F.cross_entropy(self.model(images), labels)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if sleep_s:
            time.sleep(sleep_s)

    def synchronize(self) -> None:
        """Wait for the device's queued work (once, where a clock is read)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def plain_loop(data: torch.utils.data.Dataset, *, batch_size: int, workers: int, epochs: int,
               step_sleep_s: float) -> dict[str, float]:
    """The training a user writes without fdl, of the same model on the same DataLoader
    (:func:`plain_loader`), the batches copied to the device without blocking, each step a
    :class:`PlainStep` with ``step_sleep_s`` slept after it. Its
    rate timed from its first batch to the device's last step, and the share of that time
    spent getting the next batch onto the device (the loader's ``next`` and the copy's issue,
    what fdl books as data wait); and its rate after the first step (``steady``:
    the device is synchronized once there, so the cold start, CUDA's lazy kernel loads and
    cuDNN's first choices, is left out as fdl's calibration round is left out of its own)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    step = PlainStep(device)
    loader = plain_loader(data, batch_size=batch_size, workers=workers)
    began, samples, waited, first_done = None, 0, 0.0, None
    for _ in range(epochs):
        batches = iter(loader)
        while True:
            asked = time.perf_counter()
            batch = next(batches, None)
            if batch is None:
                break
            images, labels = (t.to(device, non_blocking=True) for t in batch)
            if began is None:
                began = time.perf_counter()
            else:  # as fdl books it: from asking for the batch to its copy issued
                waited += time.perf_counter() - asked
                samples += len(batch[0])
            step(images, labels, step_sleep_s)
            if first_done is None:
                step.synchronize()
                first_done = time.perf_counter()
    step.synchronize()
    ended = time.perf_counter()
    elapsed = ended - began
    return {"plain_samples_per_s": samples / elapsed, "plain_wait_fraction": waited / elapsed,
            "plain_steady_samples_per_s": samples / (ended - first_done),
            "plain_first_step_s": first_done - began}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--augment", action="store_true",
                        help="random crops and flips per sample (uint8 images), as CIFAR's")
    parser.add_argument("--workers", type=int, default=None, help="DataLoader workers")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--memory-gib", type=float, default=None,
                        help="cap this process's CUDA memory (the micro-batch auto-fit check)")
    parser.add_argument("--loader-rate", action="store_true",
                        help="no training: print the rate a plain DataLoader alone delivers")
    parser.add_argument("--plain-loop", action="store_true",
                        help="no fdl: train in a plain PyTorch loop, print its rate and wait")
    parser.add_argument("--step-sleep-ms", type=float, default=0.0,
                        help="with --plain-loop: sleep this long after each step")
    args = parser.parse_args()
    if args.memory_gib is not None and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_gib * 2**30 / total))
    data = Augmented(args.samples, seed=1) if args.augment else make_data(args.samples, seed=1)
    if args.loader_rate:
        rate = loader_rate(data, batch_size=args.batch_size, workers=args.workers or 0,
                           epochs=EPOCHS)
        print(json.dumps({"loader_samples_per_s": rate}))
        return
    if args.plain_loop:
        print(json.dumps(plain_loop(data, batch_size=args.batch_size, workers=args.workers or 0,
                                    epochs=EPOCHS, step_sleep_s=args.step_sleep_ms / 1000)))
        return
    fdl.Trainer(model=build_model, optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                train_step=train_step, train_data=data,
                eval_data=make_data(1024, seed=2), evaluate=evaluate,
                batch_size=args.batch_size, epochs=EPOCHS, num_workers=args.workers).fit()


if __name__ == "__main__":
    main()
