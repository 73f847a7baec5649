"""Micro-batches (fdl.engine.micro_batches, fdl.Trainer's micro_batch_size, fdl run
--micro-batch): the parts of a batch, the setting, an exact step in parts (solo in-process,
and under sync on two real gloo workers against plain torch DDP), and ``auto``'s halving on
CUDA's out-of-memory error, raised here by the step itself: the CUDA boundary this CPU host
cannot have (the error is torch's own class)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import clean_env, run_fdl
from torch import nn
from torch.utils.data import TensorDataset

import fdl
import fdl.engine.micro_batches as micro_module
from fdl.engine.micro_batches import MicroBatches, micro_for_rank
from fdl.errors import UsageError
from fdl.ranges import MAX_MICRO_BATCH
from fdl.settings import parse_micro_batch

SCRIPTS = Path(__file__).parent / "scripts"
CPU, CUDA = torch.device("cpu"), torch.device("cuda")
Pair = namedtuple("Pair", "x y")


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    names: list
    tag: str = "t"


@pytest.mark.parametrize(("text", "value"), [
    ("16", (16,)), ("16,64", (16, 64)), ("auto", ("auto",)), ("auto,8", ("auto", 8)),
    (" 4 , AUTO ", (4, "auto")), ([2, 3], (2, 3)), (16, (16,)), ("off", None), (None, None),
])
def test_the_setting_reads_sizes_and_auto(text, value):
    assert parse_micro_batch(text) == value


@pytest.mark.parametrize("text", ["0", "-4", "1.5", "x", "", ",", "16,", [True], [1.5],
                                  str(MAX_MICRO_BATCH + 1), True, 0])
def test_a_bad_setting_is_one_usage_error(text):
    with pytest.raises(UsageError, match="micro_batch_size must be auto or a whole number"):
        parse_micro_batch(text)


def test_one_choice_is_every_ranks_a_list_is_one_per_rank():
    assert micro_for_rank(None, 1, 2) is None
    assert micro_for_rank((16,), 1, 2) == 16
    assert micro_for_rank((16, "auto"), 1, 2) == "auto"
    with pytest.raises(UsageError, match=r"has 3 values \(1,2,3\) for 2 worker"):
        micro_for_rank((1, 2, 3), 0, 2)


@pytest.mark.parametrize("batch", [
    torch.arange(10.0),
    (torch.arange(10.0), torch.arange(10) % 3),
    Pair(torch.arange(10.0).reshape(10, 1), torch.arange(10)),
    {"x": torch.arange(20.0).reshape(10, 2), "ids": [f"s{i}" for i in range(10)], "n": 3},
    Batch(torch.arange(10.0), [f"s{i}" for i in range(10)]),
])
def test_parts_cover_the_batch_in_order_with_their_shares(batch):
    parts = MicroBatches(4).parts(batch)
    assert [weight for _, weight in parts] == pytest.approx([0.4, 0.4, 0.2])
    assert all(type(part) is type(batch) for part, _ in parts)
    for index, leaf in enumerate(_leaves(batch)):  # each leaf's parts put back together
        pieces = [_leaves(part)[index] for part, _ in parts]
        if isinstance(leaf, torch.Tensor):
            assert [len(p) for p in pieces] == [4, 4, 2]
            assert torch.equal(torch.cat(pieces), leaf)
        elif isinstance(leaf, list):  # one item per sample: cut, not copied
            assert [len(p) for p in pieces] == [4, 4, 2] and [x for p in pieces for x in p] == leaf
        else:  # not per sample: every part keeps it
            assert all(p == leaf for p in pieces)


def _leaves(batch):
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return list(batch.values())
    if dataclasses.is_dataclass(batch):
        return [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    return list(batch)


def test_a_batch_that_fits_is_one_part_and_lists_of_names_are_cut_per_sample():
    batch = {"x": torch.zeros(6, 2), "ids": list("abcdef")}
    assert MicroBatches(None).parts(batch) == [(batch, 1.0)]
    assert MicroBatches(8).parts(batch)[0][1] == 1.0
    assert [p["ids"] for p, _ in MicroBatches(4).parts(batch)] == [list("abcd"), list("ef")]


def test_auto_halves_on_cuda_only_and_down_to_one():
    assert MicroBatches.of("auto", CPU) == MicroBatches(None)  # the CPU: the batch
    micro = MicroBatches.of("auto", CUDA)
    assert micro.shrink(64) and micro.size == 32
    assert micro.shrink(64) and micro.size == 16
    tiny = MicroBatches(1, auto=True)
    assert not tiny.shrink(64)
    assert not MicroBatches(16).shrink(64)  # a size the user chose is not changed


# --- the Trainer, solo in-process -------------------------------------------------------------


@pytest.fixture
def solo(monkeypatch, tmp_path):
    monkeypatch.setenv("FDL_RUN_DIR", str(tmp_path / "run"))


def _data():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, generator=generator)
    return TensorDataset(x, (x.sum(dim=1) > 0).long())


def _fit(*, micro=None, step=None):
    def train_step(model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    return fdl.Trainer(model=lambda: nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)),
                       optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
                       train_step=step or train_step, train_data=_data(), batch_size=64,
                       epochs=2, seed=5, micro_batch_size=micro).fit()


def _same(a, b, atol):
    for name, tensor in a.model.state_dict().items():
        assert torch.allclose(tensor, b.model.state_dict()[name], atol=atol, rtol=0), name


def test_a_step_in_micro_batches_is_the_batchs_step(solo):
    whole, parts = _fit(), _fit(micro=16)
    _same(whole, parts, atol=1e-5)
    assert whole.summary["micro_batch_size"] == [64] and parts.summary["micro_batch_size"] == [16]
    assert parts.summary["peak_memory_bytes"] == [None]  # no CUDA here
    assert parts.history[-1]["train_loss"] == pytest.approx(whole.history[-1]["train_loss"],
                                                            rel=1e-5)


def test_auto_halves_after_an_out_of_memory_error_until_a_step_fits(solo, monkeypatch):
    """As on a GPU: the step runs out of memory above 16 samples; auto retries the step in
    32 and then 16 and trains on, to the same model as batches of 64 at once."""
    monkeypatch.setattr(micro_module.MicroBatches, "of",
                        classmethod(lambda cls, choice, device: cls(None, auto=True)))
    sizes = []

    def hungry_step(model, batch):
        x, y = batch
        sizes.append(len(x))
        if len(x) > 16:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (mocked at the boundary)")
        return F.cross_entropy(model(x), y)

    fitted = _fit(micro="auto", step=hungry_step)
    assert sizes[:7] == [64, 32, 16, 16, 16, 16, 16]  # the first step: 64, 32, then 4 x 16
    assert set(sizes[7:]) == {16}
    assert fitted.summary["micro_batch_size"] == [16]
    monkeypatch.undo()
    _same(_fit(), fitted, atol=1e-5)


def test_without_auto_an_out_of_memory_error_stops_the_run(solo):
    def hungry_step(model, batch):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (mocked at the boundary)")

    with pytest.raises(torch.cuda.OutOfMemoryError):
        _fit(micro=16, step=hungry_step)


# --- two real workers under sync, against plain torch DDP --------------------------------------


def test_sync_in_micro_batches_equals_plain_ddp(tmp_path):
    """Rank 0 computes its batches of 32 in 4 parts of 8, rank 1 at once: the model is plain
    DDP's on batches of 32 (within 1e-4), as test_elche_runs checks it without parts."""
    out, run_dir = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    proc = run_fdl("run", "--nproc-per-node", "2", "--run-dir", str(run_dir), "--policy", "sync",
                   "--micro-batch", "8,32", str(SCRIPTS / "elche_train.py"), str(out),
                   cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ref = tmp_path / "ref"
    ref.mkdir()
    torchrun = Path(sys.executable).parent / "torchrun"
    done = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2",
                           str(SCRIPTS / "ddp_reference.py"), str(ref)], capture_output=True,
                          text=True, timeout=240, env=clean_env(), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    ours, theirs = torch.load(out / "rank0.pt"), torch.load(ref / "rank0.pt")
    for name in ours:
        assert torch.allclose(ours[name], theirs[name], atol=1e-4, rtol=0), name
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["micro_batch_size"] == [8, 32]
    config = json.loads((run_dir / "config.json").read_text())["engine"]
    assert config["micro_batch_size"] == {"value": [8, 32], "source": "flag"}


