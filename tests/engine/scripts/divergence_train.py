"""Least squares on a linear model that becomes unstable halfway through the run: from there
the loss is scaled by FACTOR (as a loss-scaling mistake or an exploding-gradient regime would
scale it), so each SGD step multiplies the error and the replicas blow apart between averages,
with the learning rate (the guard's lr_scale) unchanged. Settings come from fdl run.
Usage: divergence_train.py NUM_SAMPLES FACTOR"""

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import fdl

num_samples, factor = int(sys.argv[1]), float(sys.argv[2])
generator = torch.Generator().manual_seed(1)
features = torch.randn(num_samples, 8, generator=generator)
targets = features @ torch.randn(8, 1, generator=generator)
targets += 0.1 * torch.randn(num_samples, 1, generator=generator)
scale = [1.0]


def schedule(progress: float) -> float:
    """Called before every step with the run's progress: flips the loss scale at half-time,
    leaves the learning rate as it is."""
    scale[0] = 1.0 if progress < 0.5 else factor
    return 1.0


def train_step(model, batch):
    x, y = batch
    return scale[0] * F.mse_loss(model(x), y)


fdl.Trainer(
    model=lambda: nn.Linear(8, 1), optimizer=lambda params: torch.optim.SGD(params, lr=0.05),
    train_step=train_step, train_data=TensorDataset(features, targets), batch_size=32,
    epochs=2, policy="cadence", seed=7, schedule=schedule,
).fit()
