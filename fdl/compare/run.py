"""Running an ``fdl compare`` plan (:mod:`fdl.compare.plan`) and writing what it found.

:func:`check_out_dir` refuses, before anything is written, a compare directory that holds
another compare's plan or anything but a compare. :func:`run_compare` writes ``plan.json``,
then runs each cell that is not finished as a real ``fdl run`` (a child process: output to the
cell's log and to ``echo``; Ctrl-C stops it and propagates, finished cells stay as they are).
:func:`write_compare` writes ``compare.json``, ``compare.md`` and ``compare.png``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fdl import readback
from fdl.compare.figures import build_document, build_rows, epochs_of
from fdl.compare.plan import CompareCell, ComparePlan
from fdl.compare.recommend import recommend
from fdl.compare.render import PLOT_FILE, render_markdown, render_png
from fdl.compare.results import CellOutcome, RunResult, RunUnusable, load_run_result
from fdl.errors import UsageError
from fdl.files import write_atomic, write_json_atomic
from fdl.launch.child import check_out, run_from_scratch
from fdl.rundir.summary import diverged_loss

PLAN_FILE = "plan.json"
SCHEMA = 1
_HINT = "pass another --out, or rerun that compare's own command to resume it"


def check_out_dir(plan: ComparePlan) -> None:
    """A UsageError unless ``plan.out`` is new, empty, or holds this same compare. Reads only."""
    out = plan.out
    if not out.exists():
        return
    if not out.is_dir():
        raise UsageError(f"--out {out} is not a directory", hint="pass --out DIR")
    path = out / PLAN_FILE
    if not path.exists() and not path.is_symlink():
        if any(out.iterdir()):
            raise UsageError(f"--out {out} is not empty and holds no fdl compare",
                             hint="pass a new or empty directory as --out")
        return
    try:
        previous = readback.read_json(path)
    except readback.ReadBackError as exc:
        raise UsageError(f"{path} cannot be read as fdl compare's plan: it {exc.problem}",
                         hint=_HINT) from None
    except OSError as exc:
        raise UsageError(f"{path} cannot be read as fdl compare's plan "
                         f"({exc.strerror or exc})", hint=_HINT) from None
    found = {key: previous.get(key) for key in plan.identity} \
        if isinstance(previous, dict) else None
    if found != dict(plan.identity):
        raise UsageError(f"--out {out} holds another compare ({_describe(found, plan=plan)})", hint=_HINT)


def _describe(identity: Mapping[str, Any] | None, *, plan: ComparePlan) -> str:
    if not identity:
        return "an unreadable plan"
    if {**identity, "script_sha256": None} == {**plan.identity, "script_sha256": None}:
        return f"of {identity.get('script')} as it was before an edit"
    options = " ".join(f"{k}={v}" for k, v in (identity.get("options") or {}).items())
    return " ".join(str(word) for word in [identity.get("script"), *(identity.get("args") or [])]) \
        + (f" with {options}" if options else " with no fdl run option")


def check_cells(plan: ComparePlan) -> None:
    """A UsageError unless fdl can write into ``plan.out`` (fdl.files.output_dir_problem) and no
    cell's run directory or log there is a symbolic link: fdl compare removes an unfinished
    cell's directory and rewrites its log, and neither may reach through a link to what it
    points at. Reads only (fdl.launch.child.check_out)."""
    check_out(plan.out, command="fdl compare",
              paths=[path for cell in plan.cells for path in (cell.run_dir, cell.log)])


def finished_result(cell: CompareCell) -> RunResult | None:
    """The cell's result when its run directory holds a usable run of this very cell."""
    return earlier_result(cell)[0]


def earlier_result(cell: CompareCell) -> tuple[RunResult | None, str | None]:
    """:func:`finished_result`, and when there is none, why the run directory an earlier
    attempt left cannot be kept (None when there is none): said before the cell runs again."""
    try:
        return load_run_result(cell.run_dir, expected=cell.expected), None
    except RunUnusable as exc:
        return None, exc.message if os.path.lexists(cell.run_dir) else None


def run_compare(plan: ComparePlan, *, env: Mapping[str, str] | None = None,
                on_cell: Callable[[int, CompareCell, bool, str | None], None] | None = None,
                echo: Callable[[str], None] | None = None) -> list[CellOutcome]:
    """Every cell's outcome, running those not finished; ``on_cell(index, cell, reused,
    why)`` before each (``why``: why an earlier attempt's run directory is not kept). Call
    :func:`check_out_dir` first; :func:`check_cells` is called here, before anything is
    written."""
    check_cells(plan)
    try:
        plan.out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(plan.out / PLAN_FILE, {"schema": SCHEMA, **plan.to_dict()})
    except OSError as exc:
        raise UsageError(f"--out {plan.out}: cannot write the compare directory "
                         f"({exc.strerror or exc})", hint="pass --out DIR you can write") from exc
    outcomes = []
    for index, cell in enumerate(plan.cells):
        result, why = earlier_result(cell)
        if on_cell is not None:
            on_cell(index, cell, result is not None, why)
        if result is not None:
            outcomes.append(_outcome(cell, result=result, skipped=True))
        else:
            outcomes.append(run_cell(cell, cwd=plan.cwd,
                                     env=os.environ if env is None else env, echo=echo))
    return outcomes


def run_cell(cell: CompareCell, *, cwd: Path, env: Mapping[str, str],
             echo: Callable[[str], None] | None = None) -> CellOutcome:
    """Run one cell from scratch (:func:`fdl.launch.child.run_from_scratch`: an earlier
    attempt's run directory is removed first, only if it holds nothing but what fdl run writes)
    and read back what it left."""
    code = run_from_scratch(cell.argv, run_dir=cell.run_dir, log=cell.log, cwd=cwd, env=env,
                            echo=echo)
    try:
        result = load_run_result(cell.run_dir, expected=cell.expected)
    except RunUnusable as exc:
        why = f"fdl run exited with code {code}" if code else exc.message
        return _outcome(cell, failure=why)
    if code != 0 and diverged_loss(cell.run_dir) is None:  # a diverged run is a result
        return _outcome(cell, failure=f"fdl run exited with code {code}")
    return _outcome(cell, result=result)


def _outcome(cell: CompareCell, *, result: RunResult | None = None, failure: str | None = None,
             skipped: bool = False) -> CellOutcome:
    return CellOutcome(cell.name, cell.policy, cell.seed, str(cell.run_dir), result, failure,
                       skipped)


@dataclass(frozen=True)
class CompareReport:
    document: dict[str, Any]
    written: list[Path]
    plot: bool  # False: matplotlib is not installed


def write_compare(plan: ComparePlan, *, outcomes: list[CellOutcome],
                  machine: Mapping[str, Any] | None = None) -> CompareReport:
    """compare.json, compare.md and (with matplotlib) compare.png in the compare directory."""
    if machine is None:
        from fdl.system.facts import machine_facts

        machine = machine_facts()
    policies = list(dict.fromkeys(cell.policy for cell in plan.cells))
    rows = build_rows(outcomes, policies=policies)
    advice = recommend(rows, epochs=epochs_of(outcomes))
    document = build_document(outcomes, rows=rows, plan={"out": str(plan.out), **plan.identity},
                              recommendation=advice.to_dict(), machine=machine)
    png = render_png(document)
    written = [write_json_atomic(plan.out / "compare.json", document),
               write_atomic(plan.out / "compare.md", render_markdown(document,
                                                                     plot=png is not None))]
    if png is not None:
        written.append(write_atomic(plan.out / PLOT_FILE, png))
    return CompareReport(document, written, plot=png is not None)
