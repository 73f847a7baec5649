"""Sweep planning (pure): modes per host, the --quick plan, dataset choice, cell keys, the
fdl run command line of a cell, and which cells a resume skips."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from fdl.bench import sweep
from fdl.bench.models import MODELS
from fdl.bench.sweep import (
    Cell,
    cell_argv,
    cell_env,
    choose_dataset,
    parse_slowdown,
    plan_modes,
    plan_notes,
    plan_sweep,
    run_sweep,
    split_done,
)
from fdl.errors import FdlError, UsageError
from fdl.settings import SETTINGS

CPU_MODES = ["solo@1x", "solo@2.5x", "sync-cpu", "cadence-cpu", "async-cpu"]
MNIST_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
               "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")


def plan(tmp_path: Path, **overrides) -> list[Cell]:
    args = dict(models=[], modes=[], seeds=[0], epochs=None, quick=False, slowdown=(1.0, 2.5),
                gpus=0, data_dir=tmp_path, download=True)
    return plan_sweep(**{**args, **overrides})


def cache_mnist(data_dir: Path) -> None:
    folder = data_dir / "mnist"
    folder.mkdir(parents=True)
    for name in MNIST_FILES:
        (folder / name).write_bytes(b"")


# --- modes -------------------------------------------------------------------------------

def test_cpu_host_plans_one_solo_per_factor_and_cpu_policies_only():
    modes, notes = plan_modes(slowdown=(1.0, 2.5), gpus=0)
    assert [m.name for m in modes] == CPU_MODES
    solo_fast, solo_slow, *policies = modes
    assert (solo_fast.world_size, solo_fast.slowdown, solo_fast.backend) == (1, (1.0,), None)
    assert solo_slow.slowdown == (2.5,)
    assert all(m.world_size == 2 and m.slowdown == (1.0, 2.5) and m.backend == "cpu"
               for m in policies)
    assert any("nccl modes not planned" in note and "no GPU" in note for note in notes)


def test_the_cores_shared_out_are_those_the_affinity_gives(monkeypatch):
    """Under taskset or a cpuset the sweep's threads come from the cores it may use."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # the machine's, beyond the affinity
    assert {m.threads for m in plan_modes(slowdown=(1.0, 2.5), gpus=0)[0]} == {3}


def test_every_emulated_worker_gets_the_same_share_of_the_cores(monkeypatch):
    modes, notes = plan_modes(slowdown=(1.0, 2.5), gpus=0, cores=8)
    assert {m.threads for m in modes} == {4}  # solo too: it stands for one of the two devices
    assert any("4 CPU thread(s) per worker" in note for note in notes)
    assert plan_modes(slowdown=(1.0, 2.0, 3.0), gpus=0, cores=2)[0][0].threads == 1
    assert {m.threads for m in plan_modes(slowdown=(1.0, 2.5), gpus=2, cores=8)[0]} == {None}
    cell = Cell("mlp", "digits", "solo@1x", "solo", None, 0, 1, (1.0,), 1, None, 4)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("FDL_SLOWDOWN", "3,3")
    env = cell_env(cell)
    assert env["OMP_NUM_THREADS"] == "4" and "FDL_SLOWDOWN" not in env
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the user's own setting wins, for every cell
    assert cell_env(cell)["OMP_NUM_THREADS"] == "1"


def test_a_cell_inherits_no_run_setting_and_no_worker_identity(monkeypatch):
    """A user's FDL_CHECKPOINT_EVERY (once missed by a hand-written list), any other setting's
    variable, a resume flag or an enclosing torchrun's variables must not reach a cell; fdl's
    other variables (FDL_ALLOW_HTTP for a plain-http mirror) must."""
    cell = Cell("mlp", "digits", "solo@1x", "solo", None, 0, 1, (1.0,), 1)
    leaking = {spec.env: "1" for spec in SETTINGS} | {
        "FDL_CHECKPOINT_EVERY": "1", "FDL_RESUME": "1", "TORCHELASTIC_RESTART_COUNT": "1",
        "RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}
    for name, value in leaking.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("FDL_ALLOW_HTTP", "1")
    env = cell_env(cell)
    assert sorted(set(leaking) & set(env)) == []
    assert env["FDL_ALLOW_HTTP"] == "1"


def test_repeated_factors_give_one_solo_each_and_a_worker_each():
    modes, _ = plan_modes(slowdown=(1.0, 1.0, 3.0), gpus=0)
    assert [m.name for m in modes][:2] == ["solo@1x", "solo@3x"]
    assert modes[2].world_size == 3 and modes[2].slowdown == (1.0, 1.0, 3.0)


def test_one_gpu_is_not_enough_for_nccl():
    modes, notes = plan_modes(slowdown=(1.0, 2.5), gpus=1)
    assert [m.name for m in modes] == CPU_MODES
    assert any("1 GPU" in note for note in notes)


def test_two_gpus_run_real_devices_with_both_backends():
    modes, _ = plan_modes(slowdown=(1.0, 2.5), gpus=2)
    assert [m.name for m in modes] == [
        "solo@gpu0", "solo@gpu1", "sync-cpu", "cadence-cpu", "async-cpu",
        "sync-nccl", "cadence-nccl", "async-nccl"]
    assert all(m.slowdown is None for m in modes)
    assert modes[1].devices == (1,) and modes[-1].devices == (0, 1)


@pytest.mark.parametrize("text", ["1", "", "1,x", "1,0", "1,-2", "1,inf", "nan,1"])
def test_bad_slowdown_lists_are_usage_errors(text):
    with pytest.raises(UsageError, match="simulate-slowdown"):
        parse_slowdown(text)


def test_slowdown_list_parses():
    assert parse_slowdown("1,2.5") == (1.0, 2.5)


def test_unknown_or_unavailable_modes_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="solo@3x"):
        plan(tmp_path, modes=["solo@3x"])
    with pytest.raises(UsageError, match="nccl needs 2 or more GPUs"):
        plan(tmp_path, modes=["sync-nccl"])
    with pytest.raises(UsageError, match="unknown model"):
        plan(tmp_path, models=["vgg"])


