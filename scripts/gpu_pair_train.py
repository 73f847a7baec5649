"""The training script of scripts/test-gpu's CUDA + CPU pair: a small CNN on CIFAR-shaped synthetic
images (3x32x32, 10 classes, the label a fixed random projection of the image, so there is
something to learn), trained by fdl.Trainer with the settings fdl run gives it.

    fdl run --nproc-per-node 1 scripts/gpu_pair_train.py --samples 20000

The data is made from a fixed seed on every node alike (the same length and order everywhere, as
El Che needs). Nothing is downloaded.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import fdl

CLASSES = 10


def make_data(num_samples: int, *, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(num_samples, 3, 32, 32, generator=generator)
    projection = torch.randn(3 * 8 * 8, CLASSES, generator=torch.Generator().manual_seed(0))
    pooled = F.avg_pool2d(images, 4).flatten(1)
    return TensorDataset(images, (pooled @ projection).argmax(dim=1))


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20_000)
    args = parser.parse_args()
    fdl.Trainer(model=build_model, optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                train_step=train_step, train_data=make_data(args.samples, seed=1),
                eval_data=make_data(1024, seed=2), evaluate=evaluate, batch_size=128,
                epochs=3).fit()


if __name__ == "__main__":
    main()
