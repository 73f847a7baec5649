"""Boolean flags as people type them: `--dry-run`, `--no-activate`, `--quiet-ranks`, never a
`--no-no-activate` or `--no-dry-run` that typer adds to a bare `bool` option.

Walks the whole command tree of the typer app in-process (click's objects, no subprocesses):
every command and group, `fdl run` included.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from typer.main import get_command

from fdl.cli.main import app

# The on/off pairs fdl offers on purpose: both spellings are something a person types.
MEANT_PAIRS = {("fdl init", "--docker", "--no-docker"),
               ("fdl libtorch build", "--docker", "--native")}
EVERY_COMMAND = {"fdl", "fdl diagnose", "fdl init", "fdl run", "fdl setup", "fdl report",
                 "fdl libtorch", "fdl libtorch download", "fdl libtorch build",
                 "fdl libtorch list", "fdl bench", "fdl bench report", "fdl compare"}


def commands() -> Iterator[tuple[str, Any]]:
    """(``"fdl libtorch download"``, its click command) for every command and group."""
    def walk(command: Any, path: str) -> Iterator[tuple[str, Any]]:
        yield path, command
        for name, sub in sorted((getattr(command, "commands", None) or {}).items()):
            yield from walk(sub, f"{path} {name}")

    yield from walk(get_command(app), "fdl")


def options(command: Any) -> list[Any]:
    return [p for p in command.params if p.param_type_name == "option"]


def help_text(path: str, command: Any) -> str:
    context = command.make_context(path.rsplit(" ", 1)[-1], [], resilient_parsing=True)
    return command.get_help(context)


COMMANDS = dict(commands())


def test_the_walk_reaches_every_command():
    assert set(COMMANDS) >= EVERY_COMMAND


def test_no_option_offers_a_negation_it_did_not_mean():
    offered = {(path, opt.opts[0], secondary) for path, command in COMMANDS.items()
               for opt in options(command) for secondary in opt.secondary_opts}
    assert offered == MEANT_PAIRS


@pytest.mark.parametrize("path", sorted(COMMANDS))
def test_help_shows_only_the_flags_people_type(path):
    text = help_text(path, COMMANDS[path])
    assert "--no-no-" not in text
    pairs = set(re.findall(r"(--[\w-]+) / (--[\w-]+)", text))
    assert pairs == {(on, off) for where, on, off in MEANT_PAIRS if where == path}


@pytest.mark.parametrize("path", sorted(COMMANDS))
def test_typing_a_flag_does_what_its_name_says(path):
    # A lone `--no-activate` on a parameter whose default is already True would be a flag that
    # does nothing: a lone flag flips the default; a meant pair says on, then off.
    command = COMMANDS[path]
    for opt in options(command):
        if not opt.is_bool_flag or opt.is_eager:  # --help, --version exit instead
            continue
        if opt.secondary_opts:
            typed = [(opt.opts[0], True), *((off, False) for off in opt.secondary_opts)]
        else:
            typed = [(name, not opt.default) for name in opt.opts]
        for name, expected in typed:
            parsed = command.make_context(path, [name], resilient_parsing=True).params
            assert parsed[opt.name] is expected, (path, name)
