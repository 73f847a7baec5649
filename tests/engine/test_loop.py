"""El Che in a loop script (fdl.init, run.batches, run.finish): `fdl run` with 2 real gloo
workers on loopback, the script tests/engine/scripts/loop_train.py.

Each policy on the loop: sync equals plain torch DDP; cadence and async end with the identical
model on both ranks while the fast rank trains on more batches; accumulation over 2 batches never
sees an average between the two; user state goes into checkpoints and comes back on resume; a
loop that never steps is told so."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import clean_env, run_fdl

from fdl.rundir.checkpoints import latest_checkpoint
from fdl.rundir.timeline import read_events

# the plan's shares, round ends and run.progress follow the workers' measured speed:
# these tests run with no other test beside them (tests/conftest.py)
pytestmark = pytest.mark.alone

SCRIPTS = Path(__file__).parent / "scripts"
TORCHRUN = Path(sys.executable).parent / "torchrun"


def loop_run(tmp_path: Path, *flags: str, script_args: tuple[str, ...] = (),
             name: str = "run") -> tuple[Path, Path, list[dict]]:
    out, run_dir = tmp_path / f"out-{name}", tmp_path / name
    out.mkdir(exist_ok=True)
    proc = run_fdl("run", "--nproc-per-node", "2", *flags,
                   *(() if "--resume" in flags else ("--run-dir", str(run_dir))),
                   str(SCRIPTS / "loop_train.py"), str(out), *script_args, cwd=tmp_path,
                   timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for record in seen:  # run.finish() destroyed the group: no gloo thread left to teardown
        assert not [t for t in record["threads_after_finish"] if "gloo" in t], record
        # and stopped the liveness thread: none may be in a store call at the interpreter's exit
        assert "fdl-liveness" not in record["python_threads_after_finish"], record
    return out, run_dir, seen


def same_models(out: Path) -> None:
    first, second = torch.load(out / "rank0.pt"), torch.load(out / "rank1.pt")
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name


def test_a_loop_under_sync_equals_plain_torch_ddp(tmp_path):
    """With clipping (tight enough to bind every step): the loop's gradients are the mean
    when backward returns, so the script clips the mean, as it would under DDP."""
    clipping = ("--clip",)
    out, _, seen = loop_run(tmp_path, "--policy", "sync", "--simulate-slowdown", "1,2.5",
                            script_args=("--plain", *clipping))
    ref = tmp_path / "ref"
    ref.mkdir()
    proc = subprocess.run([str(TORCHRUN), "--standalone", "--nproc-per-node", "2",
                           str(SCRIPTS / "ddp_reference.py"), str(ref), *clipping],
                          capture_output=True,
                          text=True, timeout=240, env=clean_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, theirs = torch.load(out / "rank0.pt"), torch.load(ref / "rank0.pt")
    for name in ours:
        assert torch.allclose(ours[name], theirs[name], atol=1e-6, rtol=0), name
    same_models(out)
    assert seen[0]["batches"] == seen[1]["batches"] == 32  # 2 epochs of 1024 / (2 x 32)


def test_a_loop_under_sync_ends_an_epoch_on_a_sliver_without_hanging(tmp_path):
    """1025 samples, steps of 2 x 32: each epoch's last round is one sample, too few for a
    step of 2 batches on rank 0 and none on rank 1. Both must join the all-reduce the plan
    gives that step (with zeros), or one waits for the other for good."""
    out, _, seen = loop_run(tmp_path, "--policy", "sync", script_args=(
        "--accumulate", "2", "--samples", "1025", "--plain"))
    same_models(out)
    assert [r["samples"] for r in seen] == [1024, 1024]  # 2 epochs, the sliver left out
    assert all(r["batches"] == 2 * r["steps"] for r in seen)


def test_a_loop_under_sync_keeps_one_model_when_an_epoch_ends_on_one_rank_s_step(tmp_path):
    """1056 samples, 33 batches of 32: each epoch's last round is one step on rank 0 and none
    on rank 1, which joins its all-reduce with zeros. Its optimizer does not step, so it takes
    rank 0's parameters after (as DDP's join does); it trained on apart from then on before
    (found as a flaky `--policy auto` test: the switch to sync left an odd number of batches
    in the epoch only when the elastic round ended on one)."""
    out, _, seen = loop_run(tmp_path, "--policy", "sync", script_args=(
        "--samples", "1056", "--plain"))
    same_models(out)
    assert [r["batches"] for r in seen] == [34, 32]  # 2 epochs: 17 and 16 batches each


@pytest.mark.parametrize("policy", ["cadence", "async"])
def test_a_loop_that_accumulates_is_averaged_only_after_its_steps(tmp_path, policy):
    # 1,4: a margin wide enough that a busy machine's noise cannot turn the shares around;
    # rank 0 computes in bf16, rank 1 in fp32
    out, run_dir, seen = loop_run(tmp_path, "--policy", policy, "--simulate-slowdown", "1,4",
                                  "--precision", "bf16,fp32",
                                  script_args=("--accumulate", "2", "--first-step-s", "0.5"))
    same_models(out)
    fast, slow = seen
    for rank in seen:
        assert rank["mid_step_changes"] == 0  # no average between the 2 batches of a step
        assert rank["progress_back"] == 0
        assert rank["batches"] == 2 * rank["steps"]
    # the planner gives the fast rank the larger share once the speeds are known (round 0
    # calibrates): what it decided, not what a clock measured
    planned = [sum(e["planned"] for e in read_events(run_dir, r)
                   if e["kind"] == "round" and e["round"] > 0) for r in (0, 1)]
    assert planned[0] > planned[1]
    # the first step's extra 0.5 s (a compilation) is timed but not slowed: rank 1 at 4x slept
    # 3x it (1.5 s) before, in the calibration round, while rank 0 waited
    [calibration] = [e for e in read_events(run_dir, 1) if e["kind"] == "round" and
                     e["round"] == 0]
    assert calibration["busy_s"] >= 0.5 and calibration["sleep_s"] < 0.5
    assert fast["samples"] + slow["samples"] == 2 * 1024  # every sample once per epoch
    assert {size for rank in seen for size in rank["batch_sizes"]} == {32}  # whole batches
    assert fast["summary"]["accumulate"] == 2
    assert [r["autocast_dtypes"] for r in seen] == [["torch.bfloat16"], ["torch.float32"]]
    assert all(r["param_dtypes"] == ["torch.float32"] for r in seen)  # parameters stay fp32
    assert fast["summary"]["precision"] == ["bf16", "fp32"]
    assert fast["summary"]["policy"] == policy
    assert fast["metrics"]["accuracy"] > 0.7
    syncs = [e for e in read_events(run_dir, 0) if e["kind"] == "sync"]
    assert len(syncs) >= 3  # averaged more than once per epoch: rounds within epochs
    # run.after_average: once per boundary where an average landed: a blocking one, or an
    # async boundary that applies the one launched before (not one after a blocking boundary)
    previous_blocking = [True] + [e["blocking"] for e in syncs[:-1]]
    landed = sum(e["blocking"] or not before for e, before in zip(syncs, previous_blocking, strict=True))
    assert fast["averages"] == landed
    assert fast["epoch_ends"] == 2
    logged = [e for e in read_events(run_dir, 0) if e["kind"] == "scalars"]
    assert logged and all("loss" in e["values"] for e in logged)
    assert fast["history"][-1]["train_loss"] is not None
    # every rank's figures for an epoch rode in its last average: no collective of its own,
    # and the record adds up the ranks' steps and losses as the ranks' timelines have them
    assert [r["epoch_exchanges"] for r in seen] == [0, 0]
    rounds = [e for r in (0, 1) for e in read_events(run_dir, r) if e["kind"] == "round"]
    losses = {(e["rank"], e["round"]): e["values"]["loss"] for r in (0, 1)
              for e in read_events(run_dir, r) if e["kind"] == "scalars"}
    for record in fast["history"]:
        mine = [e for e in rounds if e["epoch"] == record["epoch"] - 1]
        steps = sum(e["steps"] for e in mine)
        expected = sum(losses[e["rank"], e["round"]] * e["steps"] for e in mine
                       if e["steps"]) / steps  # a round of no steps on a rank logs nothing
        assert record["train_loss"] == pytest.approx(expected, rel=1e-5)
        assert sum(record["per_rank_samples_per_s"]) * record["epoch_s"] == \
            pytest.approx(1024, rel=1e-4)  # each rank's samples: the epoch's, once


def test_a_dataloader_s_drop_last_keeps_a_batch_norm_model_off_a_one_sample_batch(tmp_path):
    """1057 samples in batches of 32 leave one over each epoch: a batch of one sample, which
    BatchNorm refuses in training (the run stopped with "Expected more than 1 value per
    channel"). The script's DataLoader has drop_last=True, as it would under DDP: every batch
    is whole, on both ranks, and each epoch trains on 1056 samples."""
    out, _, seen = loop_run(tmp_path, "--policy", "cadence", "--simulate-slowdown", "1,2.5",
                            script_args=("--batch-norm", "--drop-last", "--samples", "1057"))
    same_models(out)
    assert [r["batch_sizes"] for r in seen] == [[32], [32]]
    assert sum(r["samples"] for r in seen) == seen[0]["summary"]["samples"] == 2 * 1056


def test_drop_last_leaves_a_different_remainder_out_each_epoch_and_counts_whole_batches():
    """Of 97 samples in batches of 32 an epoch trains on 96: the order is drawn over all 97
    each epoch and cut, so the sample left out changes (not always the last one, which a cut
    dataset would leave out for good). ``run.total_steps`` counts whole batches too, a
    DataLoader's ``drop_last`` as the argument, and a budget without one is refused."""
    import fdl

    ids = torch.arange(97)
    data = torch.utils.data.TensorDataset(ids.float().unsqueeze(1), ids)
    run = fdl.init(seed=3)
    wider = torch.utils.data.TensorDataset(torch.zeros(126, 1))  # 30 over each epoch
    assert run.total_steps(wider, batch_size=32, epochs=3) == 3 * 126 // 32 == 11
    assert run.total_steps(wider, batch_size=32, epochs=3, drop_last=True) == 3 * 96 // 32
    loader = torch.utils.data.DataLoader(wider, batch_size=32, drop_last=True)
    assert run.total_steps(loader, epochs=3) == 9  # a DataLoader's drop_last, as run.batches
    with pytest.raises(fdl.errors.UsageError, match="holds no whole batch of 32"):
        run.total_steps(data, batch_size=32, max_samples=31, drop_last=True)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []
    for features, index in run.batches(data, model=model, optimizer=optimizer, batch_size=32,
                                       epochs=4, drop_last=True):
        assert len(index) == 32
        seen.append(index)
        model(features).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert run.finish().summary["samples"] == 4 * 96
    epochs = [torch.cat(seen[e * 3:(e + 1) * 3]) for e in range(4)]
    left_out = [set(range(97)) - set(epoch.tolist()) for epoch in epochs]
    assert all(len(left) == 1 and len(epoch.unique()) == 96
               for left, epoch in zip(left_out, epochs, strict=True))
    assert len({min(left) for left in left_out}) > 1, left_out


def test_a_loop_s_own_state_is_checkpointed_and_back_on_resume(tmp_path):
    """The script's counter and the scheduler it handed to run.batches (a OneCycleLR of 48
    global steps: 3 epochs) go into the epoch-1 checkpoint, at its 16th step, and the resumed
    run takes both up there and ends the schedule at its 48th."""
    driven = ("--driven", "--sched-steps", "48")
    _, run_dir, first = loop_run(tmp_path, "--policy", "cadence", "--checkpoint-every", "1",
                                 "--epochs", "2", script_args=driven)
    checkpoint, _ = latest_checkpoint(run_dir)
    assert checkpoint is not None
    users = [torch.load(checkpoint.path / f"rank{r}.pt", weights_only=True)["user"]
             for r in (0, 1)]
    saved = [user["counter"]["steps"] for user in users]
    assert 0 < saved[0] < first[0]["steps"]  # the epoch-1 checkpoint, mid-run
    assert [user["fdl_lr_scheduler"]["last_epoch"] for user in users] == [16, 16]
    _, _, resumed = loop_run(tmp_path, "--resume", str(run_dir), "--epochs", "3",
                             script_args=driven, name="again")
    assert [r["resumed_steps"] for r in resumed] == saved
    assert resumed[0]["history"][-1]["epoch"] == 3
    schedule = one_cycle(48)
    for record in resumed:
        assert record["lrs"][0] == schedule[16] and record["scheduler_count"] == 48


def test_a_loop_that_never_steps_is_told_on_its_first_batch(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPTS / "loop_train.py"), str(tmp_path),
                           "--never-step"], capture_output=True, text=True, timeout=120,
                          env=clean_env(), cwd=tmp_path)
    assert proc.returncode != 0
    assert "the optimizer did not step after 1 batch(es)" in proc.stderr


