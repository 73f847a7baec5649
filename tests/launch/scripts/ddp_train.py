"""A plain torch DDP script written the torchrun way (no fdl): trains a tiny model on gloo and
writes its final parameters and its environment to OUT_DIR/rank<r>.{pt,json}."""

import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

out_dir = sys.argv[1]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                                    torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
data = torch.Generator().manual_seed(1)
x = torch.randn(64 * world, 8, generator=data)
y = x.sum(dim=1, keepdim=True)
for _ in range(20):
    batch = slice(rank * 64, (rank + 1) * 64)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x[batch]), y[batch])
    loss.backward()
    opt.step()
torch.save(model.module.state_dict(), os.path.join(out_dir, f"rank{rank}.pt"))
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
    json.dump(dict(os.environ), fh)
print(f"rank {rank} final loss {loss.item():.4f}")
# Free DDP (its reducer holds gloo work objects, in reference cycles) while the group is alive:
# left to interpreter exit, it can abort the process after a successful run.
del model, opt
gc.collect()
dist.destroy_process_group()