def test_fdl_run_refuses_a_list_of_the_wrong_length_before_any_worker(tmp_path):
    proc = run_fdl("run", "--nproc-per-node", "2", "--micro-batch", "8,16,32", "--dry-run",
                   str(SCRIPTS / "elche_train.py"), str(tmp_path), cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert "--micro-batch has 3 values for 2 worker(s)" in proc.stderr


@pytest.mark.parametrize("policy", ["cadence", "sync"])
def test_a_loop_takes_its_parts_from_run_micro_parts(tmp_path, policy):
    """Each rank computes its batches in its own parts; under sync the gradients are reduced
    with the last part's backward, so the model is the one a run without parts trains."""
    runs = {}
    for name, micro in (("parts", ["--micro-batch", "8,32"]), ("whole", [])):
        out = tmp_path / name
        out.mkdir()
        proc = run_fdl("run", "--nproc-per-node", "2", "--run-dir", str(tmp_path / f"run-{name}"),
                       "--policy", policy, *micro, str(SCRIPTS / "micro_loop.py"), str(out),
                       cwd=tmp_path, timeout=240)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs[name] = out
        if policy == "cadence":  # its rounds depend on timing: the parts are what it checks
            break
    out = runs["parts"]
    assert [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)] == \
        [[8, 8, 8, 8], [32]]
    if policy == "sync":
        ours, whole = torch.load(out / "rank0.pt"), torch.load(runs["whole"] / "rank0.pt")
        for name in ours:
            assert torch.allclose(ours[name], whole[name], atol=1e-5, rtol=0), name
