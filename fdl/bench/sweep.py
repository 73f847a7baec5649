"""The ``fdl bench`` sweep: which cells to train (pure planning) and a thin executor that trains
each one under ``fdl run`` and records it.

A **cell** is one model on one dataset in one **mode** with one seed. Modes:

* ``solo@<f>x``: one worker slowed down f times (``--simulate-slowdown f``), one per distinct
  factor of the slowdown list — the solo baselines whose throughputs add up to the ideal;
  on a host with two or more GPUs, ``solo@gpu<i>``: one worker on GPU i (real speeds, nothing
  emulated).
* ``<policy>-<backend>``: one worker per slowdown factor (or per GPU) with El Che's ``sync``,
  ``cadence`` or ``async`` policy; backend ``cpu`` always, ``nccl`` only with two or more GPUs.

Every cell runs ``python -m fdl run ... -m fdl.bench.train_cell`` in its own run directory
``<out>/runs/<key>`` (output in ``<out>/runs/<key>.log``). A finished cell appends one line to
``<out>/results.jsonl`` (flushed and fsynced: a killed sweep loses at most the cell it was
running); a failed one appends its exit code and log tail to ``<out>/failures.jsonl`` and the
sweep goes on. Rerunning the same sweep skips every cell whose key is in results.jsonl.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fdl.bench.cells import Cell, Mode, format_factor
from fdl.bench.datasets import dataset_status
from fdl.bench.models import MODELS, BenchModel, get_model
from fdl.bench.results import (
    append_record,
    build_record,
    done_keys,
    failure_record,
    write_sweep_json,
)
from fdl.errors import FdlError, UsageError
from fdl.launch.child import check_out, run_from_scratch
from fdl.launch.devices import usable_cores
from fdl.ranges import WORKERS_PER_NODE
from fdl.rundir.summary import diverged_loss, has_summary
from fdl.settings import BY_NAME as SETTINGS_BY_NAME
from fdl.settings import POLICIES, as_flags, parse_from, without_run_settings
from fdl.system.facts import machine_facts

__all__ = ["Cell", "Mode"]  # re-exported: callers plan cells here
QUICK_MODELS = ("mlp", "lenet5")
OFFLINE = ("cached", "bundled", "generated")
# --quick trains on the generated dataset: the same data on every machine, whatever its cache
# holds, with no network, and epochs long enough (16384 samples) to show the steady state.
QUICK_DATASET = "synthetic"


@dataclass(frozen=True)
class DatasetChoice:
    model: str
    dataset: str
    status: str
    reason: str


def parse_slowdown(text: str) -> tuple[float, ...]:
    """``"1,2.5"`` -> ``(1.0, 2.5)``: the settings' factor list (fdl.settings.parse_slowdown),
    with two or more factors: a sweep compares El Che across two or more workers."""
    factors = parse_from(SETTINGS_BY_NAME["simulate_slowdown"], text, origin="--simulate-slowdown")
    if not 2 <= len(factors) <= WORKERS_PER_NODE.high:  # one worker per factor, on this host
        raise UsageError(f"--simulate-slowdown has {len(factors)} factor(s); a sweep needs from 2 "
                         f"to {WORKERS_PER_NODE.high}, one per worker",
                         hint="one factor per worker, e.g. 1,2.5")
    return factors


def plan_modes(*, slowdown: Sequence[float], gpus: int,
               cores: int | None = None) -> tuple[list[Mode], list[str]]:
    """Every mode this host can run, and notes on what was left out and why.

    Emulating, every worker of every mode — solo included — gets the same share of the
    ``cores`` (default: this host's): a solo run stands for one of the emulated devices, so it
    must not get the whole machine that the multi-worker runs split between their workers."""
    if gpus >= 2:
        devices = tuple(range(gpus))
        modes = [Mode(f"solo@gpu{i}", "solo", None, 1, None, (i,)) for i in devices]
        modes += [Mode(f"{p}-{b}", p, b, gpus, None, devices)
                  for b in ("cpu", "nccl") for p in POLICIES]
        return modes, [f"{gpus} GPUs: real speeds, no emulated slowdown"]
    factors = tuple(float(f) for f in slowdown)
    threads = max(1, (cores or usable_cores()) // len(factors))
    distinct = list(dict.fromkeys(factors))
    modes = [Mode(f"solo@{format_factor(f)}x", "solo", None, 1, (f,), None, threads) for f in distinct]
    modes += [Mode(f"{p}-cpu", p, "cpu", len(factors), factors, None, threads) for p in POLICIES]
    found = "no GPU" if gpus == 0 else "1 GPU"
    return modes, [f"nccl modes not planned: they need 2 or more GPUs and this host has {found}",
                   f"slowdown emulated with factors {','.join(format_factor(f) for f in factors)}, "
                   f"{threads} CPU thread(s) per worker in every mode"]


def choose_dataset(model: BenchModel, *, data_dir: Path, download: bool,
                   only: str | None = None) -> DatasetChoice:
    """The first of ``model.datasets`` (or just ``only``) that can be used now: on disk,
    bundled or generated, or downloadable when ``download``."""
    if only is not None and only not in model.datasets:
        raise UsageError(f"--dataset {only!r} does not fit model {model.name!r}; it trains on: "
                         f"{', '.join(model.datasets)}")
    usable = OFFLINE
    passed: list[str] = []
    for name in (only,) if only else model.datasets:
        status = dataset_status(name, data_dir=data_dir)
        if status in usable or (download and usable is OFFLINE and status == "downloadable"):
            why = f"{name} is {status}" + (f" ({'; '.join(passed)})" if passed else "")
            return DatasetChoice(model.name, name, status, why)
        if status == "downloadable":
            status += ", but downloads are off"
        passed.append(f"{name}: {status}")
    raise FdlError(f"model {model.name!r}: none of its datasets can be used "
                   f"({'; '.join(passed)})",
                   hint="allow downloads (drop --no-download) or see docs/bench.md")


def plan_sweep(*, models: Sequence[str], modes: Sequence[str], seeds: Sequence[int],
               epochs: int | None, quick: bool, slowdown: Sequence[float], gpus: int,
               data_dir: Path, download: bool = True, dataset: str | None = None,
               cores: int | None = None) -> list[Cell]:
    """The cells to run, model by model, seed by seed, mode by mode. Empty ``models``/``modes``
    mean all (``--quick``: mlp and lenet5); of all models, those without a usable dataset are
    left out (plan_notes says so), a named one is an error. ``--quick`` trains on
    QUICK_DATASET for the model's ``quick_epochs``; ``dataset``
    forces one dataset for every model. Raises UsageError for an unknown model or mode, or a
    dataset a model cannot use."""
    available, _ = plan_modes(slowdown=slowdown, gpus=gpus, cores=cores)
    picked = select_modes(available, modes)
    cells = []
    for model, choice in _datasets(models, quick=quick, data_dir=data_dir, download=download,
                                   dataset=dataset):
        if isinstance(choice, str):
            continue
        num_epochs = epochs or (model.quick_epochs if quick else model.epochs)
        for seed in seeds:
            cells += [Cell(model.name, choice.dataset, m.name, m.policy, m.backend, seed,
                           m.world_size, m.slowdown, num_epochs, m.devices, m.threads)
                      for m in picked]
    return cells


def plan_notes(*, models: Sequence[str], quick: bool, slowdown: Sequence[float], gpus: int,
               data_dir: Path, download: bool = True, dataset: str | None = None,
               cores: int | None = None) -> list[str]:
    """What plan_sweep decided and why: the modes left out, each model's dataset."""
    _, notes = plan_modes(slowdown=slowdown, gpus=gpus, cores=cores)
    for model, choice in _datasets(models, quick=quick, data_dir=data_dir, download=download,
                                   dataset=dataset):
        notes.append(f"{model.name}: left out, {choice}" if isinstance(choice, str)
                     else f"{model.name}: dataset {choice.reason}")
    return notes


def _datasets(models: Sequence[str], *, quick: bool, data_dir: Path, download: bool,
              dataset: str | None) -> list[tuple[BenchModel, DatasetChoice | str]]:
    """Each model with its dataset, or (all models only) why it has none."""
    pairs: list[tuple[BenchModel, DatasetChoice | str]] = []
    for name in models or (QUICK_MODELS if quick else MODELS):
        model = get_model(name)
        if not models and dataset is not None and dataset not in model.datasets:
            pairs.append((model, f"it does not train on {dataset}"))
            continue
        try:
            only = dataset if dataset is not None else \
                QUICK_DATASET if quick and QUICK_DATASET in model.datasets else None
            choice: DatasetChoice | str = choose_dataset(
                model, data_dir=data_dir, download=download, only=only)
        except UsageError:
            raise
        except FdlError as exc:
            if models:
                raise
            choice = exc.message
        pairs.append((model, choice))
    return pairs


def select_modes(available: Sequence[Mode], names: Sequence[str]) -> list[Mode]:
    by_name = {mode.name: mode for mode in available}
    for name in names:
        if name not in by_name:
            why = " (nccl needs 2 or more GPUs)" if name.endswith("-nccl") else ""
            raise UsageError(f"unknown mode {name!r}{why}; available here: {', '.join(by_name)}",
                             hint="solo@<f>x takes f from --simulate-slowdown")
    return [by_name[name] for name in dict.fromkeys(names)] if names else list(available)


def split_done(cells: Sequence[Cell], *, out_dir: Path) -> tuple[list[Cell], list[Cell]]:
    """(cells still to run, cells already in results.jsonl)."""
    done = done_keys(out_dir)
    return [c for c in cells if c.key not in done], [c for c in cells if c.key in done]


# --- execution ---------------------------------------------------------------------------


class CellFailed(FdlError):
    def __init__(self, cell: Cell, exit_code: int, log: Path):
        super().__init__(f"cell {cell.key} failed with exit code {exit_code}",
                         hint=f"its log: {log}")
        self.cell, self.returncode, self.log = cell, exit_code, log


@dataclass(frozen=True)
class SweepOutcome:
    results: list[dict[str, Any]]
    failures: list[CellFailed]
    skipped: list[Cell]


def prepare_datasets(cells: Iterable[Cell], *, data_dir: Path, download: bool,
                     progress: Any = None) -> None:
    """Download (when allowed) and verify every dataset the cells use, once, before any cell."""
    from fdl.bench.datasets import load_dataset

    for name in dict.fromkeys(cell.dataset for cell in cells):
        load_dataset(name, data_dir=data_dir, download=download, progress=progress)


def run_sweep(cells: Sequence[Cell], *, out_dir: Path, data_dir: Path, args: dict[str, Any],
              on_cell: Callable[[int, Cell], None] | None = None,
              machine: dict[str, Any] | None = None) -> SweepOutcome:
    """Run the cells not yet in results.jsonl, in order; ``on_cell(i, cell)`` before each."""
    out_dir.mkdir(parents=True, exist_ok=True)
    todo, skipped = split_done(cells, out_dir=out_dir)
    check_no_links(todo, out_dir=out_dir)
    write_sweep_json(out_dir, machine=machine_facts() if machine is None else machine, args=args,
                     num_cells=len(cells), num_skipped=len(skipped))
    results, failures = [], []
    for index, cell in enumerate(todo):
        if on_cell is not None:
            on_cell(index, cell)
        try:
            results.append(run_cell(cell, out_dir=out_dir, data_dir=data_dir))
        except CellFailed as failure:
            failures.append(failure)
    return SweepOutcome(results, failures, skipped)


def run_cell(cell: Cell, *, out_dir: Path, data_dir: Path | None = None) -> dict[str, Any]:
    """Train one cell under ``fdl run`` (from scratch: :func:`fdl.launch.child.run_from_scratch`);
    append its record to results.jsonl and return it. Raises CellFailed (after appending to
    failures.jsonl) if the run fails, and UsageError, starting nothing, if its run directory
    holds something other than an earlier attempt of a run."""
    from fdl.bench.datasets import default_data_dir

    out_dir = out_dir.resolve()
    run_dir, log = cell_paths(cell, out_dir=out_dir)  # one left by an interruption: anew
    argv = cell_argv(cell, run_dir=run_dir, data_dir=(data_dir or default_data_dir()).resolve())
    started = time.time()
    # cwd=out_dir: a fdl.toml in the user's directory must not change the benchmark.
    code = run_from_scratch(argv, run_dir=run_dir, log=log, cwd=out_dir, env=cell_env(cell))
    if has_summary(run_dir) and (code == 0 or diverged_loss(run_dir) is not None):
        record = build_record(cell, run_dir=run_dir, out_dir=out_dir)
        append_record(out_dir / "results.jsonl", record)
        return record
    failure = CellFailed(cell, code or 1, log)
    append_record(out_dir / "failures.jsonl", failure_record(
        cell, exit_code=code, started=started, log=log, out_dir=out_dir))
    raise failure


def cell_paths(cell: Cell, *, out_dir: Path) -> tuple[Path, Path]:
    """A cell's run directory and log: ``<out>/runs/<key>`` and ``<out>/runs/<key>.log``."""
    return out_dir / "runs" / cell.key, out_dir / "runs" / f"{cell.key}.log"


def check_no_links(cells: Iterable[Cell], *, out_dir: Path) -> None:
    """A UsageError, before anything is written, when ``<out>/runs`` or a cell's run directory
    or log is a symbolic link: a cell's directory is removed and its log rewritten, and neither
    may reach through a link to what it points at."""
    out = out_dir.resolve()
    check_out(out, command="fdl bench", paths=[
        out / "runs", *(path for cell in cells for path in cell_paths(cell, out_dir=out))])


def cell_argv(cell: Cell, *, run_dir: Path, data_dir: Path) -> list[str]:
    """The ``fdl run`` command line of a cell (every setting the cell depends on given as a flag;
    :func:`cell_env` drops the rest)."""
    model = get_model(cell.model)
    argv = [sys.executable, "-m", "fdl", "run", *as_flags({
        "nproc_per_node": cell.world_size,
        "policy": "cadence" if cell.policy == "solo" else cell.policy,
        "backend": cell.backend or "auto", "epochs": cell.epochs, "seed": cell.seed,
        "batch_size": model.batch_size, "run_dir": str(run_dir),
        "simulate_slowdown": cell.slowdown}), "--quiet-ranks"]
    if cell.devices is not None:
        argv += ["--devices", ",".join(str(i) for i in cell.devices)]
    return [*argv, "-m", "fdl.bench.train_cell", "--", "--model", cell.model,
            "--dataset", cell.dataset, "--data-dir", str(data_dir)]


def cell_env(cell: Cell) -> dict[str, str]:
    """This environment without any run setting (a user's FDL_SLOWDOWN or FDL_CHECKPOINT_EVERY
    must not leak into a cell), plus the cell's thread count (a user's own OMP_NUM_THREADS wins:
    it is the same for every cell)."""
    env = without_run_settings(os.environ)
    if cell.threads is not None and not env.get("OMP_NUM_THREADS"):
        env["OMP_NUM_THREADS"] = str(cell.threads)
    return env


def cell_to_json(cell: Cell) -> dict[str, Any]:
    """A cell as JSON (``--dry-run --json``): its key and fields."""
    return {"key": cell.key, **asdict(cell)}
