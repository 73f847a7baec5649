"""The sync policy's reference: plain torch DDP (no fdl), same seed, same data order as El Che's
stream (epoch e = randperm seeded seed + e; step i gives rank r the r-th batch of the i-th
2*B samples). Writes OUT/rank<r>.pt. ``--clip``: clip the (mean) gradient at norm 0.05."""

import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.fsdp  # before the group, as fdl.init does (see test_averaging)
from common import build_model, build_optimizer, make_data, train_step
from torch.nn.parallel import DistributedDataParallel

out, seed, epochs, batch = sys.argv[1], 7, 2, 32
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(seed)
model = build_model()
optimizer = build_optimizer(model.parameters())
ddp = DistributedDataParallel(model)
data = make_data(1024, seed=1)
for epoch in range(epochs):
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed + epoch))
    for step in range(len(data) // (world * batch)):
        low = step * world * batch + rank * batch
        optimizer.zero_grad(set_to_none=True)
        train_step(ddp, data[order[low:low + batch]]).backward()
        if "--clip" in sys.argv:  # the mean gradient, clipped (loop_train.py --clip)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        optimizer.step()
torch.save(model.state_dict(), os.path.join(out, f"rank{rank}.pt"))
del ddp, optimizer  # free DDP while the group is alive (see tests/launch/scripts/ddp_train.py)
gc.collect()
dist.destroy_process_group()
