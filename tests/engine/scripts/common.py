"""Model, data and steps shared by the engine's test scripts (kept tiny: tests run on 2 cores)."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


def make_data(num_samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(num_samples, 8, generator=generator)
    labels = (features[:, :4].sum(dim=1) > 0).long()
    return TensorDataset(features, labels)


def build_model(batch_norm: bool = False) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(8, 32)]
    if batch_norm:
        layers.append(nn.BatchNorm1d(32))
    return nn.Sequential(*layers, nn.Tanh(), nn.Linear(32, 2))


def build_optimizer(params):
    return torch.optim.SGD(params, lr=0.1)


def train_step(model, batch):
    features, labels = batch
    return F.cross_entropy(model(features), labels)


def evaluate(model, batch):
    features, labels = batch
    logits = model(features)
    return {"accuracy": (logits.argmax(dim=1) == labels).float().mean().item(),
            "loss": F.cross_entropy(logits, labels).item()}


def native_threads() -> list[str]:
    """The names of this process's threads, as the kernel has them (Linux): gloo's show as
    ``gloo_tcp_loop`` and ``pt_gloo_runloop`` while a process group lives."""
    import os

    tasks = f"/proc/{os.getpid()}/task"
    names = []
    for task in os.listdir(tasks):
        try:
            with open(f"{tasks}/{task}/comm") as handle:
                names.append(handle.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sorted(names)
