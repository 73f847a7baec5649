"""fdl.Trainer on a tiny task whose steps past the second wait for RELEASE to exist, so a test can
watch the run's live display before training goes on (a 120 s guard, over the whole run, keeps a
broken test from hanging); with FIRST, the first step waits for that file too, as a compilation
holds it. Usage: watched_train.py RELEASE [FIRST]"""

import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import fdl

release = sys.argv[1]
first = sys.argv[2] if len(sys.argv) > 2 else None
steps = 0
deadline = time.monotonic() + 120  # one guard for the run: a per-step one added up to hours


def make_data(num_samples, seed):
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(num_samples, 8, generator=generator)
    return TensorDataset(features, (features[:, :4].sum(dim=1) > 0).long())


def train_step(model, batch):
    global steps
    steps += 1
    held = release if steps > 2 else first if steps == 1 else None
    while held and not os.path.exists(held) and time.monotonic() < deadline:
        time.sleep(0.01)
    features, labels = batch
    return F.cross_entropy(model(features), labels)


def evaluate(model, batch):
    features, labels = batch
    logits = model(features)
    return {"accuracy": (logits.argmax(dim=1) == labels).float().mean().item()}


fdl.Trainer(
    model=lambda: nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)),
    optimizer=lambda params: torch.optim.SGD(params, lr=0.1), train_step=train_step,
    train_data=make_data(512, seed=1), eval_data=make_data(128, seed=2), evaluate=evaluate,
    batch_size=16, epochs=3, seed=3,
).fit()
