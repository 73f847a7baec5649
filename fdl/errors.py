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


# The hint for each errno a user can act on; any other gets the generic one.
_OS_HINTS = {
    "EACCES": "permission denied: check the ownership and permissions of that path",
    "EPERM": "the operation is not permitted there: check the ownership and permissions of "
             "that path",
    "EROFS": "that filesystem is mounted read-only: choose a writable place, or remount it "
             "read-write",
    "ENAMETOOLONG": "a name there is longer than the filesystem allows (255 bytes per name on "
                    "most): choose a shorter one",
    "ENOSPC": "no space left on that device: free some space, or choose another place",
    "EDQUOT": "the disk quota is used up: free some space, or choose another place",
}
_OS_HINT = "the operating system refused it; FDL_DEBUG=1 shows where it happened"


def os_failure(exc: OSError, *, doing: str | None = None,
               exit_code: int | None = None) -> FdlError:
    """An ``OSError`` as fdl's one line: what fdl was doing (``doing``, e.g. "cannot change the
    libtorch store"), the path the OS named (both paths of a rename), what the OS said, and a
    hint chosen by errno. ``raise os_failure(exc, doing=...) from exc`` where the operation is
    known; ``fdl/cli/main.py`` applies it (without ``doing``) to any OSError that escapes.
    ``exit_code``: 1 unless given (2 where the path is the user's input, nothing started)."""
    import errno

    paths = [str(name) for name in (exc.filename, exc.filename2) if name is not None]
    parts = [doing] if doing else []
    if paths:
        parts.append(" -> ".join(paths))
    parts.append(exc.strerror or str(exc) or type(exc).__name__)
    hint = _OS_HINTS.get(errno.errorcode.get(exc.errno or 0, ""), _OS_HINT)
    return FdlError(": ".join(parts), hint=hint, exit_code=exit_code)
