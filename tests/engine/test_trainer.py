"""fdl.Trainer in-process: solo training, configuration errors before training, schedules, the
optimizer factory; and one real 2-worker run refusing a collective inside a step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import run_fdl

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from common import build_model, build_optimizer, evaluate, make_data, train_step

import fdl
from fdl.errors import UsageError

SCRIPTS = Path(__file__).parent / "scripts"


def trainer(**overrides) -> fdl.Trainer:
    settings = dict(model=build_model, optimizer=build_optimizer, train_step=train_step,
                    train_data=make_data(512, seed=1), eval_data=make_data(128, seed=2),
                    evaluate=evaluate, batch_size=32, epochs=3, seed=3)
    settings.update(overrides)
    return fdl.Trainer(**settings)


def test_solo_fit_trains_and_reports():
    result = trainer().fit()
    assert isinstance(result, fdl.TrainResult)
    losses = [record["train_loss"] for record in result.history]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert result.metrics["accuracy"] > 0.8
    assert result.summary["world_size"] == 1 and result.summary["samples"] == 3 * 512
    assert result.run_dir is None
    assert next(result.model.parameters()).device.type == "cpu"


def test_solo_fit_is_deterministic_for_a_seed():
    a, b = trainer(epochs=1).fit(), trainer(epochs=1).fit()
    for (name, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items(),
                                 strict=True):
        assert torch.equal(x, y), name


def test_solo_run_dir_from_env_gets_the_artifacts(tmp_path, monkeypatch):
    monkeypatch.setenv("FDL_RUN_DIR", str(tmp_path / "run"))
    result = trainer(epochs=1).fit()
    assert result.run_dir == tmp_path / "run"
    for name in ("summary.json", "metrics.jsonl", "model.pt", "config.json",
                 "timeline/rank0.jsonl"):
        assert (tmp_path / "run" / name).is_file(), name


@pytest.mark.parametrize(("overrides", "needle"), [
    ({"batch_size": 0}, "batch_size"),
    ({"epochs": 0}, "epochs"),
    ({"policy": "turbo"}, "unknown policy"),
    ({"backend": "tpu"}, "unknown backend"),
    ({"train_data": make_data(16, seed=1)}, "fewer than one batch per worker"),
    ({"evaluate": None}, "eval_data and evaluate go together"),
    ({"eval_data": None, "evaluate": None, "eval_derive": lambda means: {}},
     "eval_derive computes metrics from evaluate's means"),
    ({"model": "not callable"}, "must be callables"),
])
def test_bad_configuration_fails_before_training(overrides, needle):
    built: list[int] = []

    def counting_optimizer(params):
        built.append(1)
        return build_optimizer(params)

    with pytest.raises(UsageError, match=needle):
        trainer(optimizer=counting_optimizer, **overrides).fit()
    assert built == []  # nothing was trained


def test_non_scalar_loss_is_an_error_before_the_first_update():
    model_holder: list[torch.nn.Module] = []

    def build():
        model_holder.append(build_model())
        return model_holder[-1]

    def vector_step(model, batch):
        features, labels = batch
        return torch.nn.functional.cross_entropy(model(features), labels, reduction="none")

    torch.manual_seed(3)
    before = {k: v.clone() for k, v in build_model().state_dict().items()}
    with pytest.raises(UsageError, match=r"scalar loss tensor.*shape \(32,\)"):
        trainer(model=build, train_step=vector_step).fit()
    after = model_holder[-1].state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_nccl_backend_without_gpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: nccl is available")
    with pytest.raises(UsageError, match="nccl"):
        trainer(backend="nccl").fit()


def test_schedule_is_indexed_by_global_samples():
    seen: list[float] = []

    def schedule(progress: float) -> float:
        seen.append(progress)
        return 1.0 - progress

    result = trainer(schedule=schedule, epochs=2).fit()
    assert seen[0] == 0.0
    assert seen == sorted(seen) and seen[-1] < 1.0
    steps = 2 * 512 // 32
    assert len(seen) == steps
    # step k of the run (batch 32 of 1024 samples) sees progress k * 32 / 1024
    assert seen == pytest.approx([k * 32 / 1024 for k in range(steps)])
    assert result.history[-1]["train_loss"] is not None


def test_a_scheduler_factory_is_stepped_once_per_global_step():
    """``scheduler=``: the engine steps the torch scheduler once per step of the run (alone,
    each step is one), after the last step too, as a script's ``scheduler.step()`` after each
    ``optimizer.step()`` would: the LR of each step is the schedule's at the steps before it."""
    schedulers, lrs = [], []

    def make(optimizer):
        schedulers.append(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1 / (1 + k)))
        return schedulers[-1]

    def step(model, batch):
        lrs.append(schedulers[0].optimizer.param_groups[0]["lr"])
        return train_step(model, batch)

    trainer(scheduler=make, train_step=step, epochs=2).fit()
    steps = 2 * 512 // 32
    assert schedulers[0].last_epoch == steps
    assert lrs == pytest.approx([0.1 / (1 + k) for k in range(steps)])  # common's lr is 0.1


