"""A training loop of your own on fdl.init's API: a small CNN on a 10-class image task, with
gradient accumulation over 2 batches, clipping, a cosine LR on ``run.progress`` and an autocast
region (this rank's precision).

    python examples/loop_cnn.py                                             # solo
    fdl run --policy async --simulate-slowdown 1,2.5 examples/loop_cnn.py   # 2 workers
    fdl run --precision bf16,fp32 examples/loop_cnn.py                      # one rank in bf16
    fdl compare examples/loop_cnn.py --seeds 3 --simulate-slowdown 1,2.5    # the policies

The task is synthetic, so it needs no download: each class is a smooth 16x16 pattern of its
own, and a sample is its class's pattern shifted by up to 2 pixels, scaled, and buried in
noise. ``--out DIR`` writes each rank's final model checksum and precision (for checking that
every rank ends with the identical model).
"""

import argparse
import hashlib
import json
import math
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import fdl

NUM_CLASSES, SIZE = 10, 16


def make_data(num_samples: int, *, seed: int, noise: float = 1.0) -> TensorDataset:
    patterns = torch.nn.functional.avg_pool2d(
        torch.randn(NUM_CLASSES, 1, SIZE, SIZE, generator=torch.Generator().manual_seed(0)),
        3, stride=1, padding=1) * 3
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(NUM_CLASSES, (num_samples,), generator=generator)
    shifts = torch.randint(-2, 3, (num_samples, 2), generator=generator)
    images = torch.stack([torch.roll(patterns[label], (int(dy), int(dx)), dims=(1, 2))
                          for label, (dy, dx) in zip(labels.tolist(), shifts.tolist(),
                                                     strict=True)])
    scale = 0.5 + torch.rand(num_samples, 1, 1, 1, generator=generator)
    images = images * scale + noise * torch.randn(images.shape, generator=generator)
    return TensorDataset(images, labels)


def build_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, NUM_CLASSES))


def evaluate(model: nn.Module, batch) -> dict[str, float]:
    images, labels = batch
    logits = model(images)
    return {"accuracy": (logits.argmax(1) == labels).float().mean().item(),
            "loss": F.cross_entropy(logits, labels).item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-samples", type=int, default=8000)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--out", default=None, help="write each rank's final checksum here")
    args = parser.parse_args()

    run = fdl.init(seed=1)
    model = build_model().to(run.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    run.evaluate(make_data(2000, seed=10_000), evaluate)
    accumulate = 2
    for index, (images, labels) in enumerate(run.batches(
            make_data(args.train_samples, seed=1), model=model, optimizer=optimizer,
            batch_size=32, epochs=4, accumulate=accumulate)):
        lr = args.lr * 0.5 * (1 + math.cos(math.pi * run.progress))
        for group in optimizer.param_groups:
            group["lr"] = lr
        with run.autocast():
            logits = model(images)
        loss = F.cross_entropy(logits.float(), labels)
        (loss / accumulate).backward()
        run.log(loss=loss.detach())
        if (index + 1) % accumulate == 0:
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    result = run.finish()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        digest = hashlib.sha256()
        for tensor in result.model.state_dict().values():
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        with open(os.path.join(args.out, f"rank{run.rank}.json"), "w") as handle:
            json.dump({"checksum": digest.hexdigest(), "precision": run.precision,
                       "autocast_dtype": str(logits.dtype), "accuracy":
                       result.metrics.get("accuracy"),
                       "param_dtypes": sorted({str(p.dtype) for p in model.parameters()})},
                      handle)


if __name__ == "__main__":
    main()
