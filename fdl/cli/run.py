"""``fdl run SCRIPT [ARGS]...``: torchrun-compatible launcher with El Che settings.

    fdl run train.py                                  # one worker per GPU, else 2 on the CPU
    fdl run train.py --policy async --nproc-per-node 2 -- --lr 0.1
    fdl run train.py --simulate-slowdown 1,2.5        # El Che's case on any machine
    fdl run train.py --dry-run [--json]               # the launch plan; nothing started

fdl run's options are fdl's wherever they appear, so `fdl run train.py --policy async` works;
every other argument after SCRIPT, and everything after a `--`, goes to the script unchanged.
Exit codes: 0 every worker succeeded, the failing worker's code (``128 + N`` for signal N)
after a root-cause block, 2 bad input (nothing started), 130 on Ctrl-C (143 on SIGTERM).
docs/run.md has the flags, environment variables, the run directory and the failure behaviour.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from fdl.settings import LAUNCH_OPTIONS, SETTINGS, TORCHRUN_PANEL

if TYPE_CHECKING:
    from fdl.launch.elastic import LaunchResult
    from fdl.launch.spec import LaunchSpec

RUN_CONTEXT = {"allow_interspersed_args": False}


def run(script: Optional[str], args: Optional[list[str]], **flags: Any) -> None:  # noqa: UP045
    """Launch one worker per device and run SCRIPT in each (torch.distributed.elastic).

    fdl's options may come before or after SCRIPT; other arguments go to the script, and so
    does everything after `--`. Example: fdl run train.py --policy async -- --lr 0.1
    """
    import os
    import signal

    from fdl.launch import plan_run
    from fdl.launch.request import RunRequest, split_script_args

    # until torch's agent takes SIGTERM over (as the workers start), it ends fdl run with a line
    signal.signal(signal.SIGTERM, _stopped_by_sigterm)
    claimed, script_args = split_script_args(tuple(args or ()))
    for key, value in claimed.items():  # an option before SCRIPT wins over the same one after
        if _unset(flags.get(key)):
            flags[key] = value
    dry_run, json_output, quiet = flags.pop("dry_run"), flags.pop("json"), flags.pop("quiet")
    if json_output and not dry_run:
        from fdl.errors import UsageError

        raise UsageError("--json only applies to --dry-run",
                         hint="fdl run --dry-run --json SCRIPT prints the launch spec as JSON")
    given = {key: value for key, value in flags.items() if not _unset(value)}
    live = not quiet and _live_terminal()
    spec = plan_run(RunRequest(script, script_args, given), live=live, launcher_pid=os.getpid(),
                    preview=dry_run)
    if dry_run:
        _check_run_dir(spec)  # what the run would refuse, --dry-run refuses (it reads only)
        _print_spec(spec, as_json=json_output)
        return
    raise typer.Exit(_execute(spec, live=live))


def _check_run_dir(spec: LaunchSpec) -> None:
    """The run directory may be used as planned (fdl.rundir.layout.check_run_dir); on several
    nodes it is checked when joined instead, since another node may have made it."""
    from fdl.rundir.layout import check_run_dir

    if spec.network is None or not spec.network.several_nodes:
        check_run_dir(spec.run_dir, use=spec.run_dir_use)


def _live_terminal() -> bool:
    from fdl import console

    return console.is_live_terminal()


def _unset(value: Any) -> bool:
    """A flag not given: None, or a switch left off (``0`` is a value: --master-port 0)."""
    return value is None or value is False


def _parameters() -> list[inspect.Parameter]:
    """fdl run's Typer parameters, made from the settings contract (fdl.settings): every
    setting with a flag takes text its parser reads; launch options are text, int or switches
    named exactly as typed (no --no-... twins)."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    params = [
        inspect.Parameter("script", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                          annotation=Annotated[Optional[str], typer.Argument(  # noqa: UP045
                              help="The training script (or module with --module); with "
                                   "--resume, the run's own by default.")]),
        inspect.Parameter("args", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                          annotation=Annotated[Optional[list[str]], typer.Argument(  # noqa: UP045
                              help="Arguments for the script.")]),
    ]
    for spec in SETTINGS:
        if spec.flag:
            option = typer.Option(*_spellings(spec.flag_name, spec.panel), help=spec.help,
                                  rich_help_panel=spec.panel)
            params.append(inspect.Parameter(spec.name, keyword, default=None,
                                            annotation=Annotated[Optional[str], option]))  # noqa: UP045
    for launch_option in LAUNCH_OPTIONS:
        names = [*_spellings(launch_option.flag_name, launch_option.panel),
                 *([launch_option.short] if launch_option.short else [])]
        option = typer.Option(*names, help=launch_option.help, metavar=launch_option.metavar,
                              rich_help_panel=launch_option.panel)
        kind = {"bool": bool, "int": Optional[int], "text": Optional[str]}[launch_option.kind]  # noqa: UP045
        params.append(inspect.Parameter(launch_option.name, keyword,
                                        default=False if kind is bool else None,
                                        annotation=Annotated[kind, option]))
    return params


