"""``fdl run SCRIPT [ARGS]...``: torchrun-compatible launcher with El Che settings.

fdl run's options are fdl's wherever they appear, so `fdl run train.py --policy async` works;
every other argument after SCRIPT, and everything after a `--`, goes to the script unchanged.
See docs/run.md for flags, environment variables, the run directory and failure behaviour.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Optional

import typer

if TYPE_CHECKING:
    from fdl.launch.elastic import LaunchResult
    from fdl.launch.spec import LaunchSpec

RUN_CONTEXT = {"allow_interspersed_args": False}

_T = "torchrun-compatible"
_E = "El Che engine"


def run(
    script: Annotated[Optional[str], typer.Argument(help="The training script (or module with --module); with --resume, the run's own by default.")] = None,  # noqa: UP045
    args: Annotated[Optional[list[str]], typer.Argument(help="Arguments for the script.")] = None,  # noqa: UP045
    nproc_per_node: Annotated[Optional[str], typer.Option(  # noqa: UP045
        help="Workers per node: N, 'auto' (one per GPU, else 2 CPU workers) or 'cpu'.",
        rich_help_panel=_T)] = None,
    nnodes: Annotated[Optional[str], typer.Option(help="Nodes: N or MIN:MAX.", rich_help_panel=_T)] = None,  # noqa: UP045
    node_rank: Annotated[Optional[int], typer.Option(help="This node's rank (static rendezvous).", rich_help_panel=_T)] = None,  # noqa: UP045
    rdzv_endpoint: Annotated[Optional[str], typer.Option(help="HOST:PORT of the rendezvous.", rich_help_panel=_T)] = None,  # noqa: UP045
    rdzv_backend: Annotated[Optional[str], typer.Option(help="c10d (default) or static.", rich_help_panel=_T)] = None,  # noqa: UP045
    rdzv_id: Annotated[Optional[str], typer.Option(help="Job id shared by all nodes.", rich_help_panel=_T)] = None,  # noqa: UP045
    max_restarts: Annotated[Optional[int], typer.Option(help="Restart the worker group up to N times.", rich_help_panel=_T)] = None,  # noqa: UP045
    standalone: Annotated[bool, typer.Option(help="Single node, local rendezvous on a free port.", rich_help_panel=_T)] = False,
    master_addr: Annotated[Optional[str], typer.Option(help="Static rendezvous address.", rich_help_panel=_T)] = None,  # noqa: UP045
    master_port: Annotated[Optional[int], typer.Option(help="Static rendezvous port.", rich_help_panel=_T)] = None,  # noqa: UP045
    module: Annotated[bool, typer.Option("--module", "-m", help="SCRIPT is a module name.", rich_help_panel=_T)] = False,
    devices: Annotated[Optional[str], typer.Option(help="GPU indices to use, e.g. 0,1.")] = None,  # noqa: UP045
    policy: Annotated[Optional[str], typer.Option(help="sync | cadence | async.", rich_help_panel=_E)] = None,  # noqa: UP045
    backend: Annotated[Optional[str], typer.Option(help="auto | nccl | cpu.", rich_help_panel=_E)] = None,  # noqa: UP045
    simulate_slowdown: Annotated[Optional[str], typer.Option(help="Per-worker slowdown factors, e.g. 1,2.5.", rich_help_panel=_E)] = None,  # noqa: UP045
    epochs: Annotated[Optional[str], typer.Option(help="Epochs.", rich_help_panel=_E)] = None,  # noqa: UP045
    batch_size: Annotated[Optional[str], typer.Option(help="Batch size per worker per step.", rich_help_panel=_E)] = None,  # noqa: UP045
    seed: Annotated[Optional[str], typer.Option(help="Seed for init and data order.", rich_help_panel=_E)] = None,  # noqa: UP045
    run_dir: Annotated[Optional[str], typer.Option(help="Run directory (default runs/<UTC>-<stem>-<policy>).")] = None,  # noqa: UP045
    overwrite_run_dir: Annotated[bool, typer.Option(help="Replace the earlier run in the run directory (only a directory fdl run wrote).")] = False,
    checkpoint_every: Annotated[Optional[str], typer.Option(help="Checkpoint every N epochs, or a time: 10m, 90s, 2h.", rich_help_panel=_E)] = None,  # noqa: UP045
    resume: Annotated[Optional[str], typer.Option(help="Continue RUN_DIR from its last valid checkpoint.", metavar="RUN_DIR")] = None,  # noqa: UP045
    quiet_ranks: Annotated[bool, typer.Option(help="Show only rank 0's output on the terminal.")] = False,
    dry_run: Annotated[bool, typer.Option(help="Print the launch spec and exit.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="With --dry-run: print JSON.")] = False,
) -> None:
    """Launch one worker per device and run SCRIPT in each (torch.distributed.elastic).

    fdl's options may come before or after SCRIPT; other arguments go to the script, and so
    does everything after `--`. Example: fdl run train.py --policy async -- --lr 0.1
    """
    from fdl.launch import plan_run
    from fdl.launch.spec import RunRequest, split_script_args

    options = dict(
        nproc_per_node=nproc_per_node, nnodes=nnodes, node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint, rdzv_backend=rdzv_backend, rdzv_id=rdzv_id,
        standalone=standalone, master_addr=master_addr, master_port=master_port,
        max_restarts=max_restarts, devices=devices, policy=policy, backend=backend,
        simulate_slowdown=simulate_slowdown, epochs=epochs, batch_size=batch_size, seed=seed,
        run_dir=run_dir, checkpoint_every=checkpoint_every, resume=resume,
        overwrite_run_dir=overwrite_run_dir, quiet_ranks=quiet_ranks, dry_run=dry_run,
        json_output=json_output)
    claimed, script_args = split_script_args(tuple(args or ()))
    for key, value in claimed.items():  # an option before SCRIPT wins over the same one after
        if options[key] in (None, False):
            options[key] = value
    dry_run, json_output = options.pop("dry_run"), options.pop("json_output")
    if json_output and not dry_run:
        from fdl.errors import UsageError

        raise UsageError("--json only applies to --dry-run",
                         hint="fdl run --dry-run --json SCRIPT prints the launch spec as JSON")
    request = RunRequest(script=script, script_args=script_args, module=module, **options)
    spec = plan_run(request)
    if dry_run:
        _print_spec(spec, as_json=json_output)
        return
    raise typer.Exit(_execute(spec))


def _execute(spec: LaunchSpec) -> int:
    """Check everything (nothing written, nothing started), then write the run directory, then
    start the workers."""
    from fdl import console
    from fdl.launch.elastic import launch, preflight
    from fdl.launch.rundir import check_run_dir, prepare_run_dir
    from fdl.version import __version__

    check_run_dir(spec.run_dir, use=spec.run_dir_use)
    listener = preflight(spec)
    prepare_run_dir(spec.run_dir, config={"fdl_version": __version__, **spec.to_dict()},
                    use=spec.run_dir_use)
    console.info(f"fdl run: {spec.nproc_per_node} worker(s) per node, {spec.devices.reason}; "
                 f"run directory {spec.run_dir}")
    result = launch(spec, listener=listener)
    _report(result, spec)
    _write_timeline(spec)
    return result.exit_code


def _write_timeline(spec: LaunchSpec) -> None:
    """Merge this node's timelines and samples into timeline.json/.csv/.html (and the curves
    PNG), also after a failure: that is when the timeline is most wanted."""
    from fdl import console
    from fdl.launch.timeline_merge import write_timeline

    if not (spec.run_dir / "timeline").is_dir():
        return
    try:
        written = write_timeline(spec.run_dir)
    except (OSError, ValueError) as exc:
        console.warn(f"timeline not written: {exc}")
        return
    html = spec.run_dir / "timeline" / "timeline.html"
    if html in written:
        console.info(f"fdl run: timeline {html}")
    has_epochs = (spec.run_dir / "metrics.jsonl").is_file()
    if has_epochs and not any(p.suffix == ".png" for p in written):
        console.info("fdl run: no loss/accuracy plot: matplotlib is not installed "
                     "(pip install 'fdl[report]')")


def _report(result: LaunchResult, spec: LaunchSpec) -> None:
    from fdl import console

    if result.interrupted:
        console.error("interrupted: all workers stopped")
        return
    cause = result.root_cause
    if cause is None:
        if (spec.run_dir / "summary.json").is_file():  # the script trained with fdl.Trainer
            from fdl.cli.report import render, run_report

            render(run_report(spec.run_dir))
        console.info(f"fdl run: done; run directory {spec.run_dir}")
        return
    how = f"was killed by {cause.signal}" if cause.signal else f"exited with code {cause.exit_code}"
    console.error(f"worker rank {cause.rank} {how}; the other workers were stopped",
                  hint=f"full log: {cause.log}")
    console.info(f"root cause: rank {cause.rank} (local rank {cause.local_rank}), "
                 f"{cause.signal or 'exit code ' + str(cause.exit_code)}; last lines of its log:")
    for line in cause.tail or ["(the log is empty)"]:
        console.info(f"  | {line}")


def _print_spec(spec: LaunchSpec, *, as_json: bool) -> None:
    from fdl import console

    document = spec.to_dict()
    if as_json:
        console.print_json(document)
        return
    rdzv = document["rendezvous"]
    console.rule("fdl run --dry-run")
    console.print_pairs([
        ("script", " ".join([document["script"], *document["args"]])),
        ("workers", f"{document['nproc_per_node']} per node x {document['nnodes']} node(s)"),
        ("devices", document["devices"]["reason"]),
        ("rendezvous", f"{rdzv['backend']} at {rdzv['endpoint']} (run id {rdzv['run_id']}, "
                       f"{rdzv['source']})"),
        ("max restarts", document["max_restarts"]),
        ("run directory", document["run_dir"]),
    ])
    console.print_table(["local rank", "rank", "device"],
                        [[w["local_rank"], w["rank"] if w["rank"] is not None else "at rendezvous",
                          w["device"]] for w in document["workers"]], title="Workers")
    console.print_table(["setting", "value", "source"],
                        [[k, v["value"], v["source"]] for k, v in document["settings"].items()],
                        title="Settings")
    console.print_table(["variable", "value"], list(document["env"].items()),
                        title="Environment added to every worker (besides torchrun's)")
