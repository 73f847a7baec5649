"""``fdl compare SCRIPT``: train your own script once per policy (and seed) and compare the runs.

    fdl compare train.py --epochs 3                       # sync, cadence, async; one seed
    fdl compare train.py --policies sync,async --seeds 3 --simulate-slowdown 1,2.5
    fdl compare train.py --out runs/cmp                   # the same --out again resumes
    fdl compare train.py --dry-run [--json]               # the runs and their exact argv

Each run is a real ``fdl run`` with the options given here: fdl run's options before SCRIPT or
after it (after it, as with fdl run, they are fdl's wherever they appear), the script's own
arguments after it, or after ``--``. Then a table, one row per policy: samples/s, speedup over
sync, time to reach sync's final train loss, final train loss and eval metrics, idle fraction
and sync overhead; a recommendation saying what it rests on; compare.md, compare.json and
compare.png in the compare directory. Exit codes: 0 every run finished, 1 a run failed (the
others still ran), 2 bad input (nothing started), 130 interrupted (finished runs are kept).
docs/cli.md has more.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from fdl.errors import UsageError
from fdl.ranges import EPOCHS, NUM_SEEDS
from fdl.settings import POLICIES

if TYPE_CHECKING:
    from fdl.compare.plan import ComparePlan

COMPARE_CONTEXT = {"allow_interspersed_args": False}  # after SCRIPT: fdl run's and the script's
# fdl compare's own options that take a value (the others are on/off flags)
_OWN_VALUED = ("--policies", "--epochs", "--seeds", "--out")
_OWN_FLAGS = ("--dry-run", "--json", "-h", "--help")


def hoist_run_options(argv: list[str]) -> list[str]:
    """fdl compare's words (after ``compare``) with the fdl run options given before SCRIPT
    moved to just after it, where the command reads them: ``--simulate-slowdown 1,2.5
    train.py`` -> ``train.py --simulate-slowdown 1,2.5``, as a torchrun user would write it.
    fdl compare's own options stay where they are; anything else (an unknown option, ``-m``,
    no SCRIPT at all) is left for the parser to refuse."""
    from fdl.settings import BY_NAME, OPTIONS_BY_NAME, takes_bare

    run_valued = {spec.flag_name for spec in BY_NAME.values() if spec.flag} | {
        o.flag_name for o in OPTIONS_BY_NAME.values() if o.kind != "bool" and o.after_script}
    run_flags = {o.flag_name for o in OPTIONS_BY_NAME.values()
                 if o.kind == "bool" and o.after_script}
    kept: list[str] = []
    moved: list[str] = []
    index = 0
    while index < len(argv):
        word = argv[index]
        flag, eq, _ = word.partition("=")
        following = argv[index + 1] if index + 1 < len(argv) else None
        if word == "--" or not word.startswith("-"):  # SCRIPT (or nothing to move past)
            if word == "--" or not moved:
                return argv
            return [*kept, word, *moved, *argv[index + 1:]]
        if flag in _OWN_VALUED or flag in run_valued:
            taken = [word] if eq or takes_bare(flag, following) is not None else \
                argv[index:index + 2]
        elif flag in _OWN_FLAGS or flag in run_flags:
            taken = [word]
        else:
            return argv  # unknown: the parser says so
        (kept if flag in _OWN_VALUED or flag in _OWN_FLAGS else moved).extend(taken)
        index += len(taken)
    return argv


def compare(
    ctx: typer.Context,
    script: Annotated[str, typer.Argument(help="The training script (using fdl.Trainer or run.batches).")],
    args: Annotated[Optional[list[str]], typer.Argument(  # noqa: UP045
        help="fdl run options for every run, then the script's arguments.")] = None,
    policies: Annotated[str, typer.Option(help="Policies, comma-separated.")] = ",".join(POLICIES),
    epochs: Annotated[Optional[int], typer.Option(  # noqa: UP045
        min=EPOCHS.low, max=EPOCHS.high, help="Epochs of every run (default: fdl run's).")] = None,
    seeds: Annotated[int, typer.Option(min=NUM_SEEDS.low, max=NUM_SEEDS.high,
                                       help="Seeds per policy: --seed, --seed + 1, ...")] = 1,
    out: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        help="Compare directory (default runs/compare-<UTC time>-<stem>); reuse it to resume.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the runs; start nothing.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON document.")] = False,
) -> None:
    """Run SCRIPT under each policy with fdl run and compare the runs side by side.

    fdl run's options (--nproc-per-node, --simulate-slowdown, --batch-size ...) go before or
    after SCRIPT and reach every run; other arguments after SCRIPT go to the script, and
    everything after `--`.
    Example: fdl compare train.py --epochs 3 --seeds 3 --simulate-slowdown 1,2.5
    """
    from fdl.compare.plan import CompareRequest, parse_policies, prepare_compare
    from fdl.compare.run import check_cells, check_out_dir
    from fdl.launch.request import split_script_args

    given = {"policies": policies, "epochs": epochs, "seeds": seeds, "out": out,
             "dry_run": dry_run, "json_output": json_output}
    found, rest = _own_options(ctx, list(args or ()))
    given.update({k: v for k, v in found.items() if _is_default(ctx, k)})  # before SCRIPT wins
    flags, script_args = split_script_args(tuple(rest))
    if given["epochs"] is not None:
        flags["epochs"] = given["epochs"]
    request = CompareRequest(script, script_args=script_args, flags=flags,
                             policies=parse_policies(given["policies"]),
                             num_seeds=given["seeds"], out=given["out"])
    plan = prepare_compare(request)
    check_out_dir(plan)
    check_cells(plan)
    if given["dry_run"]:
        _print_plan(plan, as_json=given["json_output"])
        return
    raise typer.Exit(_execute(plan, as_json=given["json_output"]))


def _own_options(ctx: typer.Context, args: list[str]) -> tuple[dict[str, Any], list[str]]:
    """fdl compare's own options among the words after SCRIPT (up to ``--``), read as their
    declarations above say; and the other words, for fdl run and the script."""
    declared = {flag: p for p in ctx.command.params if p.param_type_name == "option"
                for flag in p.opts}
    found: dict[str, Any] = {}
    rest: list[str] = []
    while args:
        word = args.pop(0)
        flag, eq, value = word.partition("=")
        param = declared.get(flag)
        if word == "--":
            return found, [*rest, word, *args]
        if param is None or param.name is None:
            rest.append(word)
            continue
        if not param.is_flag and not eq:
            if not args:
                raise UsageError(f"{flag} needs a value", hint="see `fdl compare --help`")
            value = args.pop(0)
        try:
            found[param.name] = True if param.is_flag else param.type_cast_value(ctx, value)
        except typer.BadParameter as exc:
            message = exc.format_message()  # names the option when the value is out of range
            raise UsageError(message if flag in message else f"{flag}: {message}",
                             hint="see `fdl compare --help`") from exc
    return found, rest


def _is_default(ctx: typer.Context, name: str) -> bool:
    source = ctx.get_parameter_source(name)
    return source is None or source.name == "DEFAULT"


def _execute(plan: ComparePlan, *, as_json: bool) -> int:
    from fdl import console
    from fdl.compare.render import NO_MATPLOTLIB, measurement_errors, tables
    from fdl.compare.run import run_compare, write_compare

    total = len(plan.cells)
    console.info(f"fdl compare: {total} run(s) in {plan.out}")

    def on_cell(index: int, cell: Any, reused: bool, why: str | None) -> None:
        state = "finished earlier: kept" if reused else \
            f"... (run again: {why})" if why else "..."
        console.info(f"[{index + 1}/{total}] {cell.policy} seed {cell.seed} {state}")

    try:
        outcomes = run_compare(plan, on_cell=on_cell, echo=console.info)
    except KeyboardInterrupt:
        console.info(f"fdl compare: interrupted; finished runs are kept: rerun with --out "
                     f"{plan.out} to resume")
        raise
    report = write_compare(plan, outcomes=outcomes)
    for outcome in (o for o in outcomes if o.failure):
        console.error(f"{outcome.name}: {outcome.failure}",
                      hint=f"its output: {plan.out / outcome.name}.log")
    if not report.plot:
        console.info(f"fdl compare: no {plan.out / 'compare.png'}: {NO_MATPLOTLIB}")
    if as_json:
        console.print_json(report.document)
    else:
        for title, columns, rows in tables(report.document):
            console.print_table(columns, rows, title=f"{title}: {plan.identity['script']}")
        for line in measurement_errors(report.document):
            console.out(line)
        console.out(f"recommendation: {report.document['recommendation']['text']}")
        for note in report.document["recommendation"]["notes"]:
            console.out(f"  {note}")
        for path in report.written:
            console.out(str(path))
    return 1 if any(o.failure for o in outcomes) else 0


def _print_plan(plan: ComparePlan, *, as_json: bool) -> None:
    import shlex

    from fdl import console
    from fdl.compare.run import SCHEMA, earlier_result

    earlier = {cell.name: earlier_result(cell) for cell in plan.cells}
    done = {name: result is not None for name, (result, _) in earlier.items()}
    if as_json:
        document = plan.to_dict()
        for cell in document["cells_planned"]:
            cell["finished"] = done[cell["name"]]
        console.print_json({"schema": SCHEMA, **document})
        return
    console.rule("fdl compare --dry-run")
    console.out(f"compare directory {plan.out}: {len(plan.cells)} run(s), "
                f"{list(done.values()).count(False)} to run")
    for index, cell in enumerate(plan.cells, start=1):
        why = earlier[cell.name][1]
        state = "finished: kept" if done[cell.name] else f"to run again: {why}" if why \
            else "to run"
        console.out(f"[{index}/{len(plan.cells)}] {cell.policy} seed {cell.seed} ({state}): "
                    f"{shlex.join(cell.argv)}")
