"""fdl.Trainer on NUM_SAMPLES samples whose third tensor is the sample's index, batch 4,
2 epochs; every rank writes the indices it trained on, in order, to OUT/rank<r>.json, and with
``workers`` (a DataLoader with a loader worker) those the training process fetched itself to
OUT/in_process<r>.json. Policy and slowdown come from fdl run.
Usage: sample_ledger.py OUT NUM_SAMPLES [workers]"""

import json
import os
import sys

import torch
import torch.nn.functional as F
from common import build_model, build_optimizer, make_data
from torch.utils.data import DataLoader, Dataset, TensorDataset, get_worker_info

import fdl

out, num_samples = sys.argv[1], int(sys.argv[2])
features, labels = make_data(num_samples, seed=1).tensors
workers = sys.argv[3:] == ["workers"]
data = TensorDataset(features, labels, torch.arange(num_samples))
seen: list[int] = []
in_process: list[int] = []


class Flagged(Dataset):
    """The samples, each with whether a loader worker fetched it."""

    def __len__(self):
        return num_samples

    def __getitem__(self, i):
        return (*data[i], torch.tensor(get_worker_info() is not None))


def train_step(model, batch):
    x, y, index, *flag = batch
    seen.extend(index.tolist())
    if flag:
        in_process.extend(index[~flag[0]].tolist())
    return F.cross_entropy(model(x), y)


train_data = DataLoader(Flagged(), batch_size=4, num_workers=1) if workers else data
fdl.Trainer(model=build_model, optimizer=build_optimizer, train_step=train_step,
            train_data=train_data, batch_size=4, epochs=2, seed=3).fit()
rank = os.environ.get("RANK", "0")
with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
    json.dump(seen, handle)
if workers:
    with open(os.path.join(out, f"in_process{rank}.json"), "w") as handle:
        json.dump(in_process, handle)
