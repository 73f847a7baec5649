"""The run directory of ``fdl run``: checked, then created before workers start, ``config.json``
first.

``runs/<UTC time>-<script stem>-<policy>/`` (or ``--run-dir``) holds ``config.json`` (every
setting with its value and source, the launch spec), ``logs/rank<r>.log`` (each worker's stdout
and stderr; an earlier attempt's log is kept as ``rank<r>.attempt<k>.log`` on restart),
``logs/rank<r>.crash.json`` (what ended a worker that raised, fdl.rundir.crash),
``logs/agent.log`` (torch's agent's own log lines), and
what the engine writes (metrics, timeline, summary.json, model.pt, checkpoints).

One directory holds one run. A new run needs a directory that does not exist or is empty;
``--resume`` continues the run a directory holds; ``--overwrite-run-dir`` replaces it, but only
a directory that holds nothing but what ``fdl run`` writes (:data:`RUN_ENTRIES`): a typo such as
``--run-dir ~`` never deletes anything. The nodes of a multi-node run may share one (a shared
filesystem): the first makes it, the others join it (:func:`join_or_prepare_run_dir`), each rank
writing its own log and timeline and each joining node's agent its own
``logs/agent-<address>.log``.

Nothing is written through a symbolic link: a run directory that is one is refused (by every
use), so are links planted among the files a resumed run writes again by name (its top-level
entries, ``logs/``, ``timeline/``: :func:`planted_entry`), and ``--overwrite-run-dir`` removes a
link, never what it points at. fdl.files.open_for_writing refuses them again where the files are
opened.
"""

from __future__ import annotations

import os
import shutil
import stat
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

from fdl import readback
from fdl.errors import UsageError
from fdl.rundir import checkpoints, config, metrics, model, progress, summary, timeline

LOGS = "logs"
AGENT_LOG = "agent.log"  # in logs/: torch's agent's own log lines
TENSORBOARD = "tensorboard"  # the default directory of --tensorboard
# What fdl run and the engine write at the top of a run directory, each name from the module
# that owns the file; fdl.files's temporary files beside the files are ".<name>.<random>.tmp".
RUN_ENTRIES = frozenset({config.FILE, LOGS, metrics.FILE, summary.FILE, model.FILE,
                         checkpoints.DIRNAME, timeline.DIRNAME, progress.FILE, TENSORBOARD})


def check_run_dir(run_dir: Path, *, use: str) -> None:
    """Raise a usage error unless ``run_dir`` may be used as ``use`` says (``"new"``,
    ``"resume"`` or ``"overwrite"``). Reads only: nothing is created or deleted here."""
    _refuse_links(run_dir, use=use)
    if use == "resume":
        return
    if not run_dir.exists():
        return
    if not run_dir.is_dir():
        raise UsageError(f"run directory {run_dir} is not a directory",
                         hint="pass --run-dir DIR with a new or empty directory")
    entries = [name for name in _entries(run_dir) if name != OVERWRITING]
    if not entries:
        return
    if not config.holds_a_run(run_dir):
        raise UsageError(f"run directory {run_dir} is not empty and holds no fdl run",
                         hint="pass --run-dir DIR with a new or empty directory")
    if use == "new":
        raise UsageError(f"run directory {run_dir} holds an earlier run",
                         hint=f"--resume {run_dir} continues it, --overwrite-run-dir replaces "
                              "it, or pass another --run-dir")
    foreign = sorted(name for name in entries if not _is_run_entry(name))
    if foreign:
        raise UsageError(f"run directory {run_dir} holds files fdl run did not write "
                         f"({', '.join(foreign[:5])}); not replacing it",
                         hint="move them away, or pass another --run-dir")


# The folders whose files a resumed run opens again by name (a rank's log, its timeline)
LINK_CHECKED = (LOGS, timeline.DIRNAME)


def _refuse_links(run_dir: Path, *, use: str) -> None:
    """A usage error when ``run_dir`` is a symbolic link, or (``use`` ``"resume"``) holds one
    where a resumed run writes, or something else than fdl wrote there (:func:`planted_entry`)."""
    if run_dir.is_symlink():
        raise UsageError(f"run directory {run_dir} is a symbolic link; fdl does not write a run "
                         "through a link",
                         hint=f"name the directory itself ({os.path.realpath(run_dir)})")
    planted = planted_entry(run_dir) if use == "resume" else None
    if planted is not None:
        path, what = planted
        raise UsageError(f"run directory {run_dir} holds {path.relative_to(run_dir)}, {what}; "
                         "fdl writes its own files there",
                         hint="remove it (fdl writes its file anew), then resume again")


RUN_FOLDERS = frozenset({LOGS, checkpoints.DIRNAME, timeline.DIRNAME, TENSORBOARD})


