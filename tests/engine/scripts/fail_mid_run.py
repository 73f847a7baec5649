"""A loop script one of whose ranks raises in the middle of training (tests/nodes: the other
node must stop at once, naming it):

    python fail_mid_run.py STEPS [raise|stall]

Rank 1 (or every rank of the node with FAIL_HERE=1 set, for two nodes) raises ValueError at
its STEPS-th step, or stalls there (a process that lives on and answers nothing: a hung data
read); the others would train for minutes."""

import os
import sys
import threading

import torch
from common import make_data

import fdl

fail_at, how = int(sys.argv[1]), (sys.argv[2:] or ["raise"])[0]
here = os.environ.get("FAIL_HERE", "1" if os.environ.get("RANK") == "1" else "0") == "1"
run = fdl.init(seed=3, epochs=50)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step, (features, labels) in enumerate(run.batches(make_data(20000, seed=1), model=model,
                                                      optimizer=optimizer, batch_size=16)):
    if here and step == fail_at and how == "stall":
        threading.Event().wait()  # until the launcher stops it
    if here and step == fail_at:
        raise ValueError(f"a bad batch at step {step} (the script's own error)")
    torch.nn.functional.cross_entropy(model(features), labels).backward()
    optimizer.step()
    optimizer.zero_grad()
run.finish()