# --- plans -------------------------------------------------------------------------------

def test_quick_plan(tmp_path):
    cache_mnist(tmp_path)  # cached MNIST is not used: --quick is the same on every machine
    cells = plan(tmp_path, quick=True)
    assert [(c.model, c.mode) for c in cells] == [
        (model, mode) for model in ("mlp", "lenet5") for mode in CPU_MODES]
    assert {c.dataset for c in cells} == {"synthetic"}
    assert {c.seed for c in cells} == {0}
    assert all(c.epochs == MODELS[c.model].quick_epochs for c in cells)
    assert {c.epochs for c in plan(tmp_path, quick=True, epochs=2)} == {2}


def test_modes_and_seeds_multiply_in_order(tmp_path):
    cells = plan(tmp_path, models=["logreg"], modes=["cadence-cpu", "solo@1x"], seeds=[0, 1],
                 epochs=2, dataset="synthetic")
    assert [(c.seed, c.mode) for c in cells] == [
        (0, "cadence-cpu"), (0, "solo@1x"), (1, "cadence-cpu"), (1, "solo@1x")]
    assert all(c.epochs == 2 and c.dataset == "synthetic" for c in cells)
    assert cells[1].policy == "solo" and cells[1].backend is None and not cells[1].emulated
    assert cells[0].emulated


def test_default_plan_covers_every_model_and_mode(tmp_path):
    cells = plan(tmp_path)
    assert {c.model for c in cells} == set(MODELS)
    assert len(cells) == len(MODELS) * len(CPU_MODES)
    assert all(c.epochs == MODELS[c.model].epochs for c in cells)


def test_keys_are_unique_file_names_that_encode_what_changes_a_result(tmp_path):
    cells = plan(tmp_path, seeds=[0, 1])
    keys = [c.key for c in cells]
    assert len(set(keys)) == len(keys)
    assert all(re.fullmatch(r"[A-Za-z0-9@._-]+", key) for key in keys)
    base = Cell("mlp", "digits", "sync-cpu", "sync", "cpu", 0, 2, (1.0, 2.5), 3)
    variants = [Cell("mlp", "digits", "sync-cpu", "sync", "cpu", 0, 2, (1.0, 3.0), 3),
                Cell("mlp", "digits", "sync-cpu", "sync", "cpu", 1, 2, (1.0, 2.5), 3),
                Cell("mlp", "digits", "sync-cpu", "sync", "cpu", 0, 2, (1.0, 2.5), 4),
                Cell("mlp", "synthetic", "sync-cpu", "sync", "cpu", 0, 2, (1.0, 2.5), 3)]
    assert all(v.key != base.key for v in variants)


# --- datasets ----------------------------------------------------------------------------

def test_dataset_choice_prefers_the_first_usable(tmp_path):
    mlp = MODELS["mlp"]
    assert choose_dataset(mlp, data_dir=tmp_path, download=True).dataset == "mnist"
    offline = choose_dataset(mlp, data_dir=tmp_path, download=False)
    assert offline.dataset == "digits"
    assert "mnist: downloadable, but downloads are off" in offline.reason
    cache_mnist(tmp_path)
    cached = choose_dataset(mlp, data_dir=tmp_path, download=False)
    assert (cached.dataset, cached.status) == ("mnist", "cached")


def test_unavailable_datasets_fall_back(tmp_path, monkeypatch):
    """MNIST not cached with downloads off, and scikit-learn (the digits) not installed, as
    Python sees a package that is not: its import fails."""
    monkeypatch.setitem(sys.modules, "sklearn", None)
    choice = choose_dataset(MODELS["lenet5"], data_dir=tmp_path, download=False)
    assert choice.dataset == "synthetic"
    assert "scikit-learn" in choice.reason


def test_forced_dataset_must_fit_the_model(tmp_path):
    with pytest.raises(UsageError, match="does not fit model 'char-rnn'"):
        plan(tmp_path, models=["char-rnn"], dataset="synthetic")


