"""A loop of its own computing each batch in run.micro_parts (fdl run --micro-batch); writes
the parts' sizes of its first batch to OUT/rank<r>.json and the consensus model to
OUT/rank<r>.pt. Usage: micro_loop.py OUT"""

import json
import os
import sys

import torch
import torch.nn.functional as F
from common import build_model, make_data

import fdl

run = fdl.init(batch_size=32, epochs=1)
model = build_model().to(run.device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
first = None
for batch in run.batches(make_data(256, seed=1), model=model, optimizer=optimizer):
    parts = run.micro_parts(batch)
    first = first or [len(part[0]) for part, _ in parts]
    for (x, y), share in parts:
        (F.cross_entropy(model(x), y) * share).backward()
    optimizer.step()
    optimizer.zero_grad()
result = run.finish()
rank = os.environ.get("RANK", "0")
torch.save(result.model.state_dict(), os.path.join(sys.argv[1], f"rank{rank}.pt"))
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as handle:
    json.dump(first, handle)