def _spellings(flag: str, panel: str | None) -> list[str]:
    """``flag``, and for torchrun's own flags torchrun's underscore spelling too
    (``--nproc_per_node``): a torchrun command line works with ``fdl run`` in its place."""
    underscored = "--" + flag[2:].replace("-", "_")
    return [flag, underscored] if panel == TORCHRUN_PANEL and underscored != flag else [flag]


run.__signature__ = inspect.Signature(_parameters())  # type: ignore[attr-defined]
run.__annotations__ = {p.name: p.annotation for p in run.__signature__.parameters.values()}  # type: ignore[attr-defined]


def _execute(spec: LaunchSpec, *, live: bool) -> int:
    """Check everything (nothing written, nothing started), then write the run directory, then
    start the workers; ``live``: the terminal shows rank 0's progress (``spec`` was planned with
    ``live``, so it asks rank 0 for it). What it says at the end comes last: a failure's or an
    interruption's one line after the timeline's, so nothing buries it."""
    from fdl import console
    from fdl.launch.elastic import launch, preflight
    from fdl.launch.live import live_progress
    from fdl.rundir import model, summary
    from fdl.rundir.layout import join_or_prepare_run_dir
    from fdl.rundir.summary import diverged_loss
    from fdl.rundir.timeline_plot import load_in_background
    from fdl.version import __version__

    document = spec.to_dict()
    _check_run_dir(spec)
    listener = preflight(spec)
    joined = join_or_prepare_run_dir(spec.run_dir, spec=document, fdl_version=__version__,
                                     use=spec.run_dir_use)
    made = "joins run directory" if joined else "run directory"
    console.info(f"fdl run: {spec.nproc_per_node} worker(s) per node, {spec.devices.reason}; "
                 f"{made} {spec.run_dir}"
                 + (" (another node of this run made it: a shared filesystem)" if joined else ""))
    if spec.network is not None and spec.network.several_nodes:
        if spec.network.hostname_on_loopback:
            console.warn(_loopback_name_line(spec.network.local_addr))
        console.info(_waiting_line(spec))
    earlier = _summary_stamp(spec)  # a resumed run's: not this launch's end
    with live_progress(spec.run_dir, enabled=live), _join_watch(spec):
        result = launch(spec, listener=listener,
                        node=spec.network.local_addr if joined and spec.network else None,
                        on_workers=load_in_background if _core_to_spare(spec) else None)
    if result.exit_code == 0 and _unfinished(spec):
        _write_timeline(spec)
        console.error(f"the script trained with fdl but ended without run.finish(): no "
                      f"{summary.FILE} and no {model.FILE} in {spec.run_dir}",
                      hint="end the script with result = run.finish() after its loop "
                           "(fdl.Trainer.fit() calls it)")
        return 1
    if result.exit_code == 0:
        diverged = diverged_loss(spec.run_dir)
        _report_done(spec, done=diverged is None)
        _write_timeline(spec)
        _warn_unread_settings(spec)
        if diverged is not None:
            console.error(f"the run diverged: its final loss is {diverged}, and {model.FILE} in "
                          f"{spec.run_dir} holds the diverged weights",
                          hint="lower the learning rate or clip the gradients and train again "
                               "(the run's timeline shows where the loss stopped being a "
                               "number)")
            return 1
    else:
        _write_timeline(spec)
        _report_stopped(result, spec, finished=_summary_stamp(spec) not in (None, earlier))
    return result.exit_code


def _core_to_spare(spec: LaunchSpec) -> bool:
    """Whether this node has a core beyond its workers' for the launcher to import the curves'
    matplotlib on while they run (fdl.rundir.timeline_plot.load_in_background). Without one,
    the import slows the workers' own start as much as it saves at the end (docs/run.md
    "Timeline", ``curves.png``)."""
    from fdl.launch.devices import usable_cores

    return usable_cores() > spec.nproc_per_node


def _write_timeline(spec: LaunchSpec) -> None:
    """Merge this node's timelines and samples into timeline.json/.csv/.html (and the curves
    PNG), also after a failure: that is when the timeline is most wanted."""
    from fdl import console
    from fdl.rundir import metrics, timeline
    from fdl.rundir.timeline_merge import html_path, write_timeline
    from fdl.rundir.timeline_plot import plottable

    if not timeline.directory(spec.run_dir).is_dir():
        return
    try:
        written = write_timeline(spec.run_dir)
    except (OSError, ValueError) as exc:
        console.warn(f"timeline not written: {exc}")
        return
    html = html_path(spec.run_dir)
    if html in written:
        from fdl.rundir.timeline_trace import trace_note, trace_path

        console.info(f"fdl run: timeline {html}")
        console.info(f"fdl run: trace {trace_note(trace_path(spec.run_dir))}")
    # nothing said where no epoch has a number to plot (a loop that logs none); the epochs are
    # read again only when no curves were drawn
    if not any(p.suffix == ".png" for p in written) and \
            plottable(metrics.read_epochs(spec.run_dir)):
        console.info("fdl run: no loss/accuracy plot: matplotlib is not installed "
                     "(pip install 'fdl[report]')")


