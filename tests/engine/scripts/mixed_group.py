"""One rank of a real 2-process group where one worker has a GPU and the other none (CUDA hidden
from it): each picks its device and joins with backend ``auto`` as fdl.engine.loop does
(fdl.engine.collectives), then both take one blocking average of a small model through the
engine's Averager with the backend they agreed on. Writes OUT/rank<r>.json with the device, the
backend and the checksum of the averaged model. torchrun's variables (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) come from the test.
Usage: mixed_group.py OUT"""

import json
import os
import sys

import torch
from torch import nn

from fdl.engine.averaging import Averager, checksum
from fdl.engine.collectives import Membership, join_group, leave_group, pick_device
from fdl.engine.state import REPORT_FIELDS

membership = Membership.from_env()
device = pick_device(membership.local_rank, "auto")
group = join_group("auto", device, membership.world_size)
torch.manual_seed(membership.rank)  # different replicas: the average must make them one
model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Linear(64, 10)).to(device)
averager = Averager(model, rank=membership.rank, world_size=membership.world_size,
                    backend=group.backend, device=device, num_stats=len(REPORT_FIELDS),
                    group=group.process_group)
averager.pack(weight=1 / membership.world_size, stats=[0.0] * len(REPORT_FIELDS),
              keep_snapshot=True)
averager.all_reduce(async_op=False)
averager.load_average()
with open(os.path.join(sys.argv[1], f"rank{membership.rank}.json"), "w") as handle:
    json.dump({"device": str(device), "backend": group.backend, "checksum": checksum(model)},
              handle)
leave_group(group)