def test_a_scheduler_factory_asking_for_total_steps_gets_the_run_s(monkeypatch):
    """A factory with a ``total_steps`` parameter gets the run's global steps, fdl run's
    settings applied (FDL_EPOCHS=3 over the Trainer's 2), and its OneCycleLR ends there."""
    monkeypatch.setenv("FDL_EPOCHS", "3")
    schedulers, totals = [], []

    def make(optimizer, total_steps):
        totals.append(total_steps)
        schedulers.append(torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1,
                                                              total_steps=total_steps))
        return schedulers[-1]

    trainer(scheduler=make, epochs=2).fit()
    assert totals == [3 * 512 // 32]
    assert schedulers[0].last_epoch == 3 * 512 // 32


def test_eval_derive_adds_whole_set_metrics_to_every_epoch_s_record():
    """``eval_derive`` (``run.evaluate(..., derive=)``) gets the epoch's means over every sample
    and its metrics go where the means go: each epoch's record and ``result.metrics``."""
    seen = []

    def derive(means):
        seen.append(dict(means))
        return {"error": 1 - means["accuracy"]}

    result = trainer(eval_derive=derive).fit()
    assert [set(means) for means in seen] == [{"accuracy", "loss"}] * 3
    for record in result.history:
        assert record["eval"]["error"] == pytest.approx(1 - record["eval"]["accuracy"])
    assert result.metrics == result.history[-1]["eval"] and "error" in result.metrics


def test_drop_last_trains_a_batch_norm_model_on_whole_batches_and_sizes_its_scheduler():
    """513 samples leave one over each epoch: BatchNorm refuses that batch of one (ValueError)
    unless ``drop_last=True`` (or a DataLoader's) leaves it out. A ``total_steps`` factory
    counts whole batches too (540 samples, 3 epochs: 48 steps, not 1620 // 32 = 50), and a
    sample budget is cut to whole batches (100: 96)."""
    totals = []

    def make(optimizer, total_steps):
        totals.append(total_steps)
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1,
                                                   total_steps=total_steps)

    with_batch_norm = lambda: build_model(True)  # noqa: E731
    data = make_data(513, seed=1)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        trainer(model=with_batch_norm, train_data=data).fit()
    result = trainer(model=with_batch_norm, train_data=data, drop_last=True).fit()
    assert result.summary["samples"] == 3 * 512
    trainer(train_data=make_data(540, seed=1), drop_last=True, scheduler=make).fit()
    assert totals == [3 * 512 // 32]
    loader = torch.utils.data.DataLoader(data, batch_size=32, drop_last=True)
    result = trainer(model=with_batch_norm, train_data=loader, max_samples=100).fit()
    assert result.summary["samples"] == 96


@pytest.mark.parametrize(("overrides", "needle"), [
    ({"scheduler": lambda optimizer: torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)},
     "LR scheduler stepped once per step"),
    ({"scheduler": lambda optimizer: torch.optim.lr_scheduler.StepLR(
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), 1)},
     "made on another optimizer"),
    ({"scheduler": lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, 1),
      "schedule": lambda progress: 1.0}, "both set the learning rate"),
])
def test_a_scheduler_the_engine_cannot_step_is_refused_before_any_step(overrides, needle):
    steps: list[int] = []

    def counting_step(model, batch):
        steps.append(1)
        return train_step(model, batch)

    with pytest.raises(UsageError, match=needle):
        trainer(train_step=counting_step, **overrides).fit()
    assert steps == []