def planted_entry(run_dir: Path) -> tuple[Path, str] | None:
    """The first of ``run_dir``'s own entries (:data:`RUN_ENTRIES`) and the files of
    :data:`LINK_CHECKED` that fdl did not make as it is, with what it is instead: a symbolic
    link (fdl never makes one: it is planted), a folder where fdl writes a file, or a file or
    FIFO where it keeps a folder or a file. None when there is none."""
    candidates = [(run_dir / name, name in RUN_FOLDERS) for name in sorted(RUN_ENTRIES)]
    for name in LINK_CHECKED:
        folder = run_dir / name
        if folder.is_dir() and not folder.is_symlink():
            candidates += [(folder / entry, False) for entry in sorted(_entries(folder))]
    for path, is_folder in candidates:
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(mode):
            return path, "a symbolic link"
        if is_folder != stat.S_ISDIR(mode) or not (is_folder or stat.S_ISREG(mode)):
            return path, "not a folder" if is_folder else "not a regular file"
    return None


# A node of a multi-node run joins a run directory another node of the same run made (a shared
# filesystem) while the rendezvous can still be waiting for it: torch's join timeout.
JOIN_WINDOW_S = 900
CONFIG_WAIT_S = 10.0  # how long a joiner waits for the other node's config.json to land


def joinable(run_dir: Path, *, spec: dict[str, Any], fdl_version: str) -> bool:
    """Whether ``run_dir`` holds another node's part of the multi-node run ``spec`` describes,
    still meeting: its config.json, written within :data:`JOIN_WINDOW_S` by fdl
    ``fdl_version``, names the same rendezvous (backend, endpoint, run id), node count and
    script, and no worker has written anything yet (no timeline, no summary.json: the workers
    start only once every node is there, so a run that trained is never joined). Then this node
    joins it instead of making its own: one config, each rank's own logs and timeline
    (fdl.launch.elastic names a joining node's agent log by its address)."""
    if not _several_nodes(spec):
        return False
    try:
        written = (run_dir / config.FILE).stat().st_mtime
        document = config.read_config(run_dir, hint="", missing_ok=False)
    except (OSError, UsageError):
        return False
    if _workers_wrote(run_dir) or abs(time.time() - written) > JOIN_WINDOW_S:
        return False
    mine, theirs = spec.get("rendezvous"), document.get("rendezvous")
    same = ("backend", "endpoint", "run_id")
    return (isinstance(theirs, dict) and isinstance(mine, dict)
            and all(theirs.get(k) == mine.get(k) for k in same)
            and document.get(config.VERSION_KEY) == fdl_version
            and all(document.get(k) == spec.get(k) for k in ("nnodes", "script", "args")))


def _made_by_another_node(run_dir: Path, spec: dict[str, Any]) -> bool:
    """Whether the config.json of the run being resumed is another node's: a shared directory
    that node made (its network section names its own address). That node rewrites it on
    resume; this one joins, as it did when the run began, so one config stays, the maker's,
    whichever node starts first. Unreadable or missing: this node writes it (the resume's own
    checks have read it already)."""
    try:
        document = config.read_config(run_dir, hint="", missing_ok=False)
    except (OSError, UsageError):
        return False
    theirs, mine = document.get("network"), spec.get("network")
    return isinstance(theirs, dict) and isinstance(mine, dict) and \
        theirs.get("local_addr") != mine.get("local_addr")


def _workers_wrote(run_dir: Path) -> bool:
    """Whether the run in ``run_dir`` has begun training: a timeline or a summary.json."""
    return summary.has_summary(run_dir) or (run_dir / timeline.DIRNAME).exists()


def _several_nodes(spec: dict[str, Any]) -> bool:
    network = spec.get("network")
    return isinstance(network, dict) and network.get("several_nodes") is True


