"""``fdl bench``: train a zoo of small models in every mode and compare them.

    fdl bench --quick                          # mlp + lenet5 on generated data, a few minutes
    fdl bench --model lenet5 --seeds 3         # one model, every mode, three seeds
    fdl bench --mode solo@1x --mode async-cpu  # just these modes
    fdl bench --dry-run [--json]               # the plan: cells, datasets, what was left out
    fdl bench report [DIR]                     # rebuild report.md/report.json/plots of DIR

Each cell (model x mode x seed) runs under ``fdl run`` in ``DIR/runs/<key>`` and appends one
line to ``DIR/results.jsonl``; a rerun of the same command skips the cells already there, so an
interrupted sweep resumes where it stopped. At the end ``DIR/report.md`` and ``report.json``
are written (default DIR: runs/bench). Exit codes: 0 every cell finished, 1 some cell failed
(see ``DIR/failures.jsonl``), 2 bad input (nothing started), 130 interrupted. docs/bench.md
has the modes, datasets and the meaning of every figure.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from fdl.errors import FdlError, UsageError
from fdl.ranges import EPOCHS, NUM_SEEDS

if TYPE_CHECKING:
    from fdl.bench.sweep import Cell

DEFAULT_OUT = Path("runs/bench")

bench_app = typer.Typer(
    help="Benchmark El Che's modes on a zoo of small models (see docs/bench.md).",
    rich_markup_mode=None,  # plain help, as for `fdl` itself: no markdown-it at start-up
    context_settings={"help_option_names": ["-h", "--help"]},
)


@bench_app.callback(invoke_without_command=True)
def bench(
    ctx: typer.Context,
    model: Annotated[Optional[list[str]], typer.Option(  # noqa: UP045
        "--model", help="Model to train (repeatable; default: all; --quick: mlp, lenet5).")] = None,
    mode: Annotated[Optional[list[str]], typer.Option(  # noqa: UP045
        "--mode", help="solo@<f>x, <policy>-cpu or <policy>-nccl (repeatable).")] = None,
    dataset: Annotated[Optional[str], typer.Option(  # noqa: UP045
        help="Train every model on this dataset (default: its first usable one).")] = None,
    epochs: Annotated[Optional[int], typer.Option(  # noqa: UP045
        min=EPOCHS.low, max=EPOCHS.high,
        help="Epochs per cell (default: the model's; --quick: its quick epochs).")] = None,
    seeds: Annotated[int, typer.Option(min=NUM_SEEDS.low, max=NUM_SEEDS.high,
                                       help="Seeds per cell: 0..N-1.")] = 1,
    simulate_slowdown: Annotated[str, typer.Option(
        help="Emulated speed factors, one per worker (CPU hosts and single-GPU hosts).")] = "1,2.5",
    quick: Annotated[bool, typer.Option(
        "--quick", help="A short sweep: mlp and lenet5 on the generated dataset, a few minutes.")] = False,
    out: Annotated[Path, typer.Option(help="Sweep directory.")] = DEFAULT_OUT,
    data_dir: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        help="Dataset cache (default: <fdl cache>/datasets).")] = None,
    no_download: Annotated[bool, typer.Option(
        "--no-download", help="Use only datasets already on disk, bundled or generated.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan only.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="With --dry-run: JSON.")] = False,
) -> None:
    """Train every model in every mode under fdl run; write results.jsonl and report.md."""
    if ctx.invoked_subcommand is not None:
        return
    if json_output and not dry_run:
        raise UsageError("--json goes with --dry-run", hint="fdl bench --dry-run --json")
    from fdl.bench.sweep import parse_slowdown

    slowdown = parse_slowdown(simulate_slowdown)
    request = _Request(models=list(model or ()), modes=list(mode or ()), dataset=dataset,
                       epochs=epochs, seeds=seeds, slowdown=slowdown, quick=quick, out=out,
                       data_dir=data_dir, download=not no_download)
    cells, notes = request.plan()
    if dry_run:
        from fdl.launch.child import check_out

        check_out(request.out, command="fdl bench")
        _print_plan(cells, notes, request, as_json=json_output)
        return
    raise typer.Exit(_execute(cells, notes, request))


@bench_app.command("report")
def report(
    directory: Annotated[Path, typer.Argument(metavar="DIR", help="Sweep dir.")] = DEFAULT_OUT,
) -> None:
    """Rebuild report.md, report.json and the plots from DIR/results.jsonl."""
    from fdl import console
    from fdl.bench.sweep_report import write_report

    for path in write_report(directory):
        console.out(str(path))


class _Request:
    """The flags of one ``fdl bench``, resolved (data dir, GPU count, seeds) once."""

    def __init__(self, *, models: list[str], modes: list[str], dataset: str | None,
                 epochs: int | None, seeds: int, slowdown: tuple[float, ...], quick: bool,
                 out: Path, data_dir: Path | None, download: bool):
        from fdl.bench.datasets import default_data_dir
        from fdl.system.facts import count_gpus

        self.models, self.modes, self.epochs, self.quick = models, modes, epochs, quick
        self.seeds = list(range(seeds))
        self.out = out
        self.data_dir = (data_dir or default_data_dir()).expanduser().resolve()
        self.planning = {"models": models, "quick": quick, "slowdown": slowdown,
                         "gpus": count_gpus(), "data_dir": self.data_dir, "download": download,
                         "dataset": dataset}

    def plan(self) -> tuple[list[Cell], list[str]]:
        from fdl.bench.sweep import plan_notes, plan_sweep

        cells = plan_sweep(modes=self.modes, seeds=self.seeds, epochs=self.epochs,
                           **self.planning)
        notes = plan_notes(**self.planning)
        if not cells:
            raise UsageError("nothing to run: " + "; ".join(n for n in notes if "left out" in n),
                             hint="allow downloads, or pick models with --model")
        return cells, notes

    def args(self, cells: list[Cell]) -> dict[str, Any]:
        """The sweep's arguments as sweep.json records them (models and modes as planned)."""
        return {"models": list(dict.fromkeys(c.model for c in cells)),
                "modes": list(dict.fromkeys(c.mode for c in cells)),
                "seeds": len(self.seeds), "epochs": self.epochs, "quick": self.quick,
                "slowdown": list(self.planning["slowdown"]), "dataset": self.planning["dataset"],
                "download": self.planning["download"], "gpus": self.planning["gpus"]}


