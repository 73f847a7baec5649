"""The same task as mlp_synthetic.py written as a plain torchrun DDP script (no fdl), for
comparing fdl's sync policy with torch DDP: `torchrun --nproc-per-node 2 examples/ddp_plain.py
OUT.json --hidden 1536 ...`. Rank 0 writes the training throughput (eval excluded) to OUT.json.

`--slowdown 1,2.5` emulates devices that much slower as plainly as it can be done, for
comparing with `fdl run --policy sync --simulate-slowdown 1,2.5`: after every step each rank
sleeps (f - 1) x that step's compute — its time less the time its backward spent in DDP's
all-reduce, from the last bucket handed to torch's default all-reduce hook to that all-reduce's
completion — taking what a sleep overran off the next one. The all-reduce and the wait for
the peer in it are never multiplied.
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
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
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
    ddp = DistributedDataParallel(model)
    factor = args.slowdown[rank] if args.slowdown else 1.0
    clock = AllReduceClock()
    if factor > 1:
        ddp.register_comm_hook(clock, AllReduceClock.hook)
    step_samples = world * args.batch_size
    owed = 0.0
    dist.barrier()
    start = time.perf_counter()
    for epoch in range(args.epochs):
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(42 + epoch))
        for step in range(len(data) // step_samples):
            began = time.perf_counter()
            low = step * step_samples + rank * args.batch_size
            features, labels = data[order[low:low + args.batch_size]]
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(features), labels).backward()
            optimizer.step()
            if factor <= 1:
                continue
            owed += (factor - 1) * (time.perf_counter() - began - clock.take())
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


class AllReduceClock:
    """torch's default all-reduce hook, timed: the step's last bucket handed over, and the
    latest all-reduce completion (both read before backward() returns: DDP waits for them)."""

    def __init__(self):
        self.handed = self.done = None

    def hook(self, bucket):
        self.handed = time.perf_counter()

        def done(future):
            self.done = max(self.done or 0.0, time.perf_counter())
            return future.value()

        return allreduce_hook(None, bucket).then(done)

    def take(self) -> float:
        """The step's all-reduce time after the last hand-over, and forget it."""
        seconds = max(0.0, self.done - self.handed) if self.handed and self.done else 0.0
        self.handed = self.done = None
        return seconds


if __name__ == "__main__":
    main()