# --- the optimizer factory ------------------------------------------------------------------


def two_groups(params):
    """nanoGPT's configure_optimizers: it walks the parameters twice, decay for matrices."""
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    made.append(torch.optim.SGD([{"params": decay, "weight_decay": 0.01},
                                 {"params": rest, "weight_decay": 0.0}], lr=0.1))
    return made[-1]


made: list[torch.optim.Optimizer] = []


def test_a_factory_that_walks_the_parameters_twice_gets_every_one():
    made.clear()
    initial = {name: p.detach().clone() for name, p in build_model().named_parameters()}
    result = trainer(optimizer=two_groups, epochs=1).fit()
    sizes = [len(group["params"]) for group in made[-1].param_groups]
    assert sizes == [2, 2]  # two weight matrices, two biases: none left out
    for name, value in result.model.named_parameters():  # every one trained
        assert not torch.equal(value.detach(), initial[name]), name


def test_a_factory_taking_the_model_gets_the_model():
    seen: list[torch.nn.Module] = []

    def by_module(model):
        seen.append(model)
        linear = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
        return torch.optim.SGD(linear, lr=0.1)

    trainer(optimizer=by_module, epochs=1).fit()
    assert len(seen) == 1 and isinstance(seen[0], torch.nn.Module)


# --- no collective inside a step under cadence and async ------------------------------------


def test_sync_batch_norm_and_a_sharded_optimizer_are_refused_before_any_step():
    from fdl.engine.checks import refuse_collectives_in_steps

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.SyncBatchNorm(8))
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UsageError, match=r"model's 1 is a SyncBatchNorm.*--policy cadence"):
        refuse_collectives_in_steps(model, plain, policy="cadence")
    plain_model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    refuse_collectives_in_steps(plain_model, plain, policy="async")  # nothing to refuse


def test_a_sharded_optimizer_under_cadence_stops_every_worker_with_one_line(tmp_path):
    proc = run_fdl("run", "--nproc-per-node", "2", "--policy", "cadence", "--quiet-ranks",
                   "--run-dir", str(tmp_path / "run"), str(SCRIPTS / "zero_in_step.py"),
                   cwd=tmp_path, timeout=180)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    log = (tmp_path / "run" / "logs" / "rank0.log").read_text()
    assert "error: ZeroRedundancyOptimizer's collectives in every step hang under --policy " \
           "cadence" in log
    assert "Traceback" not in log


def test_a_train_step_may_return_a_dict_and_callbacks_see_every_epoch(tmp_path, monkeypatch):
    monkeypatch.setenv("FDL_RUN_DIR", str(tmp_path / "run"))
    seen: list[dict] = []

    class Recorder:
        def on_epoch_end(self, record):
            seen.append(record)

    def with_accuracy(model, batch):
        features, labels = batch
        logits = model(features)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels),
                "accuracy": (logits.argmax(1) == labels).float().mean()}

    result = trainer(train_step=with_accuracy, callbacks=[Recorder()]).fit()
    assert seen == result.history and len(seen) == 3
    assert seen[-1]["train_loss"] < seen[0]["train_loss"]
    from fdl.rundir.timeline import read_events

    logged = [e["values"] for e in read_events(tmp_path / "run", 0) if e["kind"] == "scalars"]
    assert logged and all(set(values) == {"loss", "accuracy"} for values in logged)
    assert 0.5 < logged[-1]["accuracy"] <= 1


def test_a_callback_without_a_hook_is_refused():
    with pytest.raises(UsageError, match=r"callbacks\[0\] \(object\) has neither"):
        trainer(callbacks=[object()]).fit()
