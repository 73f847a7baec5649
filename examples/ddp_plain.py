"""The same task as mlp_synthetic.py written as a plain torchrun DDP script (no fdl), for
comparing fdl's sync policy with torch DDP: `torchrun --nproc-per-node 2 examples/ddp_plain.py
OUT.json --hidden 1536 ...`. Rank 0 writes the training throughput (eval excluded) to OUT.json.
"""

import argparse
import gc
import json
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from mlp_synthetic import NUM_CLASSES, NUM_FEATURES, add_task_arguments, make_data
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    add_task_arguments(parser)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(NUM_FEATURES, args.hidden), nn.ReLU(),
                          nn.Linear(args.hidden, args.hidden), nn.ReLU(),
                          nn.Linear(args.hidden, NUM_CLASSES))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    ddp = DistributedDataParallel(model)
    data = make_data(args.train_samples, seed=1, noise=args.noise)
    step_samples = world * args.batch_size
    start = time.perf_counter()
    for epoch in range(args.epochs):
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(42 + epoch))
        for step in range(len(data) // step_samples):
            low = step * step_samples + rank * args.batch_size
            features, labels = data[order[low:low + args.batch_size]]
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(features), labels).backward()
            optimizer.step()
    wall = time.perf_counter() - start
    samples = args.epochs * (len(data) // step_samples) * step_samples
    if rank == 0:
        with open(args.out, "w") as handle:
            json.dump({"samples_per_s": samples / wall, "wall_s": wall}, handle)
    # Free DDP (its reducer holds gloo work objects in reference cycles) while the group is
    # alive: left to interpreter exit, it can abort the process after a successful run.
    del ddp, optimizer
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
