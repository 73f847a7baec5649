"""A loop script on streaming data: text shards (one sample id per line), or an IterableDataset,
with a budget from fdl run (--max-steps / --max-samples / --max-time). Writes OUT/rank<r>.json:
the sample ids this rank trained on with the stream's epoch of each batch, its steps, the
first and last run.progress, and the summary.

Usage: stream_train.py OUT SHARD_DIR [--iterable]

With shards, the script makes the ShardStream itself (to read its epoch after each batch); the
shards' lengths are multiples of the batch size, so no batch spans two shards or two epochs.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import IterableDataset

import fdl
from fdl.engine.shards import ShardStream


def features(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    table = torch.randn(10_000, 8, generator=generator)
    x = table[ids]
    return x, (x[:, :4].sum(dim=1) > 0).long()


class Counting(IterableDataset):
    def __iter__(self):
        return iter(range(4000))


out, shard_dir = sys.argv[1], Path(sys.argv[2])
run = fdl.init(seed=3)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)).to(run.device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
if "--iterable" in sys.argv:
    data = stream = Counting()
else:
    stream = data = ShardStream(
        sorted(str(p) for p in shard_dir.glob("*.txt")), batch_size=16, seed=3, rank=run.rank,
        world_size=run.world_size,
        open_shard=lambda path: [int(line) for line in Path(path).read_text().split()])
seen, steps, progress = [], 0, []
for batch in run.batches(data, model=model, optimizer=optimizer, batch_size=16, epochs=1):
    ids = torch.as_tensor(batch)
    seen.append([getattr(stream, "epoch", 0), ids.tolist()])
    x, y = features(ids)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    run.log(loss=loss)
    steps += 1
    progress.append(run.progress)
result = run.finish()
with open(os.path.join(out, f"rank{run.rank}.json"), "w") as handle:
    json.dump({"seen": seen, "steps": steps, "progress": [progress[0], progress[-1]],
               "summary": result.summary, "history": result.history}, handle)
