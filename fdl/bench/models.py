"""The model zoo of ``fdl bench``: small, well-known models with published results to compare to.

Each entry of :data:`MODELS` is a :class:`BenchModel` that plugs straight into ``fdl.Trainer``::

    bench = get_model("lenet5")
    trainer = fdl.Trainer(model=functools.partial(bench.build, meta),
                          optimizer=bench.make_optimizer, train_step=bench.train_step,
                          evaluate=bench.evaluate, schedule=bench.schedule,
                          batch_size=bench.batch_size, epochs=bench.epochs, ...)

``meta`` describes the dataset: ``{"input_shape": (C, H, W) or (seq_len,), "num_classes": int |
None, "vocab_size": int | None}``. Image models adapt to 28x28 (MNIST), 32x32 (CIFAR-10) and
8x8 (scikit-learn digits, the synthetic set). ``datasets`` lists the preferred dataset first,
then fallbacks that work offline. ``references`` maps a dataset to ``(value, source)`` where a
published result for this model exists; the metric is the one ``evaluate`` reports.

Batches are ``[x, y]`` from a ``TensorDataset``. Classifiers report ``accuracy`` (fraction,
higher is better); the autoencoder ignores ``y`` and reports reconstruction ``mse``; the
character models take ``x`` of shape (B, T) and ``y`` either (B, T) (next char at every
position) or (B,) (the char after the window), and report ``ce``, the mean cross-entropy per
character in nats. ``evaluate`` returns the batch mean; the engine weights batches by size.

Learning rate and batch size. Every mode — solo, sync, cadence, async — trains with the SAME
per-worker batch size and the SAME learning rate, taken from this table. Nothing is scaled for
the number of workers: a two-worker sync run sees a global batch twice as large at the same LR,
and that is part of what the benchmark measures: an LR scaled for the multi-worker modes would
mix a policy change with a tuning change in every comparison. ``schedule`` is a step decay
indexed by training progress, i.e. by global samples seen, so it is identical in every mode.
Initialisation is deterministic: the same ``torch.manual_seed`` gives the same weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fdl.errors import UsageError

IMAGE_DATASETS = ("mnist", "digits", "synthetic")


@dataclass(frozen=True)
class BenchModel:
    name: str
    network: Callable[[dict[str, Any]], nn.Module]  # module-level, so the model pickles
    task: str  # "classify" | "reconstruct" | "next-char"
    datasets: tuple[str, ...]
    metric: str  # "accuracy" | "mse" | "ce"
    higher_is_better: bool
    references: dict[str, tuple[float, str]]
    optimizer: str  # "sgd" | "adam"
    lr: float
    batch_size: int
    epochs: int
    quick_epochs: int
    momentum: float = 0.0
    weight_decay: float = 0.0
    lr_milestones: tuple[float, ...] = ()  # progress points where the LR is divided by 10

    def build(self, meta: dict[str, Any]) -> nn.Module:
        return self.network(meta)

    def make_optimizer(self, params: Iterable[Any]) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum,
                                   weight_decay=self.weight_decay)
        return torch.optim.Adam(params, lr=self.lr, weight_decay=self.weight_decay)

    def schedule(self, progress: float) -> float:
        """LR multiplier at ``progress`` in [0, 1] of the run's samples (1.0 without milestones)."""
        return 0.1 ** sum(1 for point in self.lr_milestones if progress >= point)

    def train_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return _LOSSES[self.task](model, batch)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch: Any) -> dict[str, float]:
        if self.task == "classify":
            x, y = batch
            return {self.metric: (model(x).argmax(dim=1) == y).float().mean().item()}
        return {self.metric: _LOSSES[self.task](model, batch).item()}


def get_model(name: str) -> BenchModel:
    if name not in MODELS:
        names = ", ".join(MODELS)
        raise UsageError(f"unknown model {name!r}; available: {names}",
                         hint=f"pick one of: {names}")
    return MODELS[name]


# --- losses (the train_step of each task) -------------------------------------------------

def _classify_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _reconstruct_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x = batch[0]
    return F.mse_loss(model(x), x)


