"""The one error family of fdl.

Library code raises these; only ``fdl/cli/main.py`` turns them into ``error: ...`` and
``hint: ...`` on stderr and an exit code. Messages name the field, the bad value and what is
allowed, so a user never needs a traceback (``FDL_DEBUG=1`` shows one anyway).
"""

from __future__ import annotations


class FdlError(Exception):
    """A failure a user can act on. ``exit_code`` is what ``fdl`` exits with (1 unless set)."""

    exit_code: int = 1

    def __init__(self, message: str, *, hint: str | None = None, exit_code: int | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        if exit_code is not None:
            self.exit_code = exit_code


class UsageError(FdlError):
    """Bad input on the command line or in a config file: exit 2, nothing started."""

    exit_code = 2


class ConfigError(UsageError):
    """A config file (fdl.toml, pyproject's [tool.fdl]) or FDL_* variable that cannot be used."""


class SurveyError(FdlError):
    """The host survey was given something it cannot read (e.g. a bad FDL_GPU_SURVEY file)."""


class MissingTorchError(UsageError):
    """torch is needed for this command and is not installed: a set-up problem, exit 2."""

    def __init__(self, what: str = "this command"):
        super().__init__(
            f"torch is not installed; {what} needs it",
            hint="pip install 'fdl[torch]'  (`fdl diagnose` shows which build fits your GPUs)",
        )