def join_or_prepare_run_dir(run_dir: Path, *, spec: dict[str, Any], fdl_version: str,
                            use: str = "new") -> bool:
    """:func:`check_run_dir` and :func:`prepare_run_dir`, except that a node of a multi-node
    run whose directory another node of it made (:func:`joinable`) joins it. True when it
    joined. Of two nodes that start at once, the one that loses the claim waits up to
    :data:`CONFIG_WAIT_S` for the winner's config.json and joins. With
    ``--overwrite-run-dir`` one node replaces the earlier run (it claims the replacement:
    :data:`OVERWRITING`); the others wait for it and join, so none deletes what another
    has just made. On ``--resume`` a node whose shared directory another node made joins it
    (:func:`_made_by_another_node`): only the maker rewrites config.json."""
    if use != "resume" and joinable(run_dir, spec=spec, fdl_version=fdl_version):
        return True
    if use == "resume" and _several_nodes(spec):
        check_run_dir(run_dir, use=use)
        if _made_by_another_node(run_dir, spec):  # shared: its maker rewrites config.json
            try:
                logs_dir(run_dir).mkdir(exist_ok=True)
            except OSError as exc:
                raise _unusable(run_dir, exc) from exc
            return True
    if use == "overwrite" and _several_nodes(spec) and run_dir.is_dir() \
            and not run_dir.is_symlink():  # a link: check_run_dir refuses it below
        if not _claim_overwrite(run_dir, spec):
            return _join_when_made(run_dir, spec=spec, fdl_version=fdl_version)
        try:
            check_run_dir(run_dir, use=use)
            prepare_run_dir(run_dir, spec=spec, fdl_version=fdl_version, use=use)
        finally:
            (run_dir / OVERWRITING).unlink(missing_ok=True)
        return False
    try:
        check_run_dir(run_dir, use=use)
        prepare_run_dir(run_dir, spec=spec, fdl_version=fdl_version, use=use)
    except UsageError:  # e.g. the other node claimed it a moment ago, its config.json to come
        if not _several_nodes(spec) or use == "resume" or not _being_made(run_dir):
            raise
        deadline = time.monotonic() + CONFIG_WAIT_S
        while time.monotonic() < deadline:
            if joinable(run_dir, spec=spec, fdl_version=fdl_version):
                return True
            time.sleep(0.1)
        raise
    return False


# A node of a multi-node run replacing the directory (--overwrite-run-dir) holds this file, with
# the run's id, until its config.json is written; a claim older than CLAIM_STALE_S was left by a
# launcher that died and is taken over.
OVERWRITING = ".fdl-overwriting"
CLAIM_STALE_S = 300.0
# A claim is made, then its run id written into it: an empty one is read again for this long
# before it counts as another run's (read at once, it once failed a node starting beside another).
CLAIM_WRITE_S = 2.0


def _claim_overwrite(run_dir: Path, spec: dict[str, Any]) -> bool:
    """Whether this node replaces ``run_dir`` (it made the claim); False when another node of
    the same run holds it. A claim of another run is a usage error."""
    marker, run_id = run_dir / OVERWRITING, _run_id(spec)
    for _ in range(2):
        try:
            handle = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            theirs = _claim_of(marker)
            deadline = time.monotonic() + CLAIM_WRITE_S
            while theirs == "" and time.monotonic() < deadline:  # made, its id still to come
                time.sleep(0.01)
                theirs = _claim_of(marker)
                if theirs is None:  # its maker has replaced the run meanwhile: join that
                    return False
            if theirs is None:  # gone meanwhile, stale, or not a claim (a link, a FIFO)
                with suppress(OSError):  # the entry itself, never a link's target
                    marker.unlink()
                continue
            if theirs != run_id:
                raise UsageError(f"run directory {run_dir} is being replaced by another fdl "
                                 "run", hint="pass another --run-dir") from None
            return False
        except OSError as exc:
            raise _unusable(run_dir, exc) from exc
        with os.fdopen(handle, "w") as out:
            out.write(run_id)
        return True
    raise UsageError(f"run directory {run_dir} is being replaced by another fdl run",
                     hint="pass another --run-dir")


def _claim_of(marker: Path) -> str | None:
    """The run id a claim holds; None when there is no claim to respect: it is gone, older than
    :data:`CLAIM_STALE_S`, or not a claim fdl writes (a link, a FIFO: readback refuses them)."""
    try:
        if time.time() - marker.lstat().st_mtime > CLAIM_STALE_S:
            return None
        return readback.read_text(marker, limit=4096)[:200]
    except (OSError, ValueError):
        return None


def _join_when_made(run_dir: Path, *, spec: dict[str, Any], fdl_version: str) -> bool:
    """Wait while another node of this run replaces ``run_dir``, then join it (True); a usage
    error when it never came to be."""
    deadline = time.monotonic() + CLAIM_STALE_S
    while (run_dir / OVERWRITING).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    deadline = time.monotonic() + CONFIG_WAIT_S
    while time.monotonic() < deadline:
        if joinable(run_dir, spec=spec, fdl_version=fdl_version):
            return True
        time.sleep(0.1)
    raise UsageError(f"run directory {run_dir} was being replaced by another node of this run, "
                     "which did not finish", hint="start the nodes again, or pass another "
                                                   "--run-dir")


def _run_id(spec: dict[str, Any]) -> str:
    rendezvous = spec.get("rendezvous")
    return str(rendezvous.get("run_id")) if isinstance(rendezvous, dict) else ""


def _being_made(run_dir: Path) -> bool:
    """Whether another launcher is making ``run_dir`` now: it claimed it (``logs/``), no worker
    has written anything, and its config.json is not there yet or only just written."""
    if _workers_wrote(run_dir):
        return False
    try:
        return time.time() - (run_dir / config.FILE).stat().st_mtime < CONFIG_WAIT_S
    except OSError:
        return logs_dir(run_dir).is_dir()