def _next_char_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    if y.dim() == 1:  # one target per window: the char that follows it
        logits = logits[:, -1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


_LOSSES = {"classify": _classify_loss, "reconstruct": _reconstruct_loss,
           "next-char": _next_char_loss}


# --- networks --------------------------------------------------------------------------------

def _need(meta: dict[str, Any], key: str, model: str) -> Any:
    value = meta.get(key)
    if value is None:
        raise UsageError(f"model {model!r} needs meta[{key!r}]; got {meta!r}")
    return value


def _image_shape(meta: dict[str, Any], model: str) -> tuple[int, int, int]:
    shape = tuple(_need(meta, "input_shape", model))
    if len(shape) != 3:
        raise UsageError(f"model {model!r} needs an image input_shape (C, H, W); got {shape}")
    return shape  # type: ignore[return-value]


def build_logreg(meta: dict[str, Any]) -> nn.Module:
    shape = _image_shape(meta, "logreg")
    classes = _need(meta, "num_classes", "logreg")
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(shape), classes))


def build_mlp(meta: dict[str, Any]) -> nn.Module:
    inputs = math.prod(_image_shape(meta, "mlp"))
    return nn.Sequential(nn.Flatten(), nn.Linear(inputs, 256), nn.ReLU(), nn.Linear(256, 256),
                         nn.ReLU(), nn.Linear(256, _need(meta, "num_classes", "mlp")))


def build_lenet5(meta: dict[str, Any]) -> nn.Module:
    """LeNet-5's 6-16-120-84 shape. The 32x32 original needs no padding; 28x28 MNIST is padded
    by 2 (as LeCun padded it to 32); small inputs also pad the second convolution, and an
    adaptive pool always hands the classifier a 16x5x5 map."""
    channels, height, _ = _image_shape(meta, "lenet5")
    first_pad = 0 if height >= 32 else 2
    second_pad = 0 if (height + 2 * first_pad - 4) // 2 >= 10 else 2
    return nn.Sequential(
        nn.Conv2d(channels, 6, 5, padding=first_pad), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5, padding=second_pad), nn.ReLU(), nn.AdaptiveMaxPool2d(5),
        nn.Flatten(), nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(),
        nn.Linear(84, _need(meta, "num_classes", "lenet5")))


