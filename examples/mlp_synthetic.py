"""El Che on a synthetic classification task: an MLP whose step takes tens of milliseconds on
one CPU core. Runs solo (`python examples/mlp_synthetic.py`) or distributed:

    fdl run --nproc-per-node 2 --policy async --simulate-slowdown 1,2.5 examples/mlp_synthetic.py
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import fdl

NUM_FEATURES, NUM_CLASSES, HIDDEN = 64, 10, 512


def make_data(num_samples: int, seed: int) -> TensorDataset:
    """Gaussian clusters around fixed class centres: learnable, not trivial."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(NUM_CLASSES, NUM_FEATURES, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, NUM_CLASSES, (num_samples,), generator=generator)
    features = centres[labels] * 0.6 + torch.randn(num_samples, NUM_FEATURES, generator=generator)
    return TensorDataset(features, labels)


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(NUM_FEATURES, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, NUM_CLASSES))


def build_optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def train_step(model, batch):
    features, labels = batch
    return F.cross_entropy(model(features), labels)


def evaluate(model, batch):
    features, labels = batch
    logits = model(features)
    return {"loss": F.cross_entropy(logits, labels).item(),
            "accuracy": (logits.argmax(dim=1) == labels).float().mean().item()}


if __name__ == "__main__":
    result = fdl.Trainer(
        model=build_model, optimizer=build_optimizer, train_step=train_step,
        train_data=make_data(8192, seed=1), eval_data=make_data(2048, seed=2),
        evaluate=evaluate, batch_size=64, epochs=3, policy="cadence",
    ).fit()
    print(f"final accuracy {result.metrics['accuracy']:.4f}")