def test_all_models_leave_out_those_without_data_but_a_named_one_fails(tmp_path):
    cells = plan(tmp_path, download=False)
    assert {c.model for c in cells} == set(MODELS) - {"char-rnn", "gpt-nano"}
    notes = plan_notes(models=[], quick=False, slowdown=(1.0, 2.5), gpus=0, data_dir=tmp_path,
                       download=False)
    assert any(n.startswith("char-rnn: left out") and "shakespeare" in n for n in notes)
    with pytest.raises(FdlError, match="none of its datasets") as caught:
        plan(tmp_path, models=["char-rnn"], download=False)
    assert caught.value.exit_code == 1


# --- the command line of a cell -----------------------------------------------------------

def launcher_flags(args: list[str]) -> dict[str, str | bool]:
    flags: dict[str, str | bool] = {}
    while args:
        flag, *args = args
        if args and not args[0].startswith("--"):
            flags[flag], *args = args
        else:
            flags[flag] = True
    return flags


def test_cell_argv_passes_every_engine_setting_as_a_flag(tmp_path):
    cell = Cell("mlp", "digits", "async-cpu", "async", "cpu", 3, 2, (1.0, 2.5), 4)
    argv = cell_argv(cell, run_dir=tmp_path / "r", data_dir=tmp_path / "d")
    assert argv[1:4] == ["-m", "fdl", "run"]
    flags = launcher_flags(argv[4:argv.index("-m", 4)])
    assert flags.pop("--quiet-ranks") is True
    assert flags["--nproc-per-node"] == "2" and flags["--policy"] == "async"
    assert flags["--backend"] == "cpu" and flags["--simulate-slowdown"] == "1,2.5"
    assert flags["--epochs"] == "4" and flags["--seed"] == "3"
    assert flags["--batch-size"] == str(MODELS["mlp"].batch_size)
    assert flags["--run-dir"] == str(tmp_path / "r")
    assert argv[argv.index("fdl.bench.train_cell") + 1:] == [
        "--", "--model", "mlp", "--dataset", "digits", "--data-dir", str(tmp_path / "d")]


def test_gpu_cells_pick_their_devices_and_emulate_nothing(tmp_path):
    cell = Cell("mlp", "digits", "solo@gpu1", "solo", None, 0, 1, None, 1, (1,))
    argv = cell_argv(cell, run_dir=tmp_path, data_dir=tmp_path)
    assert argv[argv.index("--devices") + 1] == "1"
    assert "--simulate-slowdown" not in argv


# --- resume ------------------------------------------------------------------------------

def test_resume_skips_recorded_cells_and_ignores_a_torn_last_line(tmp_path):
    cells = plan(tmp_path, models=["logreg"], dataset="synthetic", epochs=1)
    out = tmp_path / "out"
    out.mkdir()
    lines = [json.dumps({"model": c.model, "mode": c.mode, "run_dir": f"runs/{c.key}"})
             for c in cells[:2]]
    torn = json.dumps({"model": "logreg", "run_dir": f"runs/{cells[2].key}"})[:-10]
    (out / "results.jsonl").write_text("\n".join([*lines, torn]))
    todo, done = split_done(cells, out_dir=out)
    assert done == cells[:2]
    assert todo == cells[2:]


def test_a_fully_recorded_sweep_runs_nothing(tmp_path):
    cells = plan(tmp_path, models=["logreg"], dataset="synthetic", epochs=1)
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.jsonl").write_text(
        "".join(json.dumps({"run_dir": f"runs/{c.key}"}) + "\n" for c in cells))
    outcome = run_sweep(cells, out_dir=out, data_dir=tmp_path, args={"x": 1}, machine={},
                        on_cell=lambda index, cell: pytest.fail(f"{cell.key} started"))
    assert (outcome.results, outcome.failures, outcome.skipped) == ([], [], cells)
    assert not (out / "runs").exists()
    sweep_json = json.loads((out / "sweep.json").read_text())
    assert sweep_json["args"] == {"x": 1}
    assert sweep_json["sessions"][-1]["skipped"] == len(cells)


def test_a_cell_directory_that_is_not_a_run_is_kept_and_nothing_starts(tmp_path):
    """The cell's run directory is removed only when it holds an earlier attempt of a run
    (fdl.launch.child.run_from_scratch): a user's files there stop the sweep instead."""
    cell = plan(tmp_path, models=["logreg"], dataset="synthetic", epochs=1)[0]
    out = tmp_path / "out"
    run_dir = out / "runs" / cell.key
    run_dir.mkdir(parents=True)
    (run_dir / "notes.txt").write_text("mine\n")
    with pytest.raises(UsageError, match="is not empty and holds no fdl run") as caught:
        sweep.run_cell(cell, out_dir=out, data_dir=tmp_path)
    assert caught.value.hint == "move what is there away, or pass another --out"
    assert (run_dir / "notes.txt").read_text() == "mine\n"
    assert sorted(p.name for p in (out / "runs").iterdir()) == [cell.key]  # no log: no child
    assert not (out / "failures.jsonl").exists()