def _unfinished(spec: LaunchSpec) -> bool:
    """Whether the workers all exited 0 from a script that trained with fdl's engine (it
    recorded its settings in config.json) and never called ``run.finish()``: no summary. Read
    on the node of rank 0, where the engine writes both; a run is done only with them."""
    from fdl.rundir.config import read_config
    from fdl.rundir.layout import log_path, logs_dir
    from fdl.rundir.summary import has_summary

    if not log_path(logs_dir(spec.run_dir), 0).is_file() or has_summary(spec.run_dir):
        return False
    return "engine" in read_config(spec.run_dir, hint="")


def _report_done(spec: LaunchSpec, *, done: bool = True) -> None:
    from fdl import console
    from fdl.rundir.summary import has_summary

    if has_summary(spec.run_dir):  # the script trained with fdl's engine
        from fdl.cli.report import render
        from fdl.rundir.report import run_report

        render(run_report(spec.run_dir))
    if done:
        console.info(f"fdl run: done; run directory {spec.run_dir}")


def _warn_unread_settings(spec: LaunchSpec) -> None:
    """One line naming the engine settings given to a script that never used the engine (on
    the node of rank 0, which is where the engine records that it ran)."""
    from fdl import console
    from fdl.rundir.config import read_config, unread_engine_settings
    from fdl.rundir.layout import log_path, logs_dir
    from fdl.settings import BY_NAME

    if not log_path(logs_dir(spec.run_dir), 0).is_file():
        return
    unread = unread_engine_settings(read_config(spec.run_dir, hint=""))
    if unread:
        named = ", ".join(f"{name} ({BY_NAME[name].source_name(source)})"
                          for name, source in unread)
        console.warn(f"the script did not train with fdl (fdl.init or fdl.Trainer), so these "
                     f"settings were never read: {named}")


def _summary_stamp(spec: LaunchSpec) -> int | None:
    """When summary.json was last written (ns), None without one."""
    from fdl.rundir.summary import FILE

    try:
        return (spec.run_dir / FILE).stat().st_mtime_ns
    except OSError:
        return None


def _report_stopped(result: LaunchResult, spec: LaunchSpec, *, finished: bool = False) -> None:
    """``finished``: this launch's workers wrote summary.json (the signal came as they ended)."""
    from fdl import console

    if result.interrupted:
        console.error(_interrupted_line(result, spec, finished=finished))
        return
    cause = result.root_cause
    assert cause is not None, "a failed launch names its root cause"
    how = f"was killed by {cause.signal}" if cause.signal else f"exited with code {cause.exit_code}"
    what = cause.signal or f"exit code {cause.exit_code}"
    header = f"root cause: rank {cause.rank} (local rank {cause.local_rank}), {what}"
    if cause.crash is not None:
        console.info(f"{header}, raised{' in your code' if cause.crash.frame else ''}:")
        lines = [*cause.crash.frame, *cause.crash.error]
    else:
        console.info(f"{header}; last lines of its log:")
        lines = list(cause.tail) or ["(the log is empty)"]
    for line in lines:
        console.info(f"  | {line}")
    console.error(f"worker rank {cause.rank} {how}; the other workers were stopped",
                  hint=f"full log: {cause.log}")


