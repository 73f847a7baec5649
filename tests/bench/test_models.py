"""The bench model zoo: what its table means. Every model builds for every dataset it names,
maps that dataset's inputs to the outputs its task needs, trains and evaluates; the table in
docs/bench.md (datasets, metric, parameter count, epochs) is the code's; the classic models
match their published shapes."""

from __future__ import annotations

import functools
import pickle
from pathlib import Path

import pytest
import torch

from fdl.bench import datasets
from fdl.bench.models import MODELS, BenchModel, get_model
from fdl.bench.sweep import QUICK_DATASET, QUICK_MODELS
from fdl.errors import UsageError

BENCH_DOC = Path(__file__).parents[2] / "docs" / "bench.md"
# What load_dataset gives a worker for the sets it would have to download (shapes as the
# datasets module documents them; tiny-shakespeare has 65 characters, the worker's default
# window is 128); the offline sets are loaded for real (``dataset_meta``).
DOWNLOADED_META = {
    "mnist": {"input_shape": (1, 28, 28), "num_classes": 10, "vocab_size": None},
    "cifar10": {"input_shape": (3, 32, 32), "num_classes": 10, "vocab_size": None},
    "shakespeare": {"input_shape": (128,), "num_classes": None, "vocab_size": 65},
}
METRICS = {"classify": "accuracy", "reconstruct": "mse", "next-char": "ce"}
CASES = [(name, dataset) for name, model in MODELS.items() for dataset in model.datasets]


@functools.cache
def dataset_meta(name: str) -> dict:
    if name in DOWNLOADED_META:
        return DOWNLOADED_META[name]
    meta = datasets.load_dataset(name, data_dir=Path("unused"), download=False).meta
    return {key: meta[key] for key in ("input_shape", "num_classes", "vocab_size")}


def make_batch(meta: dict, size: int = 4, *, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    if meta["vocab_size"]:
        text = torch.randint(0, meta["vocab_size"], (size, meta["input_shape"][0] + 1),
                             generator=generator)
        return [text[:, :-1], text[:, 1:]]
    x = torch.randn(size, *meta["input_shape"], generator=generator)
    return [x, torch.randint(0, meta["num_classes"], (size,), generator=generator)]


def num_parameters(net: torch.nn.Module) -> int:
    return sum(p.numel() for p in net.parameters())


def doc_table() -> list[dict[str, str]]:
    """The rows of docs/bench.md's model table, by column name."""
    lines = BENCH_DOC.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| model | datasets |"))
    header = [cell.strip() for cell in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (c.strip() for c in line.strip("|").split("|")),
                             strict=True)))
    return rows


def test_the_documented_table_is_the_zoo():
    rows = doc_table()
    assert [row["model"] for row in rows] == [f"`{name}`" for name in MODELS]
    for row in rows:
        model = MODELS[row["model"].strip("`")]
        assert row["datasets"] == ", ".join(f"`{d}`" for d in model.datasets), model.name
        assert row["metric"] == model.metric, model.name
        net = model.build(dataset_meta(model.datasets[0]))
        assert int(row["parameters"].replace(",", "")) == num_parameters(net), model.name
        assert int(row["epochs"]) == model.epochs, model.name
        assert int(row["`--quick` epochs"]) == model.quick_epochs, model.name


def test_every_entry_is_consistent():
    for model in MODELS.values():
        assert set(model.datasets) <= set(datasets.NAMES), model.name
        assert model.metric == METRICS[model.task], model.name
        assert model.higher_is_better == (model.metric == "accuracy"), model.name
        assert 1 <= model.quick_epochs <= model.epochs, model.name
        assert list(model.lr_milestones) == sorted(model.lr_milestones), model.name
        assert all(0 < point < 1 for point in model.lr_milestones), model.name
        for dataset, (value, source) in model.references.items():
            assert dataset in model.datasets, (model.name, dataset)
            assert (0 < value <= 1) if model.metric == "accuracy" else value > 0, model.name
            assert source.strip(), model.name
    for name in QUICK_MODELS:  # --quick trains them on the generated set, offline
        assert QUICK_DATASET in MODELS[name].datasets, name


@pytest.mark.parametrize(("name", "dataset"), CASES)
def test_output_shape_fits_the_task_and_the_dataset(name, dataset):
    model, meta = MODELS[name], dataset_meta(dataset)
    x = make_batch(meta, size=3)[0]
    with torch.no_grad():
        out = model.build(meta).eval()(x)
    expected = {"classify": (3, meta["num_classes"]), "reconstruct": tuple(x.shape),
                "next-char": (3, meta["input_shape"][0], meta["vocab_size"])}[model.task]
    assert tuple(out.shape) == expected


@pytest.mark.parametrize(("name", "dataset"), CASES)
def test_builds_trains_and_evaluates(name, dataset):
    model, meta = MODELS[name], dataset_meta(dataset)
    net = model.build(meta)
    batch = make_batch(meta)
    loss = model.train_step(net, batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in net.parameters()]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)
    metrics = model.evaluate(net, batch)
    assert list(metrics) == [model.metric]
    value = metrics[model.metric]
    assert isinstance(value, float) and value >= 0.0
    if model.metric == "accuracy":
        assert value <= 1.0
    else:  # mse / ce: evaluate reports the training loss of the batch
        assert value == pytest.approx(loss.item(), rel=1e-5)