class ConvAutoencoder(nn.Module):
    """Two stride-2 convolutions down, two transposed convolutions up, linear output (so any
    input normalisation can be reconstructed)."""

    def __init__(self, channels: int):
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(channels, 16, 3, stride=2, padding=1), nn.ReLU(),
                                     nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU())
        self.decoder = nn.Sequential(
            nn.ConvTranspose2d(32, 16, 3, stride=2, padding=1, output_padding=1), nn.ReLU(),
            nn.ConvTranspose2d(16, channels, 3, stride=2, padding=1, output_padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.decoder(self.encoder(x))
        if out.shape[-2:] != x.shape[-2:]:  # sides not divisible by 4
            out = F.interpolate(out, size=x.shape[-2:], mode="bilinear", align_corners=False)
        return out


def build_autoencoder(meta: dict[str, Any]) -> nn.Module:
    return ConvAutoencoder(_image_shape(meta, "autoencoder")[0])


class CharRNN(nn.Module):
    def __init__(self, vocab_size: int, *, embed: int = 64, hidden: int = 128, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed)
        self.rnn = nn.GRU(embed, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(x))
        return self.head(out)


def build_char_rnn(meta: dict[str, Any]) -> nn.Module:
    return CharRNN(_need(meta, "vocab_size", "char-rnn"))


class CausalBlock(nn.Module):
    """Pre-norm transformer block; attention sees only earlier positions."""

    def __init__(self, width: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.attn_norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        heads = self.qkv(self.attn_norm(x)).view(batch, length, 3, self.num_heads, -1)
        query, key, value = heads.permute(2, 0, 3, 1, 4)  # each (B, heads, T, head_width)
        mixed = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        x = x + self.proj(mixed.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.mlp_norm(x))


class GptNano(nn.Module):
    def __init__(self, vocab_size: int, context: int, *, width: int = 96, num_heads: int = 4,
                 num_layers: int = 3):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*(CausalBlock(width, num_heads) for _ in range(num_layers)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device)
        return self.head(self.norm(self.blocks(self.tokens(x) + self.positions(positions))))


def build_gpt_nano(meta: dict[str, Any]) -> nn.Module:
    shape = tuple(_need(meta, "input_shape", "gpt-nano"))
    return GptNano(_need(meta, "vocab_size", "gpt-nano"), context=shape[-1])


class BasicBlock(nn.Module):
    """ResNet basic block with He et al.'s option-A shortcut: identity, or stride-2 subsampling
    plus zero channels when the shape changes (no parameters, as in the CIFAR experiments)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.stride = stride
        self.extra_channels = out_channels - in_channels
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        shortcut = x[:, :, ::self.stride, ::self.stride]
        if self.extra_channels:
            half = self.extra_channels // 2
            shortcut = F.pad(shortcut, (0, 0, 0, 0, half, self.extra_channels - half))
        return F.relu(out + shortcut)


def build_resnet20(meta: dict[str, Any]) -> nn.Module:
    channels = _image_shape(meta, "resnet20")[0]
    layers: list[nn.Module] = [nn.Conv2d(channels, 16, 3, padding=1, bias=False),
                               nn.BatchNorm2d(16), nn.ReLU()]
    width = 16
    for stage, out in enumerate((16, 32, 64)):
        for block in range(3):
            layers.append(BasicBlock(width, out, stride=2 if stage and not block else 1))
            width = out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(),
               nn.Linear(64, _need(meta, "num_classes", "resnet20"))]
    net = nn.Sequential(*layers)
    for module in net.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
    return net


# --- the zoo -------------------------------------------------------------------------------

_SHAKESPEARE_CE = (1.5, "char-level RNN on tiny-Shakespeare, ~1.5 nats/char (Karpathy's "
                        "char-rnn; a larger model than this one)")

MODELS: dict[str, BenchModel] = {m.name: m for m in (
    BenchModel(name="logreg", network=build_logreg, task="classify", datasets=IMAGE_DATASETS,
               metric="accuracy", higher_is_better=True,
               references={"mnist": (0.92, "softmax regression on MNIST, ~92% "
                                           "(TensorFlow's 'MNIST for ML beginners')")},
               optimizer="sgd", lr=0.1, batch_size=64, epochs=10, quick_epochs=1),
    BenchModel(name="mlp", network=build_mlp, task="classify", datasets=IMAGE_DATASETS,
               metric="accuracy", higher_is_better=True,
               references={"mnist": (0.98, "MLP with 2 hidden layers on MNIST, ~97-98% "
                                           "(LeCun et al. 1998 and later reports)")},
               optimizer="sgd", lr=0.05, momentum=0.9, batch_size=64, epochs=10, quick_epochs=8),
    BenchModel(name="lenet5", network=build_lenet5, task="classify", datasets=IMAGE_DATASETS,
               metric="accuracy", higher_is_better=True,
               references={"mnist": (0.99, "LeNet-5 on MNIST, 0.95% test error "
                                           "(LeCun et al. 1998)")},
               optimizer="sgd", lr=0.05, momentum=0.9, batch_size=64, epochs=10, quick_epochs=4),
    BenchModel(name="autoencoder", network=build_autoencoder, task="reconstruct",
               datasets=IMAGE_DATASETS, metric="mse", higher_is_better=False, references={},
               optimizer="adam", lr=1e-3, batch_size=64, epochs=10, quick_epochs=1),
    BenchModel(name="char-rnn", network=build_char_rnn, task="next-char",
               datasets=("shakespeare",), metric="ce", higher_is_better=False,
               references={"shakespeare": _SHAKESPEARE_CE},
               optimizer="adam", lr=2e-3, batch_size=64, epochs=10, quick_epochs=1),
    BenchModel(name="gpt-nano", network=build_gpt_nano, task="next-char",
               datasets=("shakespeare",), metric="ce", higher_is_better=False,
               references={"shakespeare": _SHAKESPEARE_CE},
               optimizer="adam", lr=1e-3, batch_size=64, epochs=10, quick_epochs=1),
    # He et al.: batch 128, LR 0.1 divided by 10 at 32k and 48k of 64k iterations (~164 epochs).
    BenchModel(name="resnet20", network=build_resnet20, task="classify",
               datasets=("cifar10", "digits", "synthetic"), metric="accuracy",
               higher_is_better=True,
               references={"cifar10": (0.9125, "He et al. 2015, Deep Residual Learning, Table 6: "
                                               "ResNet-20 8.75% error")},
               optimizer="sgd", lr=0.1, momentum=0.9, weight_decay=1e-4, batch_size=128,
               epochs=164, quick_epochs=2, lr_milestones=(0.5, 0.75)),
)}
