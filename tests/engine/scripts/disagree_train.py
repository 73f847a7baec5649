"""A loop script whose ranks can be told to differ (tests/engine/test_agreement.py):

    python disagree_train.py data|epochs|model|none

Rank 1 (or the node with DISAGREE_HERE=1 set, for two nodes) reads other samples of the same
length, asks for another epoch count, or builds a wider model; ``none``: all alike."""

import os
import sys

import torch
from common import make_data

import fdl

what = sys.argv[1]
here = os.environ.get("DISAGREE_HERE", "1" if os.environ.get("RANK") == "1" else "0") == "1"
odd = here and what != "none"
run = fdl.init(seed=3, epochs=3 if odd and what == "epochs" else 2)
width = 48 if odd and what == "model" else 32
model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = make_data(256, seed=9 if odd and what == "data" else 1)
for features, labels in run.batches(data, model=model, optimizer=optimizer, batch_size=16):
    torch.nn.functional.cross_entropy(model(features), labels).backward()
    optimizer.step()
    optimizer.zero_grad()
run.finish()
print(f"trained {what}", flush=True)
