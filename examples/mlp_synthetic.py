"""El Che on a synthetic classification task, offline: Gaussian clusters around fixed class
centres, an MLP classifier. Runs solo or under `fdl run`:

    python examples/mlp_synthetic.py
    fdl run --nproc-per-node 2 --policy async --simulate-slowdown 1,2.5 examples/mlp_synthetic.py

Options (after the script): --hidden N (width, default 512), --train-samples N (8192),
--noise X (cluster spread, default 2.5), --epochs N (3),
--batch-size N (64), --lr X (0.05). `fdl run --epochs/--batch-size` override them.
--read-ms X: each training sample takes X ms to read (a sleep: the latency of a disk or a
network share, not CPU work); --workers N: a DataLoader with N loader workers
(scripts/bench-loader measures both).
--loop: the same training written as a loop of its own on fdl.init's API instead of
fdl.Trainer (the same engine; scripts/bench-elche measures both).
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import fdl

NUM_FEATURES, NUM_CLASSES = 64, 10


def make_data(num_samples: int, *, seed: int, noise: float) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(NUM_CLASSES, NUM_FEATURES, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, NUM_CLASSES, (num_samples,), generator=generator)
    features = centres[labels] + noise * torch.randn(num_samples, NUM_FEATURES,
                                                     generator=generator)
    return TensorDataset(features, labels)


class ReadLatency(Dataset):
    """``data`` whose every sample takes ``read_ms`` to read, as from a slow disk."""

    def __init__(self, data: TensorDataset, read_ms: float):
        self.data, self.read_s = data, read_ms / 1000

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index):
        time.sleep(self.read_s)
        return self.data[index]


def train_data(args: argparse.Namespace):
    """The training set as the options ask: in memory, slow to read, behind loader workers."""
    data = make_data(args.train_samples, seed=1, noise=args.noise)
    if args.read_ms:
        data = ReadLatency(data, args.read_ms)
    if args.workers:
        return DataLoader(data, batch_size=args.batch_size, num_workers=args.workers)
    return data


def train_step(model, batch):
    features, labels = batch
    return F.cross_entropy(model(features), labels)


def evaluate(model, batch):
    features, labels = batch
    logits = model(features)
    return {"loss": F.cross_entropy(logits, labels).item(),
            "accuracy": (logits.argmax(dim=1) == labels).float().mean().item()}


def add_task_arguments(parser: argparse.ArgumentParser) -> None:
    """The task's size and difficulty (shared with ddp_plain.py, so both train the same)."""
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--train-samples", type=int, default=8192)
    parser.add_argument("--noise", type=float, default=2.5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)


def loop(args: argparse.Namespace, build_model) -> fdl.RunResult:
    """fdl.Trainer's training below, as a loop of one's own."""
    run = fdl.init(policy="cadence")
    model = build_model().to(run.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    run.evaluate(make_data(4096, seed=2, noise=args.noise), evaluate)
    for batch in run.batches(train_data(args), model=model, optimizer=optimizer, batch_size=args.batch_size,
                             epochs=args.epochs):
        optimizer.zero_grad(set_to_none=True)
        with run.autocast():
            loss = train_step(model, batch)
        loss.backward()
        optimizer.step()
        run.log(loss=loss.detach())
    return run.finish()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_task_arguments(parser)
    parser.add_argument("--loop", action="store_true", help="a loop of its own (fdl.init)")
    parser.add_argument("--read-ms", type=float, default=0.0,
                        help="each training sample takes this long to read (a sleep)")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers")
    args = parser.parse_args()

    def build_model() -> nn.Module:
        return nn.Sequential(nn.Linear(NUM_FEATURES, args.hidden), nn.ReLU(),
                             nn.Linear(args.hidden, args.hidden), nn.ReLU(),
                             nn.Linear(args.hidden, NUM_CLASSES))

    result = loop(args, build_model) if args.loop else fdl.Trainer(
        model=build_model,
        optimizer=lambda params: torch.optim.SGD(params, lr=args.lr, momentum=0.9),
        train_step=train_step,
        train_data=train_data(args),
        eval_data=make_data(4096, seed=2, noise=args.noise),
        evaluate=evaluate, batch_size=args.batch_size, epochs=args.epochs, policy="cadence",
    ).fit()
    print(f"final accuracy {result.metrics['accuracy']:.4f} "
          f"({result.summary['throughput']['samples_per_s']:.0f} samples/s)")


if __name__ == "__main__":
    main()
