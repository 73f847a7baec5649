"""The ``fdl`` command and the one place where errors become text and exit codes.

Exit codes are interface: 0 ok, 1 failure, 2 usage (bad flags, bad config), 130 on Ctrl-C;
``fdl run`` returns the failing worker's code. A user error prints ``error: ...`` and
``hint: ...`` on stderr and no traceback; ``FDL_DEBUG=1`` adds the traceback. An ``OSError``
the library let through (permission denied, a read-only filesystem, a name too long, no space)
is one ``error:`` line too, naming the path and what the OS said, with a hint by errno
(``fdl.errors.os_failure``), exit 1.

This module imports only typer, the standard library and ``fdl.errors`` at module level:
``fdl --help`` must not load torch, httpx, pynvml or rich.progress (tests/test_startup.py).
"""

from __future__ import annotations

import sys
import traceback
from typing import Annotated, Any

import typer
from typer.core import TyperGroup
from typer.exceptions import TyperException

from fdl.errors import FdlError, os_failure
from fdl.version import __version__


def _report(exc: FdlError) -> None:
    from fdl import console
    from fdl.settings import debugging

    if debugging():
        traceback.print_exception(exc, file=sys.stderr)
    console.error(exc.message, exc.hint)


class FdlGroup(TyperGroup):
    """Turns FdlError, usage mistakes and Ctrl-C into one-line messages and exit codes.

    Overriding ``main`` (rather than wrapping ``app()``) makes the console script, ``python -m
    fdl`` and typer's CliRunner behave identically.
    """

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as exc:  # typer would turn it into a silent Exit(130)
            raise typer.Abort() from exc

    def main(self, args: Any = None, prog_name: Any = None, complete_var: Any = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        args = _filled(args)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            code = rv if isinstance(rv, int) else 0
        except FdlError as exc:
            _report(exc)
            code = exc.exit_code
        except TyperException as exc:  # click-level usage errors: unknown option, missing arg
            if type(exc).__name__ == "NoArgsIsHelpError":  # `fdl` / `fdl libtorch` alone: help
                sys.stderr.write(exc.format_message() + "\n")
                code = 2
            else:
                _usage_error(exc, args)
                code = getattr(exc, "exit_code", 2)
        except (KeyboardInterrupt, typer.Abort):
            sys.stderr.write("\ninterrupted\n")
            code = 130
        except OSError as exc:  # the safety net: a failure the library did not name itself
            _report(_os_failure(exc))
            code = 1
        if standalone_mode:
            sys.exit(code)
        return code


def _os_failure(exc: OSError) -> FdlError:
    """An OSError that escaped the library as one ``error:`` line (the path, what the OS said)
    and a hint by errno; chained to it, so that ``FDL_DEBUG=1`` shows where it was raised."""
    failure = os_failure(exc)
    failure.__cause__ = exc
    return failure


def _filled(args: Any) -> list[str]:
    """``fdl run``'s optional-value flags written out (``--tensorboard`` -> ``--tensorboard
    on``): the command line parser knows only options that always or never take a value; and
    ``fdl compare``'s fdl run options moved after SCRIPT (:func:`hoist_run_options`)."""
    argv = list(sys.argv[1:] if args is None else args)
    if argv[:1] == ["compare"]:  # fdl run's options before SCRIPT go after it, where it reads them
        from fdl.cli.compare import hoist_run_options

        return ["compare", *hoist_run_options(argv[1:])]
    if argv[:1] != ["run"]:
        return argv
    from fdl.settings import fill_bare_flags

    return ["run", *fill_bare_flags(argv[1:])]


def _usage_error(exc: TyperException, args: Any) -> None:
    _report(FdlError(exc.format_message(), hint=_usage_hint(args),
                     exit_code=getattr(exc, "exit_code", 2)))


def _usage_hint(args: Any) -> str:
    argv = list(sys.argv[1:] if args is None else args)
    words = [word for word in argv[:1] if not word.startswith("-")]
    return f"see `fdl {' '.join(words)} --help`".replace("  ", " ")


app = typer.Typer(
    cls=FdlGroup,
    name="fdl",
    help="Train PyTorch models on the hardware you own.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain help text: typer's rich renderer imports markdown-it and friends for a few colours,
    # a large share of `fdl --help`'s start-up (the figures: docs/cli.md, first section).
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        sys.stdout.write(f"fdl {__version__}\n")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", "-V", callback=_version, is_eager=True,
                     help="Print fdl's version and exit."),
    ] = False,
) -> None:
    """Train PyTorch models on the hardware you own."""


def _register() -> None:
    # Each command module imports only typer/stdlib/fdl.errors at module level.
    from fdl.cli import diagnose, init, report, run, setup

    app.command("diagnose")(diagnose.diagnose)
    app.command("init")(init.init)
    app.command("run", context_settings=run.RUN_CONTEXT)(run.run)
    app.command("setup")(setup.setup)
    app.command("report")(report.report)

    from fdl.cli import libtorch
    from fdl.cli.libtorch import build, download

    libtorch.libtorch_app.command("download")(download.download)
    libtorch.libtorch_app.command("build")(build.build)
    app.add_typer(libtorch.libtorch_app, name="libtorch")

    from fdl.cli import bench, compare

    app.add_typer(bench.bench_app, name="bench")
    app.command("compare", context_settings=compare.COMPARE_CONTEXT)(compare.compare)


_register()


def main() -> None:
    app(prog_name="fdl")


if __name__ == "__main__":
    main()