def shard_files(folder: Path) -> int:
    """7 text shards of 96 to 192 sample ids (whole batches of 16); returns how many ids."""
    folder.mkdir()
    total = 0
    for shard in range(7):
        count = 96 + 16 * shard
        (folder / f"s{shard}.txt").write_text("".join(f"{shard * 1000 + i}\n"
                                                      for i in range(count)))
        total += count
    return total


def stream_run(tmp_path: Path, *flags: str, iterable: bool = False) -> tuple[Path, list[dict]]:
    out, run_dir = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    proc = run_fdl("run", "--nproc-per-node", "2", "--run-dir", str(run_dir), *flags,
                   str(SCRIPTS / "stream_train.py"), str(out), str(tmp_path / "shards"),
                   *(("--iterable",) if iterable else ()), cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir, [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_shards_are_each_read_by_one_rank_once_per_epoch_within_a_sample_budget(tmp_path):
    total = shard_files(tmp_path / "shards")
    _, ranks = stream_run(tmp_path, "--policy", "cadence", "--simulate-slowdown", "1,4",
                          "--max-samples", str(total))
    read = [[(epoch, i) for epoch, ids in rank["seen"] for i in ids] for rank in ranks]
    assert sum(map(len, read)) == total  # the budget, in samples
    everything = read[0] + read[1]
    assert len(set(everything)) == len(everything)  # no sample twice in one epoch
    owners: dict[tuple[int, int], set[int]] = {}
    for rank, samples in enumerate(read):
        for epoch, i in samples:
            owners.setdefault((epoch, i // 1000), set()).add(rank)
    assert all(len(ranks_of) == 1 for ranks_of in owners.values())  # a shard, one rank
    assert ranks[0]["summary"]["samples"] == total
    # run.progress at a step is the run's samples before it over the budget: the run's first
    # batch reads 0 and its last (16 samples), whichever rank took it, (total - 16) / total
    assert min(rank["progress"][0] for rank in ranks) == 0.0
    assert max(rank["progress"][-1] for rank in ranks) == pytest.approx((total - 16) / total)


@pytest.mark.parametrize(("budget", "value"), [("--max-steps", "12"), ("--max-time", "0.5s")])
def test_a_step_or_time_budget_ends_a_run_on_an_iterable_dataset(tmp_path, budget, value):
    (tmp_path / "shards").mkdir()
    run_dir, ranks = stream_run(tmp_path, "--policy", "async", budget, value, iterable=True)
    samples = ranks[0]["summary"]["samples"]
    if budget == "--max-steps":  # 12 global steps of 2 ranks x 16 samples
        assert samples == 12 * 2 * 16
        assert sum(r["steps"] for r in ranks) == 24
    else:  # the round after the clocks passed 0.5 s is the last: it ends on its own
        assert samples > 0
        budget = [e for e in read_events(run_dir, 0) if e["kind"] == "budget"]
        assert len(budget) == 1 and "max_time 0.5s reached" in budget[0]["reason"]
        assert budget[0]["elapsed_s"] >= 0.5
    assert ranks[0]["history"][-1]["epoch"] == 1
    same = [json.dumps(r["summary"]["checksum"]) for r in ranks]
    assert same[0] == same[1]


class Sentences(torch.utils.data.Dataset):
    """Variable-length samples: sample i is i % 7 + 1 tokens, all equal to i."""

    def __len__(self):
        return 96

    def __getitem__(self, i):
        return torch.full((i % 7 + 1,), i)


def pad(samples):
    """A collate_fn that pads to the batch's longest sample (dynamic padding)."""
    longest = max(len(s) for s in samples)
    return torch.stack([torch.nn.functional.pad(s, (0, longest - len(s)), value=-1)
                        for s in samples])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataloader_is_used_for_what_it_holds(workers):
    """Its dataset (96 samples, not its 6 batches), batch size, collate_fn and workers."""
    import fdl

    loader = torch.utils.data.DataLoader(Sentences(), batch_size=16, collate_fn=pad,
                                         num_workers=workers)
    run = fdl.init(seed=1)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []
    for batch in run.batches(loader, model=model, optimizer=optimizer, epochs=2):
        assert batch.shape[0] == 16
        lengths = (batch >= 0).sum(dim=1)
        assert int(lengths.max()) == batch.shape[1]  # padded to this batch's longest
        seen.extend(int(row[0]) for row in batch)
        model(lengths.float().unsqueeze(1)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    result = run.finish()
    assert sorted(seen) == sorted(list(range(96)) * 2)  # every sample once per epoch
    assert result.summary["samples"] == 192


def train_small(run: Any, data: Any) -> Any:
    """Two epochs of a small classifier on ``data`` in batches of 32, in this process; the
    run's result."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for features, labels in run.batches(data, model=model, optimizer=optimizer, batch_size=32,
                                        epochs=2):
        torch.nn.functional.cross_entropy(model(features), labels).backward()
        optimizer.step()
        optimizer.zero_grad()
    return run.finish()


def test_an_evaluation_every_n_steps_lands_within_epochs(tmp_path, monkeypatch):
    import fdl

    sys.path.insert(0, str(SCRIPTS))
    from common import evaluate, make_data

    monkeypatch.setenv("FDL_RUN_DIR", str(tmp_path / "run"))
    run = fdl.init(seed=1)
    run.evaluate(make_data(128, seed=2), evaluate, every=4)
    result = train_small(run, make_data(1024, seed=1))
    evaluations = [e for e in read_events(tmp_path / "run", 0) if e["kind"] == "eval"]
    assert len(evaluations) >= 2  # within the epochs, not only at their ends
    assert all(e["samples"] % 1024 for e in evaluations)  # none at an epoch's end
    assert all(set(e["eval"]) == {"accuracy", "loss"} for e in evaluations)
    assert [e["samples"] for e in evaluations] == sorted(e["samples"] for e in evaluations)
    assert result.metrics == result.history[-1]["eval"]


def test_a_named_second_set_is_evaluated_beside_the_first(tmp_path, monkeypatch):
    """nanoGPT evaluates its train and val splits: a second run.evaluate used to replace the
    first without a word. A named set is evaluated at the same points, its metrics recorded as
    name/metric; a second unnamed set, a name used twice, a name that is no identifier and an
    every of its own are refused."""
    import fdl
    from fdl.engine.evaluation import evaluate_model

    sys.path.insert(0, str(SCRIPTS))
    from common import evaluate, make_data

    monkeypatch.setenv("FDL_RUN_DIR", str(tmp_path / "run"))
    run = fdl.init(seed=1)
    val, train_sample = make_data(96, seed=2), make_data(64, seed=1)
    run.evaluate(val, evaluate, every=8)
    run.evaluate(train_sample, evaluate, name="train")
    for call, needle in [(lambda: run.evaluate(val, evaluate), "already called without a name"),
                         (lambda: run.evaluate(val, evaluate, name="train"), "named 'train'"),
                         (lambda: run.evaluate(val, evaluate, name="a b"), "takes a name"),
                         (lambda: run.evaluate(val, evaluate, name="test", every=4),
                          "each 8 steps here")]:
        with pytest.raises(fdl.errors.UsageError, match=needle):
            call()
    result = train_small(run, make_data(512, seed=1))
    names = {"accuracy", "loss", "train/accuracy", "train/loss"}
    assert [set(record["eval"]) for record in result.history] == [names, names]
    within = [e["eval"] for e in read_events(tmp_path / "run", 0) if e["kind"] == "eval"]
    assert within and all(set(e) == names for e in within)  # every 8 steps: both sets
    alone = {f"train/{k}": v for k, v in evaluate_model(
        result.model, train_sample, evaluate, batch_size=32, device=torch.device("cpu"),
        rank=0, world_size=1).items()}
    assert {k: result.metrics[k] for k in alone} == pytest.approx(alone)
    assert result.metrics["loss"] != result.metrics["train/loss"]


def test_an_evaluation_every_zero_steps_is_refused():
    import fdl

    run = fdl.init()
    with pytest.raises(fdl.errors.UsageError, match="every=N"):
        run.evaluate([], lambda model, batch: {}, every=0)


@pytest.mark.parametrize("empty", [[], torch.utils.data.DataLoader([], batch_size=4)],
                         ids=["list", "dataloader"])
def test_an_empty_evaluation_set_is_refused_when_it_is_given(empty):
    """It gave no metric and no word."""
    import fdl

    run = fdl.init()
    with pytest.raises(fdl.errors.UsageError, match=r"run\.evaluate's data holds no sample"):
        run.evaluate(empty, lambda model, batch: {"loss": 0.0})
    run.evaluate([(torch.zeros(2), 0)], lambda model, batch: {"loss": 0.0})  # one sample will do
    with pytest.raises(fdl.errors.UsageError, match=r"run\.evaluate's set 'train' holds no"):
        run.evaluate(empty, lambda model, batch: {"loss": 0.0}, name="train")


def test_a_second_run_batches_is_refused_with_what_to_do_instead(tmp_path, monkeypatch):
    """Two phases as two loops over run.batches: one clear error, saying how to have them."""
    import fdl

    monkeypatch.setenv("FDL_RUN_DIR", str(tmp_path / "run"))
    run = fdl.init()
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.zeros(4), 0)] * 16
    for features, labels in run.batches(data, model=model, optimizer=optimizer, batch_size=8,
                                        epochs=1):
        torch.nn.functional.cross_entropy(model(features), labels).backward()
        optimizer.step()
        optimizer.zero_grad()
    with pytest.raises(fdl.errors.UsageError, match="once per run") as refused:
        run.batches(data, model=model, optimizer=optimizer, batch_size=8, epochs=1)
    assert "run.progress" in refused.value.hint
    assert run.finish().summary["samples"] == 16  # the run itself is unharmed


@pytest.mark.parametrize("nested", [False, True], ids=["wrapped", "holding-a-wrapped-part"])
def test_a_model_wrapped_in_ddp_is_refused_before_any_step(tmp_path, monkeypatch, nested):
    """A torchrun script's leftover: DDP's all-reduce in each backward hangs cadence and
    async, whose ranks step unequally (a 2-worker cadence run of such a script sat silent
    until killed). One UsageError instead, naming the wrapper, before any batch."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import fdl

    monkeypatch.setenv("FDL_RUN_DIR", str(tmp_path / "run"))
    run = fdl.init()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        wrapped = DistributedDataParallel(torch.nn.Linear(4, 2))
        model = torch.nn.Sequential(wrapped, torch.nn.ReLU()) if nested else wrapped
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(fdl.errors.UsageError, match="wrapped in DistributedDataParallel"):
            run.batches([(torch.zeros(4), 0)] * 16, model=model, optimizer=optimizer,
                        batch_size=8, epochs=1)
    finally:
        dist.destroy_process_group()
    run.abandon()


def test_an_optimizer_stepping_a_parameter_outside_the_model_is_refused(tmp_path, monkeypatch):
    """A learnable temperature beside the model: fdl would average the model only, and a
    2-worker cadence run ended with a different temperature on each rank. Refused, alone as
    with workers (the script must not change between them), before any batch."""
    import fdl

    monkeypatch.setenv("FDL_RUN_DIR", str(tmp_path / "run"))
    run = fdl.init()
    model = torch.nn.Linear(4, 2)
    temperature = torch.nn.Parameter(torch.ones(()))
    optimizer = torch.optim.SGD([*model.parameters(), temperature], lr=0.1)
    with pytest.raises(fdl.errors.UsageError,
                       match=r"the optimizer steps 1 parameter\(s\) outside the model \(shape \[\]\)"
                       ) as refused:
        run.batches([(torch.zeros(4), 0)] * 16, model=model, optimizer=optimizer, batch_size=8,
                    epochs=1)
    assert "nn.ModuleDict" in refused.value.hint
    run.abandon()


@pytest.mark.parametrize(("which", "needle"), [
    ("model", "run.batches' model is NoneType, not a torch.nn.Module"),
    ("optimizer", "run.batches' optimizer is NoneType, not an optimizer"),
    ("both", "run.batches' model is SGD"),  # the two swapped
])
def test_a_model_or_optimizer_that_is_none_is_refused_in_one_line(tmp_path, monkeypatch, which,
                                                                  needle):
    """``run.batches(model=None)`` raised AttributeError inside fdl."""
    import fdl

    monkeypatch.setenv("FDL_RUN_DIR", str(tmp_path / "run"))
    run = fdl.init()
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    given = {"model": (None, optimizer), "optimizer": (model, None),
             "both": (optimizer, model)}[which]
    with pytest.raises(fdl.errors.UsageError, match=re.escape(needle)) as refused:
        run.batches([(torch.zeros(4), 0)] * 16, model=given[0], optimizer=given[1],
                    batch_size=8, epochs=1)
    assert "model=model, optimizer=optimizer" in refused.value.hint
    run.abandon()


@pytest.mark.parametrize("asks", [False, True], ids=["never-asks", "asks"])
def test_precision_and_micro_batches_a_loop_never_applied_are_not_recorded_as_applied(
        tmp_path, monkeypatch, capsys, asks):
    """A loop that never entered run.autocast() trained in fp32 and one that never asked
    run.micro_parts(batch) computed whole batches, while summary.json said bf16 and 4."""
    import fdl

    monkeypatch.setenv("FDL_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("FDL_PRECISION", "bf16")
    monkeypatch.setenv("FDL_MICRO_BATCH", "4")
    run = fdl.init(seed=1)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for features, labels in run.batches([(torch.ones(4), 0)] * 16, model=model,
                                        optimizer=optimizer, batch_size=8, epochs=1):
        parts = run.micro_parts((features, labels)) if asks else [((features, labels), 1.0)]
        for (x, y), weight in parts:
            with run.autocast() if asks else contextlib.nullcontext():
                loss = torch.nn.functional.cross_entropy(model(x), y) * weight
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    summary = run.finish().summary
    said = capsys.readouterr().err
    if asks:
        assert summary["precision"] == ["bf16"] and summary["micro_batch_size"] == [4]
        assert "never entered" not in said and "never asked" not in said
    else:
        assert summary["precision"] == ["fp32"] and summary["micro_batch_size"] == [8]
        assert "warning: --precision bf16: the script never entered run.autocast(), so " \
               "rank(s) 0 computed in fp32" in said
        assert "warning: --micro-batch 4: the script never asked run.micro_parts(batch), so " \
               "it computed whole batches of 8" in said


@pytest.mark.parametrize(("policy", "samples", "refused", "call"), [
    ("cadence", 512, "--policy cadence trains", "torch.distributed.all_reduce(loss"),
    ("cadence", 512, "--policy cadence trains", "all_reduce(loss"),
    ("sync", 512, None, "torch.distributed.all_reduce(loss"),
    ("sync", 528, "this round of --policy sync is cut unevenly (its ranks take 1, 0 steps",
     "torch.distributed.all_reduce(loss")],
    ids=["cadence", "cadence-by-name", "sync", "sync-uneven"])
def test_an_all_reduce_in_the_step_stops_a_run_whose_steps_cannot_pair_up(tmp_path, policy,
                                                                           samples, refused,
                                                                           call):
    """A torchrun script's all-reduce of its loss, left in the loop: under cadence the ranks'
    calls cannot pair up (a run of it sat silent until killed), so the first one is a usage
    error naming the script's line, also through a name the script imported before the run
    (``from torch.distributed import all_reduce``); under sync every rank steps alike and it
    trains, unless the epoch's batches do not split evenly (528 samples: 17 batches of 32),
    where a rank takes a step fewer in the last round and the run hung there."""
    out = tmp_path / "out"
    out.mkdir()
    proc = run_fdl("run", "--nproc-per-node", "2", "--policy", policy, "--simulate-slowdown",
                   "1,2.5", "--run-dir", str(tmp_path / "run"), str(SCRIPTS / "loop_train.py"),
                   str(out), "--samples", str(samples), "--epochs", "1",
                   "--all-reduce-loss" if call.startswith("torch.") else "--all-reduce-by-name",
                   cwd=tmp_path, timeout=240)
    shown = proc.stdout + proc.stderr
    if refused is None:
        assert proc.returncode == 0, shown[-3000:]
        assert json.loads((out / "rank1.json").read_text())["steps"] > 0
        return
    assert proc.returncode == 2, shown[-3000:]
    line = next(number for number, text in enumerate(
        (SCRIPTS / "loop_train.py").read_text().splitlines(), start=1)
        if text.strip().startswith(call))
    assert (f"torch.distributed.all_reduce called at {SCRIPTS / 'loop_train.py'}:{line} while "
            f"{refused}") in shown, shown[-3000:]
    assert not (out / "rank0.json").exists()


@pytest.mark.parametrize("policy", ["cadence", "sync"])
def test_a_scheduler_on_the_optimizer_is_warned_of_where_ranks_step_unequally(tmp_path, policy):
    """A torch LR scheduler stepped every batch runs at each rank's pace under cadence (a
    OneCycleLR sized by one rank's batches stopped the fast rank with "Tried to step 129
    times"): rank 0 says so once at the start; under sync the ranks step alike, and nothing is
    said."""
    out = tmp_path / "out"
    out.mkdir()
    proc = run_fdl("run", "--nproc-per-node", "2", "--policy", policy, "--run-dir",
                   str(tmp_path / "run"), str(SCRIPTS / "loop_train.py"), str(out),
                   "--samples", "256", "--epochs", "1", "--scheduler", cwd=tmp_path, timeout=240)
    shown = proc.stdout + proc.stderr
    assert proc.returncode == 0, shown[-3000:]
    warning = "warning: an LR scheduler was made on the optimizer: under --policy cadence"
    assert shown.count(warning) == (1 if policy == "cadence" else 0), shown[-3000:]
    assert ("LR scheduler" in shown) == (policy == "cadence"), shown[-3000:]


def one_cycle(total: int) -> list[float]:
    """The LR of each of the ``total`` steps of loop_train.py's OneCycleLR, stepped alone."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total)
    lrs = []
    for _ in range(total):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def in_order_within(lrs: list[float], schedule: list[float]) -> bool:
    """Whether ``lrs`` are values of ``schedule``, each at or after the last one's place."""
    place = 0
    for lr in lrs:
        while place < len(schedule) and schedule[place] != lr:
            place += 1
        if place == len(schedule):
            return False
    return True


@pytest.mark.parametrize("policy", ["cadence", "sync"])
def test_a_scheduler_handed_to_the_loop_counts_global_steps_on_every_rank(tmp_path, policy):
    """run.batches(scheduler=) with a OneCycleLR sized as a DDP script sizes it (32 steps of 2
    x 32 samples over 2 epochs of 1024): the engine steps it, so under cadence the fast rank's
    many steps and the slow rank's few each take the schedule's LR at the run's position, in
    order, and both end at its 32nd step; stepped per own step, the fast rank would pass 32 and
    OneCycleLR would stop it. Under sync every step is one: the schedule, step by step."""
    out, run_dir, seen = loop_run(tmp_path, "--policy", policy, "--simulate-slowdown", "1,2.5",
                                  script_args=("--driven",))
    schedule = one_cycle(32)
    for record in seen:
        assert record["scheduler_count"] == 32
        assert in_order_within(record["lrs"], schedule), record["lrs"]
    same_models(out)
    if policy == "sync":
        assert [record["lrs"] for record in seen] == [schedule, schedule]
    else:
        assert seen[0]["steps"] > 32 > seen[1]["steps"]
        # stepped within rounds, not only at their ends: the fast rank's steps take more LRs
        # than the run has rounds
        rounds = [e for e in read_events(run_dir, 0) if e["kind"] == "round"]
        assert len(set(seen[0]["lrs"])) > len(rounds) + 1, (seen[0]["lrs"], len(rounds))


@pytest.mark.parametrize("sized_by", ["total_steps", "the script's epochs"])
def test_total_steps_is_where_a_handed_scheduler_ends_under_fdl_run_s_overrides(
        tmp_path, monkeypatch, sized_by):
    """``run.total_steps`` applies fdl run's settings (FDL_EPOCHS=3, as ``fdl run --epochs 3``
    passes it) over the script's values, as run.batches does: a OneCycleLR sized with it ends
    the run at its last step; one sized by the script's own 2 epochs is refused at the step
    past its total, with one line saying what to size it with."""
    import fdl

    sys.path.insert(0, str(SCRIPTS))
    from common import make_data

    monkeypatch.setenv("FDL_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("FDL_EPOCHS", "3")
    data = make_data(1000, seed=1)
    run = fdl.init(seed=1)
    assert run.total_steps(data, batch_size=32, epochs=2) == 3 * 1000 // 32
    assert run.total_steps(data, batch_size=32, epochs=2, max_steps=10) == 10
    assert run.total_steps(data, batch_size=32, epochs=2, accumulate=2) == 3 * 1000 // 64
    shards = [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]  # streamed: only a budget counts
    assert run.total_steps(shards, batch_size=32, max_samples=200) == 200 // 32
    with pytest.raises(fdl.errors.UsageError, match="step or sample budget"):
        run.total_steps(shards, batch_size=32, epochs=2)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    total = run.total_steps(data, batch_size=32, epochs=2) if sized_by == "total_steps" \
        else 2 * 1000 // 32
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total)

    def train() -> None:
        for features, labels in run.batches(data, model=model, optimizer=optimizer,
                                            batch_size=32, epochs=2, scheduler=scheduler):
            torch.nn.functional.cross_entropy(model(features), labels).backward()
            optimizer.step()
            optimizer.zero_grad()
        run.finish()

    if sized_by == "total_steps":
        train()
        assert scheduler.last_epoch == 3 * 1000 // 32
    else:
        with pytest.raises(fdl.errors.UsageError, match=f"refused global step {total + 1}: "
                                                        "Tried to step") as refused:
            train()
        assert "run.total_steps" in refused.value.hint
        run.abandon()


def test_a_script_that_steps_the_scheduler_it_handed_over_is_told(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    proc = run_fdl("run", "--nproc-per-node", "2", "--policy", "cadence", "--run-dir",
                   str(tmp_path / "run"), str(SCRIPTS / "loop_train.py"), str(out),
                   "--samples", "256", "--epochs", "1", "--driven", "--also-step",
                   cwd=tmp_path, timeout=240)
    shown = proc.stdout + proc.stderr
    assert proc.returncode != 0, shown[-3000:]
    assert "scheduler.step() was called by the script" in shown, shown[-3000:]
    assert not (out / "rank0.json").exists()


@pytest.mark.parametrize("never_step", [False, True], ids=["finished", "failed"])
def test_a_worker_exits_cleanly_with_its_liveness_thread_ticking(tmp_path, never_step):
    """A daemon thread still inside a store call when the interpreter shuts down aborts the
    worker (SIGABRT, "terminate called without an active exception") after the run finished
    well: 1 run in 10 of fdl bench's quick cells with a tick every 2 s. Ticking every 0.5 ms,
    a tick is nearly always in flight at the exit: the run's end and a failing script's exit
    must stop the thread first."""
    out = tmp_path / "out"
    out.mkdir()
    proc = run_fdl("run", "--nproc-per-node", "2", "--policy", "cadence", "--run-dir",
                   str(tmp_path / "run"), str(SCRIPTS / "loop_train.py"), str(out),
                   "--samples", "256", "--epochs", "1", "--tick-every", "0.0005",
                   *(("--never-step",) if never_step else ()), cwd=tmp_path, timeout=240)
    shown = proc.stdout + proc.stderr
    assert "SIGABRT" not in shown and "terminate called" not in shown, shown[-3000:]
    if never_step:
        assert proc.returncode != 0 and "did not step" in shown, shown[-3000:]
    else:
        assert proc.returncode == 0, shown[-3000:]