def test_initialisation_is_deterministic_under_manual_seed():
    for model in MODELS.values():
        meta = dataset_meta(model.datasets[0])
        torch.manual_seed(7)
        first = model.build(meta).state_dict()
        torch.manual_seed(7)
        second = model.build(meta).state_dict()
        assert all(torch.equal(first[key], second[key]) for key in first), model.name


def test_resnet20_has_the_published_size():
    net = MODELS["resnet20"].build(dataset_meta("cifar10"))
    assert 0.26e6 < num_parameters(net) < 0.28e6  # He et al.: 0.27M
    assert net(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_lenet5_keeps_its_classic_layer_sizes():
    net = MODELS["lenet5"].build(dataset_meta("mnist"))
    linear = [m for m in net.modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linear] == [(400, 120), (120, 84), (84, 10)]


def test_gpt_nano_is_causal():
    model = MODELS["gpt-nano"]
    net = model.build(dataset_meta("shakespeare")).eval()
    x = make_batch(dataset_meta("shakespeare"), size=2)[0]
    changed = x.clone()
    changed[:, 40:] = (changed[:, 40:] + 1) % 65
    with torch.no_grad():
        before, after = net(x), net(changed)
    assert torch.allclose(before[:, :40], after[:, :40], atol=1e-5)
    assert not torch.allclose(before[:, 40:], after[:, 40:])


def test_char_models_accept_a_single_next_char_target():
    meta = dataset_meta("shakespeare")
    x, y = make_batch(meta, size=3)
    for name in ("char-rnn", "gpt-nano"):
        loss = MODELS[name].train_step(MODELS[name].build(meta), [x, y[:, -1]])
        assert loss.dim() == 0 and torch.isfinite(loss)


@pytest.mark.parametrize("name", ["logreg", "mlp"])
def test_a_few_sgd_steps_reduce_the_loss(name):
    model = MODELS[name]
    torch.manual_seed(0)
    net = model.build(dataset_meta("digits"))
    optimizer = model.make_optimizer(net.parameters())
    assert isinstance(optimizer, torch.optim.SGD)
    assert optimizer.param_groups[0]["lr"] == model.lr
    batch = make_batch(dataset_meta("digits"), size=32, seed=3)
    first = model.train_step(net, batch).item()
    for _ in range(10):
        optimizer.zero_grad()
        model.train_step(net, batch).backward()
        optimizer.step()
    assert model.train_step(net, batch).item() < 0.8 * first


@pytest.mark.parametrize("name", list(MODELS))
def test_the_optimizer_is_built_from_the_entry(name):
    model = MODELS[name]
    optimizer = model.make_optimizer(torch.nn.Linear(2, 2).parameters())
    kind = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[model.optimizer]
    assert type(optimizer) is kind
    group = optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"]) == (model.lr, model.weight_decay)
    if model.optimizer == "sgd":
        assert group["momentum"] == model.momentum


@pytest.mark.parametrize("name", list(MODELS))
def test_the_schedule_divides_the_lr_by_ten_at_each_milestone(name):
    model = MODELS[name]
    assert model.schedule(0.0) == 1.0
    for passed, point in enumerate(model.lr_milestones, start=1):
        assert model.schedule(point - 1e-6) == pytest.approx(0.1 ** (passed - 1))
        assert model.schedule(point) == pytest.approx(0.1 ** passed)
    assert model.schedule(1.0) == pytest.approx(0.1 ** len(model.lr_milestones))


def test_step_functions_pickle_for_worker_processes():
    model = pickle.loads(pickle.dumps(MODELS["mlp"]))
    assert isinstance(model, BenchModel) and model == MODELS["mlp"]
    step = pickle.loads(pickle.dumps(MODELS["autoencoder"].train_step))
    evaluate = pickle.loads(pickle.dumps(MODELS["autoencoder"].evaluate))
    batch = make_batch(dataset_meta("digits"))
    net = MODELS["autoencoder"].build(dataset_meta("digits"))
    assert evaluate(net, batch) == {"mse": pytest.approx(step(net, batch).item())}


def test_get_model():
    assert get_model("resnet20") is MODELS["resnet20"]
    with pytest.raises(UsageError) as caught:
        get_model("resnet50")
    assert caught.value.exit_code == 2
    assert "'resnet50'" in caught.value.message
    assert all(name in caught.value.message for name in MODELS)


def test_build_names_a_missing_meta_field():
    with pytest.raises(UsageError, match="vocab_size"):
        MODELS["char-rnn"].build({"input_shape": (64,), "num_classes": None, "vocab_size": None})
    with pytest.raises(UsageError, match="input_shape"):
        MODELS["lenet5"].build({"input_shape": (64,), "num_classes": 10})