def prepare_run_dir(run_dir: Path, *, spec: dict[str, Any], fdl_version: str,
                    use: str = "new") -> Path:
    """Create ``run_dir`` and ``run_dir/logs`` (after removing the earlier run when ``use`` is
    ``"overwrite"``) and write ``config.json`` (the launch ``spec``) atomically. Call
    :func:`check_run_dir` first.

    A new run claims the directory by creating ``logs/``: of two ``fdl run`` started at once
    with the same directory, the second is refused instead of mixing its run into the first."""
    try:
        if use == "overwrite":
            _remove_run(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(run_dir, os.W_OK):
            raise PermissionError(f"{run_dir} is not writable")
        logs_dir(run_dir).mkdir(exist_ok=use == "resume")
        config.write_config(run_dir, spec, fdl_version=fdl_version)
    except FileExistsError as exc:
        raise UsageError(f"run directory {run_dir} is being used by another fdl run",
                         hint="pass another --run-dir") from exc
    except OSError as exc:
        raise _unusable(run_dir, exc) from exc
    return run_dir


def _unusable(run_dir: Path, exc: OSError) -> UsageError:
    return UsageError(f"cannot use run directory {run_dir}: {exc.strerror or exc}",
                      hint="pass --run-dir DIR with a writable directory")


def _entries(run_dir: Path) -> list[str]:
    try:
        return os.listdir(run_dir)
    except OSError as exc:
        raise _unusable(run_dir, exc) from exc


def _is_run_entry(name: str) -> bool:
    if name in RUN_ENTRIES or name == OVERWRITING:
        return True
    if name.startswith(".") and name.endswith(".tmp"):  # fdl.files's, left by a kill
        return name[1:-len(".tmp")].rsplit(".", 1)[0] in RUN_ENTRIES
    return False


def _remove_run(run_dir: Path) -> None:
    """Delete the earlier run: fdl's entries only, each checked again (by name) right before.
    No directory yet: nothing to replace (``--overwrite-run-dir`` on a first run). A link is
    removed itself (``unlink``), and ``shutil.rmtree`` does not follow links inside a folder."""
    if run_dir.is_symlink():
        raise UsageError(f"run directory {run_dir} is a symbolic link; not replacing it",
                         hint=f"name the directory itself ({os.path.realpath(run_dir)})")
    if not run_dir.exists():
        return
    for name in _entries(run_dir):
        if not _is_run_entry(name):
            raise UsageError(f"run directory {run_dir} holds {name}, which fdl run did not "
                             "write; not replacing it", hint="move it away, or pass another "
                                                             "--run-dir")
    for name in _entries(run_dir):
        path = run_dir / name
        if name == OVERWRITING:  # this node's claim: kept until its config.json is written
            continue
        if stat.S_ISDIR(path.lstat().st_mode):
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def logs_dir(run_dir: Path) -> Path:
    return run_dir / LOGS


def log_path(logs: Path, rank: int | str, *, attempt: int | None = None) -> Path:
    """``logs/rank<r>.log``: rank r's stdout and stderr; an earlier attempt's, after a restart,
    is kept as ``rank<r>.attempt<k>.log``."""
    return logs / (f"rank{rank}.log" if attempt is None else f"rank{rank}.attempt{attempt}.log")


def agent_log_path(logs: Path, *, node: str | None = None) -> Path:
    """``logs/agent.log``: what torch's elastic agent logged in the launcher (its warnings and
    errors), kept off the terminal (fdl.launch.terminal); ``logs/agent-<node>.log`` for a node
    that joined another's run directory (``node``: its address)."""
    if node is None:
        return logs / AGENT_LOG
    return logs / f"agent-{''.join(c if c.isalnum() or c in '.-' else '_' for c in node)}.log"


def error_file(logs: Path, rank: int | str) -> Path:
    """Where torchelastic's ``@record`` writes rank r's error (TORCHELASTIC_ERROR_FILE)."""
    return logs / f".rank{rank}.error.json"


def tensorboard_dir(run_dir: Path | None) -> Path:
    """``--tensorboard``'s default directory (``runs/tensorboard`` without a run directory)."""
    return (run_dir if run_dir is not None else Path("runs")) / TENSORBOARD


TAIL_BYTES = 64 << 10  # the last lines of a log, however long it grew


def tail_lines(path: Path, count: int = 20) -> list[str]:
    """The last ``count`` lines of a log file, from its last :data:`TAIL_BYTES` (empty when it
    does not exist, cannot be read, or is not a regular file: fdl.readback)."""
    try:
        with readback.open_regular(path) as handle:
            handle.seek(max(0, os.fstat(handle.fileno()).st_size - TAIL_BYTES))
            data = handle.read(TAIL_BYTES)
    except (OSError, ValueError):
        return []
    return data.decode("utf-8", errors="replace").splitlines()[-count:]