def _stopped_by_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM while no worker runs (the plan's probes, the rendezvous, the end's report): one
    error line and exit 143, as after the workers, instead of a silent death."""
    from fdl.errors import FdlError

    raise FdlError("fdl run: stopped by SIGTERM while no worker was running",
                   hint="run the same command again (fdl run --resume RUN_DIR continues a run "
                        "that wrote a checkpoint)", exit_code=128 + signum)


def _interrupted_line(result: LaunchResult, spec: LaunchSpec, *, finished: bool = False) -> str:
    """Where the run stopped and what can resume it, in one line."""
    from fdl.rundir.layout import logs_dir
    from fdl.rundir.stop_point import stop_point

    stopped = "interrupted" if result.stop_signal in (None, "SIGINT") else \
        f"stopped by {result.stop_signal}"
    if finished:  # the signal came as the run ended: nothing left to do
        from fdl.rundir import model, summary

        return (f"{stopped} once the run had finished: {summary.FILE} and {model.FILE} are in "
                f"{spec.run_dir}; nothing to resume")
    point = stop_point(spec.run_dir)
    if point is None:  # the script never trained with fdl's engine here
        return f"{stopped}: all workers stopped; their logs are in {logs_dir(spec.run_dir)}"
    if point.checkpoint is not None:
        then = f"resume with: fdl run --resume {spec.run_dir}"
    else:
        then = ("no checkpoint was written, so it cannot resume (--checkpoint-every N writes "
                "one every N epochs, or 10m every 10 minutes)")
    return f"{stopped} {point.where()}, all workers stopped; {then}"


@contextlib.contextmanager
def _join_watch(spec: LaunchSpec) -> Iterator[None]:
    """A multi-node run: the live count of the nodes at the rendezvous while this one waits
    (fdl.launch.joining)."""
    if spec.network is None or not spec.network.several_nodes:
        yield
        return
    from fdl import console
    from fdl.launch.joining import JoinWatch
    from fdl.launch.rendezvous import parse_endpoint

    rdzv = spec.rendezvous
    host, port = parse_endpoint(rdzv.endpoint, flag="--rdzv-endpoint", default_port=0,
                                min_port=0)
    watch = JoinWatch(host, port, run_id=rdzv.run_id, nodes=rdzv.min_nodes, say=console.info,
                      endpoint=rdzv.endpoint).start()
    try:
        yield
    finally:
        watch.stop()


def _waiting_line(spec: LaunchSpec) -> str:
    """What a node of a multi-node run waits for, before torch's rendezvous blocks."""
    from fdl.launch.elastic import JOIN_TIMEOUT_S

    rdzv, network = spec.rendezvous, spec.network
    assert network is not None
    nodes = f"{rdzv.min_nodes}" if rdzv.min_nodes == rdzv.max_nodes else \
        f"{rdzv.min_nodes} to {rdzv.max_nodes}"
    role = {True: "this node hosts it", False: "this node joins it",
            None: "on loopback"}[network.hosts_rendezvous]
    return (f"fdl run: waiting for {nodes} nodes at {rdzv.endpoint} ({role}, as "
            f"{network.local_addr}; run id {rdzv.run_id}; up to {JOIN_TIMEOUT_S // 60} min)")


def _loopback_name_line(local_addr: str) -> str:
    import socket

    return (f"this host's name ({socket.gethostname()}) resolves to loopback: fdl gives the "
            f"other nodes {local_addr}, from the routes, but a program that resolves the name "
            "itself (torchrun alone, a script passing it as MASTER_ADDR) would give them "
            "127.0.0.1; fix /etc/hosts if one does")


def _network_line(network: dict[str, Any]) -> str:
    """fdl.launch.network's choice, in one line."""
    if "problem" in network:
        return f"not decided here: {network['problem']} (fdl run refuses this)"
    exported = ", ".join(network["env"]) or "nothing"
    kept = f"; yours kept: {', '.join(network['user_set'])}" if network["user_set"] else ""
    if not network["several_nodes"]:
        return f"one node: on loopback ({network['interface']}; exported: {exported}{kept})"
    hosts = network["hosts_rendezvous"]
    role = ("hosts the rendezvous" if hosts else
            f"joins the rendezvous at {network['endpoint_address']}" if hosts is not None else
            "meets on loopback (the first launcher hosts)")
    where = f"on {network['interface']}" if network["interface"] else "on no interface of its own"
    loopback = "; this host's name resolves to loopback (fdl uses the address above)" \
        if network.get("hostname_on_loopback") else ""
    return (f"{network['family']}; this node {role}, as {network['local_addr']} {where} "
            f"(exported: {exported}{kept}){loopback}")


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
        *([("network", _network_line(document["network"]))] if document["network"] else []),
        *([("kernels", "; ".join(document["kernel_check"]) or "every worker's torch has "
                       "kernels for its GPU")] if document["kernel_check"] is not None else []),
        ("max restarts", document["max_restarts"]),
        ("run directory", document["run_dir"]),
    ])
    console.print_table(["local rank", "rank", "device", "python"],
                        [[w["local_rank"], w["rank"] if w["rank"] is not None else "at rendezvous",
                          w["device"], w["python"]] for w in document["workers"]],
                        title="Workers")
    if document["interpreters"]:
        console.print_table(["local rank", "Python", "fdl", "torch"],
                            [[i["local_rank"], i["python_version"], i["fdl"], i["torch"]]
                             for i in document["interpreters"]],
                            title="--worker-python: checked alike (Python, fdl, torch release)")
    console.print_table(["setting", "value", "source"],
                        [[k, v["value"], v["source"]] for k, v in document["settings"].items()],
                        title="Settings")
    console.print_table(["variable", "value"], list(document["env"].items()),
                        title="Environment added to every worker (besides torchrun's)")
