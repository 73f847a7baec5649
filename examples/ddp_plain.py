"""The same task as mlp_synthetic.py written as a plain torchrun DDP script (no fdl), for
comparing fdl's sync policy with torch DDP: `torchrun --nproc-per-node 2 examples/ddp_plain.py
OUT.json --hidden 1536 ...`. Rank 0 writes the training throughput (eval excluded) to OUT.json.

`--slowdown 1,2.5` emulates devices that much slower as plainly as it can be done, for
comparing with `fdl run --policy sync --simulate-slowdown 1,2.5`: each rank first times its
compute per step alone (a copy of the model, no DDP, no peer: the median of 20 steps after 5
warm-up steps), then in training sleeps (f - 1) x that after every step, taking what a sleep
overran off the next one. The all-reduce and the wait for the peer are never multiplied.
"""

import argparse
import copy
import gc
import json
import statistics
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
    parser.add_argument("--slowdown", type=lambda text: [float(f) for f in text.split(",")],
                        help="per-rank slowdown factors, e.g. 1,2.5 (slept on compute only)")
    add_task_arguments(parser)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(NUM_FEATURES, args.hidden), nn.ReLU(),
                          nn.Linear(args.hidden, args.hidden), nn.ReLU(),
                          nn.Linear(args.hidden, NUM_CLASSES))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    data = make_data(args.train_samples, seed=1, noise=args.noise)
    sleep_s = 0.0
    if args.slowdown:
        sleep_s = (args.slowdown[rank] - 1) * compute_per_step(model, data, args)
    ddp = DistributedDataParallel(model)
    step_samples = world * args.batch_size
    owed = 0.0
    dist.barrier()
    start = time.perf_counter()
    for epoch in range(args.epochs):
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(42 + epoch))
        for step in range(len(data) // step_samples):
            low = step * step_samples + rank * args.batch_size
            features, labels = data[order[low:low + args.batch_size]]
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(features), labels).backward()
            optimizer.step()
            owed += sleep_s
            if owed > 0:
                slept = time.perf_counter()
                time.sleep(owed)
                owed -= time.perf_counter() - slept
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


def compute_per_step(model: nn.Module, data, args: argparse.Namespace) -> float:
    """This rank's compute per step alone: a copy of the model, no DDP, no peer."""
    alone = copy.deepcopy(model)
    optimizer = torch.optim.SGD(alone.parameters(), lr=args.lr, momentum=0.9)
    times = []
    for step in range(25):
        features, labels = data[step * args.batch_size:(step + 1) * args.batch_size]
        began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(alone(features), labels).backward()
        optimizer.step()
        times.append(time.perf_counter() - began)
    return statistics.median(times[5:])


if __name__ == "__main__":
    main()