def _execute(cells: list[Cell], notes: list[str], request: _Request) -> int:
    from fdl import console
    from fdl.bench.sweep import run_sweep, split_done
    from fdl.bench.sweep_report import write_report

    _check_out_dir(request.out)
    for note in notes:
        console.info(f"fdl bench: {note}")
    todo, done = split_done(cells, out_dir=request.out)
    if done:
        console.info(f"fdl bench: {len(done)} of {len(cells)} cell(s) already in "
                     f"{request.out / 'results.jsonl'}: skipped")
    _prepare(todo, request)
    with console.progress(unit="items") as bar:
        task = bar.add_task("fdl bench", total=len(todo))

        def on_cell(index: int, cell: Cell) -> None:
            label = f"cell {index + 1}/{len(todo)}: {cell.key}"
            console.info(f"fdl bench: {label}")  # a line per cell for logs without a terminal
            bar.update(task, completed=index, description=label)

        outcome = run_sweep(cells, out_dir=request.out, data_dir=request.data_dir,
                            args=request.args(cells), on_cell=on_cell)
        bar.update(task, completed=len(todo), description="fdl bench: done")
    for failure in outcome.failures:
        console.error(failure.message, hint=failure.hint)
    paths = write_report(request.out) if (request.out / "results.jsonl").is_file() else []
    _print_summary(request.out)
    for path in paths:
        console.out(str(path))
    return 1 if outcome.failures else 0


def _check_out_dir(out: Path) -> None:
    """The sweep directory must be a directory fdl can write (made if absent), before any
    dataset is fetched or cell started."""
    from fdl.launch.child import OUT_HINT, check_out

    check_out(out, command="fdl bench")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {out}: cannot create the sweep directory "
                         f"({exc.strerror or exc})", hint=OUT_HINT) from exc


def _prepare(todo: list[Cell], request: _Request) -> None:
    """Download and verify each dataset once, with a byte progress bar per file."""
    from fdl import console
    from fdl.bench.sweep import prepare_datasets

    if not todo:
        return
    with console.progress(transient=True) as bar:
        task = bar.add_task("datasets", total=None)

        def progress(done: int, total: int | None) -> None:
            bar.update(task, completed=done, total=total)

        prepare_datasets(todo, data_dir=request.data_dir, download=request.planning["download"],
                progress=progress)


def _print_summary(out: Path) -> None:
    from fdl import console
    from fdl.bench.results import load_results
    from fdl.bench.sweep_report import build_report

    try:
        records, _ = load_results(out)
    except FdlError:
        return
    rows = build_report(records, machine={})["rows"]

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    console.print_table(
        ["model", "mode", "eval", "samples/s", "vs fast solo", "vs ideal", "idle", "wall s"],
        [[r["model"], r["mode"], fmt(r["eval"], ".4f"), fmt(r["samples_per_s"], ",.0f"),
          fmt(r["speedup_vs_fast_solo"], ".2f"), fmt(r["efficiency_vs_ideal"], ".1%"),
          fmt(r["idle_fraction"], ".1%"), fmt(r["wall_s"], ".1f")] for r in rows],
        title=f"fdl bench: {out}")


def _print_plan(cells: list[Cell], notes: list[str], request: _Request, *,
                as_json: bool) -> None:
    from fdl import console
    from fdl.bench.sweep import cell_to_json, split_done

    todo, _ = split_done(cells, out_dir=request.out)
    pending = {cell.key for cell in todo}
    if as_json:
        console.print_json({"schema": 1, "out": str(request.out), "args": request.args(cells),
                            "notes": notes, "cells": [{**cell_to_json(c), "done": c.key not in
                                                       pending} for c in cells]})
        return
    console.rule("fdl bench --dry-run")
    for note in notes:
        console.out(f"  {note}")
    console.print_table(
        ["model", "dataset", "mode", "seed", "workers", "slowdown", "epochs", "status"],
        [[c.model, c.dataset, c.mode, c.seed, c.world_size,
          ",".join(f"{f:g}" for f in c.slowdown) if c.slowdown else "-", c.epochs,
          "to run" if c.key in pending else "done"] for c in cells],
        title=f"{len(cells)} cell(s), {len(todo)} to run, in {request.out}")
