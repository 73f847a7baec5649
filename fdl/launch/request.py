"""``fdl run``'s command line as data: a :class:`RunRequest` holds the script, its arguments and
the flags as given, named by the settings contract (:data:`fdl.settings.RUN_FLAGS`).

fdl run's own options are fdl's wherever they appear, so the documented
``fdl run train.py --policy async --nproc-per-node 2`` works (:func:`split_script_args`).
Everything after a ``--`` belongs to the script untouched (the way to hand a script an option
named like one of fdl's).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from fdl.errors import UsageError
from fdl.settings import BY_NAME, OPTIONS_BY_NAME, RUN_FLAGS, as_flags, takes_bare


@dataclass(frozen=True)
class RunRequest:
    """The flags of ``fdl run`` as given: ``flags`` maps a name of
    :data:`~fdl.settings.RUN_FLAGS` to its value; a flag not given is absent (or None/False)."""

    script: str | None
    script_args: tuple[str, ...] = ()
    flags: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.flags) - set(RUN_FLAGS))
        if unknown:  # a programming error: the CLI only builds known names
            raise ValueError(f"unknown fdl run flag(s): {', '.join(unknown)}")

    def get(self, name: str) -> Any:
        """The value given for flag ``name``: None when not given (False for a switch)."""
        if name not in RUN_FLAGS:
            raise KeyError(name)
        value = self.flags.get(name)
        if value is None and _is_switch(name):
            return False
        return value

    def with_flags(self, **changes: Any) -> RunRequest:
        return replace(self, flags={**self.flags, **changes})


def _is_switch(name: str) -> bool:
    option = OPTIONS_BY_NAME.get(name)
    return option is not None and option.kind == "bool"


def flag_names() -> dict[str, str]:
    """``--flag`` (as typed) -> contract name, for every fdl run flag."""
    names = {BY_NAME[name].flag_name: name for name in RUN_FLAGS if name in BY_NAME}
    names.update({option.flag_name: option.name for option in OPTIONS_BY_NAME.values()})
    names.update({option.short: option.name for option in OPTIONS_BY_NAME.values()
                  if option.short})
    return names


def split_script_args(args: tuple[str, ...]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """``("--policy", "async", "--lr", "0.1")`` -> ``({"policy": "async"}, ("--lr", "0.1"))``.

    ``-m``/``--module`` after SCRIPT are the script's own."""
    names = {flag: name for flag, name in flag_names().items()
             if flag.startswith("--") and getattr(OPTIONS_BY_NAME.get(name), "after_script", True)}
    claimed: dict[str, Any] = {}
    kept: list[str] = []
    items = list(args)
    while items:
        arg = items.pop(0)
        if arg == "--":
            kept.extend(items)
            break
        flag, eq, value = arg.partition("=")
        name = names.get(flag)
        if name is None or (_is_switch(name) and eq):
            kept.append(arg)
        elif _is_switch(name):
            claimed[name] = True
        else:
            if not eq and (bare := takes_bare(flag, items[0] if items else None)) is not None:
                claimed[name] = bare
                continue
            if not eq:
                if not items:
                    raise UsageError(f"{flag} needs a value", hint=f"e.g. {flag} <value>")
                value = items.pop(0)
            claimed[name] = typed_value(name, value, flag=flag)
    return claimed, tuple(kept)


def flags_argv(flags: Mapping[str, Any]) -> list[str]:
    """fdl run's command-line words for ``flags`` (contract name -> value; True: a switch):
    the inverse of :func:`split_script_args`."""
    argv: list[str] = []
    for name, value in flags.items():
        if name in BY_NAME:
            argv += as_flags({name: value})
        else:
            flag = OPTIONS_BY_NAME[name].flag_name
            argv += [flag] if value is True else [flag, str(value)]
    return argv


def typed_value(name: str, value: str, *, flag: str) -> Any:
    """A flag's text as its option's type (int options only; settings parse their own text)."""
    option = OPTIONS_BY_NAME.get(name)
    if option is None or option.kind != "int":
        return value
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"{flag} must be an integer, got {value!r}",
                         hint=f"e.g. {flag} 1") from None
