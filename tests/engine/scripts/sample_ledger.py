"""fdl.Trainer on NUM_SAMPLES samples whose third tensor is the sample's index, batch 4,
2 epochs; every rank writes the indices it trained on, in order, to OUT/rank<r>.json. Policy
and slowdown come from fdl run. Usage: sample_ledger.py OUT NUM_SAMPLES"""

import json
import os
import sys

import torch
import torch.nn.functional as F
from common import build_model, build_optimizer, make_data
from torch.utils.data import TensorDataset

import fdl

out, num_samples = sys.argv[1], int(sys.argv[2])
features, labels = make_data(num_samples, seed=1).tensors
data = TensorDataset(features, labels, torch.arange(num_samples))
seen: list[int] = []


def train_step(model, batch):
    x, y, index = batch
    seen.extend(index.tolist())
    return F.cross_entropy(model(x), y)


fdl.Trainer(model=build_model, optimizer=build_optimizer, train_step=train_step,
            train_data=data, batch_size=4, epochs=2, seed=3).fit()
with open(os.path.join(out, f"rank{os.environ.get('RANK', '0')}.json"), "w") as handle:
    json.dump(seen, handle)
