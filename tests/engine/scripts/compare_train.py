"""A tiny fdl.Trainer script for `fdl compare`'s tests: two features' sign decides the class,
512 training samples; epochs, policy and seed come from fdl run. ``--lr X`` (default 0.1).
The step and the evaluation are the engine test scripts' (common.py)."""

import sys

import torch
from common import evaluate, train_step
from torch import nn
from torch.utils.data import TensorDataset

import fdl


def make_data(num_samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(num_samples, 8, generator=generator)
    return TensorDataset(features, (features[:, :2].sum(dim=1) > 0).long())


lr = float(sys.argv[sys.argv.index("--lr") + 1]) if "--lr" in sys.argv else 0.1
fdl.Trainer(
    model=lambda: nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)),
    optimizer=lambda params: torch.optim.SGD(params, lr=lr), train_step=train_step,
    train_data=make_data(512, seed=1), eval_data=make_data(128, seed=2), evaluate=evaluate,
    batch_size=32,
).fit()
