"""The bench model zoo: every model builds for every dataset it names, trains, evaluates, and
the classic ones match their published shapes."""

from __future__ import annotations

import pickle

import pytest
import torch

from fdl.bench.models import MODELS, BenchModel, get_model
from fdl.errors import UsageError

META = {
    "mnist": {"input_shape": (1, 28, 28), "num_classes": 10, "vocab_size": None},
    "cifar10": {"input_shape": (3, 32, 32), "num_classes": 10, "vocab_size": None},
    "digits": {"input_shape": (1, 8, 8), "num_classes": 10, "vocab_size": None},
    "synthetic": {"input_shape": (1, 8, 8), "num_classes": 10, "vocab_size": None},
    "shakespeare": {"input_shape": (64,), "num_classes": None, "vocab_size": 65},
}
CASES = [(name, dataset) for name, model in MODELS.items() for dataset in model.datasets]


def make_batch(meta: dict, size: int = 4, *, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    if meta["vocab_size"]:
        text = torch.randint(0, meta["vocab_size"], (size, meta["input_shape"][0] + 1),
                             generator=generator)
        return [text[:, :-1], text[:, 1:]]
    x = torch.randn(size, *meta["input_shape"], generator=generator)
    return [x, torch.randint(0, meta["num_classes"], (size,), generator=generator)]


def test_zoo_names_and_datasets():
    assert list(MODELS) == ["logreg", "mlp", "lenet5", "autoencoder", "char-rnn", "gpt-nano",
                            "resnet20"]
    for name in ("logreg", "mlp", "lenet5", "autoencoder"):
        assert MODELS[name].datasets == ("mnist", "digits", "synthetic")
    assert MODELS["resnet20"].datasets == ("cifar10", "digits", "synthetic")
    assert MODELS["char-rnn"].datasets == MODELS["gpt-nano"].datasets == ("shakespeare",)
    assert {m.metric for m in MODELS.values()} == {"accuracy", "mse", "ce"}
    for model in MODELS.values():
        assert model.higher_is_better == (model.metric == "accuracy")
        assert set(model.references) <= set(model.datasets)
        assert model.quick_epochs <= model.epochs


def test_published_references():
    assert MODELS["resnet20"].references["cifar10"][0] == 0.9125
    assert "He et al. 2015" in MODELS["resnet20"].references["cifar10"][1]
    assert MODELS["logreg"].references["mnist"][0] == 0.92
    assert MODELS["mlp"].references["mnist"][0] == 0.98
    assert MODELS["lenet5"].references["mnist"][0] == 0.99
    assert MODELS["char-rnn"].references["shakespeare"][0] == 1.5
    assert MODELS["autoencoder"].references == {}


@pytest.mark.parametrize(("name", "dataset"), CASES)
def test_builds_trains_and_evaluates(name, dataset):
    model, meta = MODELS[name], META[dataset]
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
        meta = META[model.datasets[0]]
        torch.manual_seed(7)
        first = model.build(meta).state_dict()
        torch.manual_seed(7)
        second = model.build(meta).state_dict()
        assert all(torch.equal(first[key], second[key]) for key in first), model.name


def test_resnet20_has_the_published_size():
    net = MODELS["resnet20"].build(META["cifar10"])
    count = sum(p.numel() for p in net.parameters())
    assert 0.26e6 < count < 0.28e6  # He et al.: 0.27M
    assert net(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_lenet5_keeps_its_classic_layer_sizes():
    net = MODELS["lenet5"].build(META["mnist"])
    linear = [m for m in net.modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linear] == [(400, 120), (120, 84), (84, 10)]


def test_gpt_nano_is_causal():
    model = MODELS["gpt-nano"]
    net = model.build(META["shakespeare"]).eval()
    x = make_batch(META["shakespeare"], size=2)[0]
    changed = x.clone()
    changed[:, 40:] = (changed[:, 40:] + 1) % 65
    with torch.no_grad():
        before, after = net(x), net(changed)
    assert torch.allclose(before[:, :40], after[:, :40], atol=1e-5)
    assert not torch.allclose(before[:, 40:], after[:, 40:])


def test_char_models_accept_a_single_next_char_target():
    meta = META["shakespeare"]
    x, y = make_batch(meta, size=3)
    for name in ("char-rnn", "gpt-nano"):
        loss = MODELS[name].train_step(MODELS[name].build(meta), [x, y[:, -1]])
        assert loss.dim() == 0 and torch.isfinite(loss)


@pytest.mark.parametrize("name", ["logreg", "mlp"])
def test_a_few_sgd_steps_reduce_the_loss(name):
    model = MODELS[name]
    torch.manual_seed(0)
    net = model.build(META["digits"])
    optimizer = model.make_optimizer(net.parameters())
    assert isinstance(optimizer, torch.optim.SGD)
    assert optimizer.param_groups[0]["lr"] == model.lr
    batch = make_batch(META["digits"], size=32, seed=3)
    first = model.train_step(net, batch).item()
    for _ in range(10):
        optimizer.zero_grad()
        model.train_step(net, batch).backward()
        optimizer.step()
    assert model.train_step(net, batch).item() < 0.8 * first


def test_optimizer_settings_are_applied():
    resnet = MODELS["resnet20"].make_optimizer(torch.nn.Linear(2, 2).parameters())
    group = resnet.param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.1, 0.9, 1e-4)
    assert isinstance(MODELS["gpt-nano"].make_optimizer(torch.nn.Linear(2, 2).parameters()),
                      torch.optim.Adam)


def test_schedule_is_a_step_decay_by_progress():
    resnet = MODELS["resnet20"]
    assert [resnet.schedule(p) for p in (0.0, 0.49, 0.5, 0.8)] == pytest.approx(
        [1.0, 1.0, 0.1, 0.01])
    assert MODELS["mlp"].schedule(0.9) == 1.0


def test_step_functions_pickle_for_worker_processes():
    model = pickle.loads(pickle.dumps(MODELS["mlp"]))
    assert isinstance(model, BenchModel) and model == MODELS["mlp"]
    step = pickle.loads(pickle.dumps(MODELS["autoencoder"].train_step))
    evaluate = pickle.loads(pickle.dumps(MODELS["autoencoder"].evaluate))
    batch = make_batch(META["digits"])
    net = MODELS["autoencoder"].build(META["digits"])
    assert evaluate(net, batch) == {"mse": pytest.approx(step(net, batch).item())}


def test_get_model():
    assert get_model("resnet20") is MODELS["resnet20"]
    with pytest.raises(UsageError) as caught:
        get_model("resnet50")
    assert caught.value.exit_code == 2
    assert "'resnet50'" in caught.value.message
    assert "logreg, mlp, lenet5, autoencoder, char-rnn, gpt-nano, resnet20" in caught.value.message


def test_build_names_a_missing_meta_field():
    with pytest.raises(UsageError, match="vocab_size"):
        MODELS["char-rnn"].build({"input_shape": (64,), "num_classes": None, "vocab_size": None})
    with pytest.raises(UsageError, match="input_shape"):
        MODELS["lenet5"].build({"input_shape": (64,), "num_classes": 10})
