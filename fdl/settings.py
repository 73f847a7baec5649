"""The settings contract: every run and engine setting, and every ``fdl run`` option, defined once.

A **setting** (:data:`SETTINGS`) has a name (the ``fdl.toml`` key and the ``Trainer`` argument),
a default, a parser that accepts text or a typed value and raises ``UsageError`` naming what is
allowed (a number: its :class:`Range`, stated beside the parsers; a bool is never a number,
nor are NaN and infinity), help text, and the sources it may come from:

* ``--flag`` of ``fdl run`` (``flag=True``; the flag is the name with dashes),
* an ``FDL_*`` variable (``env``),
* a key of ``fdl.toml`` or ``[tool.fdl]`` in ``pyproject.toml`` (``file=True``),
* an argument of ``fdl.Trainer`` in the script (``script=True``).

Precedence, highest first: flag > ``FDL_*`` > ``fdl.toml`` > script > default. ``fdl run``
resolves the first three (:func:`resolve_run_settings`) and hands every engine setting
(``engine=True``) not left at its default to the workers as its ``FDL_*`` variable
(:func:`engine_env`, part of the worker environment fdl.launch.worker_env makes), with
``FDL_SOURCES`` saying where each came from; each worker's engine resolves ``FDL_*`` > script >
default (:func:`resolve_engine_settings`, from ``fdl.engine.config``). A **launch option**
(:data:`LAUNCH_OPTIONS`) is a flag of ``fdl run`` only (torchrun's rendezvous flags,
``--resume``, ``--dry-run`` ...).

Adding a setting is one :class:`SettingSpec` here plus its line in docs/run.md: ``fdl run``'s
options, the launch request, ``fdl.toml`` parsing, the engine's config, the bench's cell flags
and every environment scrub derive from these tables.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fdl.errors import ConfigError, UsageError
from fdl.ranges import (
    BATCH_SIZES,
    COLLECTIVE_TIMEOUTS_S,
    DIVERGENCE_THRESHOLDS,
    EPOCHS,
    MICRO_BATCHES,
    MOMENTUMS,
    OUTER_LRS,
    OVERHEAD_TARGETS,
    RESTARTS,
    SAMPLES,
    SEEDS,
    SLOWDOWNS,
    STEPS,
    TIMES_S,
    WORKERS_PER_NODE,
    Range,
    number_text,
    parse_in,
    parse_whole,
    real,
    shortened,
    whole,
)

POLICIES = ("sync", "cadence", "async")
# what --policy takes: a policy, or auto (chosen after calibration: fdl.engine.policies)
POLICY_CHOICES = (*POLICIES, "auto")
BACKENDS = ("auto", "nccl", "cpu")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")  # what each means: fdl.engine.precision
OFF = ("off", "none")  # a budget (max_steps ...) given as one of these is no budget
TIME_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
SOURCES_ENV = "FDL_SOURCES"  # JSON {name: source}, so workers can record provenance
RUN_DIR_ENV = "FDL_RUN_DIR"  # always set by fdl run: where the workers write
RESUME_ENV = "FDL_RESUME"  # "1": load the newest valid checkpoint (fdl run --resume)
LAUNCHER_PID_ENV = "FDL_LAUNCHER_PID"  # the workers die with the launcher (fdl.launch.worker)
NODE_ADDR_ENV = "FDL_NODE_ADDR"  # several nodes: this node's address (fdl.launch.network)
# Seconds between rank 0's progress snapshots (fdl.rundir.progress); set by fdl run when it shows
# live progress on a terminal, absent otherwise (no snapshots written).
PROGRESS_ENV = "FDL_PROGRESS"
# What torch.distributed.elastic gives each worker (besides TORCHELASTIC_*): a process that
# inherits them believes it is a worker of some group.
TORCHRUN_WORKER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                       "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE",
                       "MASTER_ADDR", "MASTER_PORT")
ENV_PREFIXES = ("FDL_", "TORCHELASTIC_")  # fdl's variables and torchelastic's own
DEBUG_ENV = "FDL_DEBUG"  # 1, true or yes: tracebacks too (:func:`debugging`); 0 or unset: none


@dataclass(frozen=True)
class Setting:
    """A resolved value and where it came from."""

    value: Any
    source: str  # "flag" | "env" | "file:<path>" | "script" | "default"


def debugging(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``FDL_DEBUG`` asks for tracebacks: ``1``, ``true`` or ``yes`` (any case); ``0``,
    ``false`` or unset do not. ``env``: this process's environment unless given."""
    value = (os.environ if env is None else env).get(DEBUG_ENV, "")
    return value.strip().lower() in ("1", "true", "yes")


# ---- parsers: text (flag, env, file) or a typed value (file, script) -> the value -------------

def parse_policy(value: Any) -> str:
    return _choice("policy", value, POLICY_CHOICES)


def parse_backend(value: Any) -> str:
    return _choice("backend", value, BACKENDS)


AVERAGE_DTYPES = ("fp32", "bf16", "int8", "int4")  # what each sends: fdl.engine.averaging


def parse_average_dtype(value: Any) -> str:
    return _choice("average_dtype", value, AVERAGE_DTYPES)


OUTER_OPTIMIZERS = ("none", "nesterov")


def parse_outer_optimizer(value: Any) -> str:
    return _choice("outer_optimizer", value, OUTER_OPTIMIZERS)


def parse_momentum(value: Any) -> float:
    """A momentum: a finite number from 0 up to, not including, 1."""
    return parse_real("outer_momentum", MOMENTUMS,
                      hint="use a momentum from 0 (none) to below 1, e.g. 0.9")(value)


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    """``value`` as one of ``allowed`` (any case, spaces around it); a UsageError naming them,
    and the one a typo most likely meant (``cadance``: did you mean ``cadence``?)."""
    text = value.strip().lower() if isinstance(value, str) else None
    if text is None or text not in allowed:
        meant = difflib.get_close_matches(text, allowed, n=1, cutoff=0.75) if text else []
        raise UsageError(f"unknown {name} {shortened(value)}"
                         + (f" (did you mean {meant[0]!r}?)" if meant else ""),
                         hint=f"use one of: {', '.join(allowed)}")
    return text


def parse_real(name: str, allowed: Range, *, hint: str | None = None) -> Callable[[Any], float]:
    """A finite number in ``allowed``: an int, a float or text that reads as one (never a
    bool, nan or infinity)."""
    return parse_in(name, allowed, real, "a number", hint=lambda: hint or (
        f"give {name} a number in {allowed}, e.g. "
        f"{number_text(ENGINE_DEFAULTS.get(name, allowed.high))}"))


def parse_slowdown(value: Any) -> tuple[float, ...]:
    """``"1,2.5"`` or ``[1, 2.5]`` -> ``(1.0, 2.5)``: one factor per worker, each in
    :data:`SLOWDOWNS`."""
    items = value.split(",") if isinstance(value, str) else \
        value if isinstance(value, (list, tuple)) else ()
    factors = tuple(real(item) for item in items)
    if not factors or any(f is None or f not in SLOWDOWNS for f in factors):
        raise UsageError(
            f"simulate_slowdown must be one factor in {SLOWDOWNS} per worker, got {shortened(value)}",
            hint="e.g. --simulate-slowdown 1,2.5 (2 workers, the second 2.5x slower)",
        )
    return factors  # type: ignore[return-value]  # none is None


def parse_checkpoint_every(value: Any) -> str:
    """``3`` (every 3 epochs, in :data:`EPOCHS`) or a time ``10m`` / ``90s`` / ``1.5h`` (in
    :data:`TIMES_S`), in canonical text: ``"3"`` or ``"600s"`` (what workers receive in
    ``FDL_CHECKPOINT_EVERY``)."""
    number, unit = _time_parts(value)
    amount: float | int | None = _seconds(number, unit) if unit else whole(number)
    if amount is None or amount not in (TIMES_S if unit else EPOCHS):
        raise UsageError(f"checkpoint_every must be a number of epochs in {EPOCHS} or a time in "
                         f"{_time_range(TIMES_S)}, got {shortened(value)}",
                         hint="e.g. --checkpoint-every 2 (epochs) or --checkpoint-every 10m "
                              "(units s, m, h)")
    return f"{number_text(amount)}s" if unit else str(amount)


def _time_parts(value: Any) -> tuple[str, str]:
    """``"1.5h"`` -> ``("1.5", "h")``, ``"3"`` -> ``("3", "")``: the number's text and its unit
    (one of :data:`TIME_UNITS`, or none)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return "", ""
    try:
        text = str(value).strip().lower()
    except ValueError:  # an int past Python's 4300 digits
        return "", ""
    return (text[:-1], text[-1]) if text[-1:] in TIME_UNITS else (text, "")


def _seconds(number: str, unit: str) -> float | None:
    """``number`` of ``unit`` in seconds (``1e308h`` is infinite: outside every range); None
    unless ``number`` is a finite number."""
    amount = real(number)
    return None if amount is None else amount * TIME_UNITS[unit]


def _time_range(allowed: Range) -> str:
    return f"(0s, {number_text(allowed.high / 3600)}h]"


def parse_precision(value: Any) -> tuple[str, ...]:
    """``"bf16"`` (every rank) or ``"bf16,fp32"`` / ``["bf16", "fp32"]`` (one per rank) -> the
    choices as a tuple, each one of :data:`PRECISIONS`. Which rank gets which, and what ``auto``
    becomes on its device: fdl.engine.precision."""
    items = value.split(",") if isinstance(value, str) else value
    try:
        choices = tuple(str(item).strip().lower() for item in items)
    except (TypeError, ValueError):  # not text, not a list; an int past 4300 digits
        choices = ()
    if not choices or any(choice not in PRECISIONS for choice in choices):
        raise UsageError(f"precision must be one of {', '.join(PRECISIONS)} for every rank, or "
                         f"one of them per rank, comma-separated; got {shortened(value)}",
                         hint="e.g. --precision bf16, or --precision bf16,fp32 for 2 workers")
    return choices


# Settings given once for every worker or once per worker: a one-value and a two-worker example.
PER_WORKER = {"precision": ("bf16", "bf16,fp32"), "micro_batch_size": ("16", "16,64")}


def check_per_worker(name: str, values: Sequence[Any], world_size: int, *,
                     as_flag: bool = False) -> None:
    """A :data:`PER_WORKER` setting holds one value (every worker's) or one per worker; another
    count is a UsageError naming both (``as_flag``: the way ``fdl run`` names it, before any
    worker starts)."""
    if len(values) <= 1 or len(values) == world_size:
        return
    one, each = PER_WORKER[name]
    flag = BY_NAME[name].flag_name
    subject = f"{flag} has {len(values)} values" if as_flag else \
        f"{name} has {len(values)} values ({','.join(map(str, values))})"
    raise UsageError(f"{subject} for {world_size} worker(s)",
                     hint=f"give one for every worker ({flag} {one}) or one per worker, e.g. "
                          f"{flag} {each} for 2 workers")


def choice_for_rank(name: str, values: Sequence[Any], rank: int, world_size: int) -> Any:
    """Rank ``rank``'s value of a :data:`PER_WORKER` setting (:func:`check_per_worker`)."""
    assert 0 <= rank < world_size, (rank, world_size)
    check_per_worker(name, values, world_size)
    return values[0] if len(values) == 1 else values[rank]


def parse_micro_batch(value: Any) -> tuple[int | str, ...] | None:
    """``"auto"``, ``"16"`` (every rank) or ``"16,64"`` / ``[16, 64]`` (one per rank) -> the
    choices as a tuple (``"auto"`` or a whole number in [1, 2**20] each); None or ``off``: no
    micro-batches (each rank computes its batch at once)."""
    if value is None or (isinstance(value, str) and value.strip().lower() in OFF):
        return None
    items = value.split(",") if isinstance(value, str) else \
        [value] if isinstance(value, int) else value  # a script's micro_batch_size=16
    choices: list[int | str] = []
    try:
        for item in items:
            text = str(item).strip().lower()
            if text == "auto":
                choices.append("auto")
            elif isinstance(item, bool) or not text.isdigit() or \
                    int(text) not in MICRO_BATCHES:
                raise ValueError(text)
            else:
                choices.append(int(text))
    except (TypeError, ValueError):
        choices = []
    if not choices:
        raise UsageError(f"micro_batch_size must be auto or a whole number in {MICRO_BATCHES} "
                         f"for every rank, or one per rank, comma-separated; got {shortened(value)}",
                         hint="e.g. --micro-batch 16, --micro-batch 16,64 for 2 workers, "
                              "--micro-batch auto (the largest that fits on each GPU)")
    return tuple(choices)


def parse_budget(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``parse`` for a training budget that may be switched off: None, ``off`` or ``none`` ->
    None (no budget: a flag can lift one that fdl.toml sets)."""
    def parse_or_off(value: Any) -> Any:
        if value is None or (isinstance(value, str) and value.strip().lower() in OFF):
            return None
        return parse(value)

    return parse_or_off


def parse_time(name: str, allowed: Range = TIMES_S) -> Callable[[Any], float]:
    """``90s``, ``10m``, ``1.5h`` or plain seconds (``600``, ``0.5``) -> seconds, in
    ``allowed``."""
    def parse(value: Any) -> float:
        number, unit = _time_parts(value)
        seconds = _seconds(number, unit or "s")
        if seconds is None or seconds not in allowed:
            raise UsageError(f"{name} must be a time in {_time_range(allowed)}, got "
                             f"{shortened(value)}",
                             hint=f"e.g. --{name.replace('_', '-')} 90s, 10m or 1.5h (units s, "
                                  f"m, h), or plain seconds")
        return seconds

    return parse


def parse_collective_timeout(value: Any) -> float | None:
    """``auto`` (None: fdl.engine.collectives decides) or a time up to a day, in seconds."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    return parse_time("collective_timeout", COLLECTIVE_TIMEOUTS_S)(value)


def parse_tensorboard(value: Any) -> str | None:
    """``off`` -> None; ``on`` (the run directory's ``tensorboard/``) or a directory. A bare
    ``--tensorboard`` means ``on`` (:data:`SettingSpec.bare`). A directory must be one fdl can
    write (fdl.files.output_dir_problem: not a file, not under one, not in /proc, writable),
    checked here so the launcher and ``--dry-run`` refuse it before any worker starts."""
    from fdl.files import output_dir_problem

    if value is None or value is False:
        return None
    if value is not True and not isinstance(value, str):  # fdl.toml's `tensorboard = 5`
        raise UsageError(f"tensorboard takes on, off or a directory as text; got {value!r}",
                         hint='in fdl.toml: tensorboard = "on", or tensorboard = "logs/tb" '
                              "(quoted)")
    text = str(value).strip() if value is not True else "on"
    if text.lower() in ("off", "false", "no", "0", "none", ""):
        return None
    if text.lower() in ("on", "true", "yes", "1"):
        return "on"
    problem = output_dir_problem(Path(text))
    if problem is not None:
        raise UsageError(f"tensorboard takes a directory fdl can write; {text!r} {problem}",
                         hint="fdl run train.py --tensorboard (in the run directory), or "
                              "--tensorboard=DIR with a directory you can write")
    return text


def parse_nproc(value: Any) -> int | str:
    """A count of workers in :data:`WORKERS_PER_NODE`, or ``auto``, ``gpu``, ``cpu``."""
    text = value.strip().lower() if isinstance(value, str) else None
    if text in ("auto", "gpu", "cpu"):
        return text
    if whole(value) is not None:
        return parse_whole("nproc_per_node", WORKERS_PER_NODE,
                           hint="e.g. --nproc-per-node 2, or auto for one worker per GPU")(value)
    raise UsageError(f"nproc_per_node must be a whole number in {WORKERS_PER_NODE}, 'auto', "
                     f"'gpu' or 'cpu', got {shortened(value)}",
                     hint="e.g. --nproc-per-node 2, or auto for one worker per GPU")


def parse_run_dir(value: Any) -> str:
    if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
        raise UsageError(f"run_dir must be a non-empty path, got {value!r}",
                         hint="e.g. --run-dir runs/first")
    return str(value)


# ---- the tables -------------------------------------------------------------------------------

ENGINE_PANEL = "El Che engine"
TORCHRUN_PANEL = "torchrun-compatible"


@dataclass(frozen=True)
class SettingSpec:
    name: str
    default: Any
    parse: Callable[[Any], Any]
    help: str
    env: str
    flag: bool = True  # an fdl run option --<name-with-dashes>
    file: bool = True  # a key of fdl.toml / [tool.fdl]
    script: bool = False  # an fdl.Trainer argument
    engine: bool = False  # the workers' engine reads it (fdl run passes it as `env`)
    panel: str | None = None  # the group in fdl run --help
    bare: str | None = None  # the value of the flag given without one (--tensorboard = "on")
    flag_text: str | None = None  # the flag when not the name's (--micro-batch)

    @property
    def flag_name(self) -> str:
        return self.flag_text or "--" + self.name.replace("_", "-")

    def source_name(self, source: str) -> str:
        """Where a value of this setting came from, as a user wrote it: ``--policy``,
        ``FDL_POLICY``, the config file's path (``source`` as :class:`Setting` has it)."""
        if source == "flag":
            return self.flag_name
        if source == "env":
            return self.env
        return source.removeprefix("file:")

    def encode(self, value: Any) -> str:
        """The text a worker (or a flag) receives for ``value``; ``parse`` reads it back."""
        if value is None:  # a setting switched off where a parser can say so (tensorboard)
            return "off"
        if isinstance(value, (tuple, list)):  # one per rank (a list once read back from JSON)
            return ",".join(number_text(v) for v in value)
        return number_text(value)


def _engine(name: str, default: Any, parse: Callable[[Any], Any], help: str, env: str = "",
            **kwargs: Any) -> SettingSpec:
    return SettingSpec(name, default, parse, help, env or f"FDL_{name.upper()}", engine=True,
                       panel=ENGINE_PANEL, **kwargs)


SETTINGS: tuple[SettingSpec, ...] = (
    _engine("policy", "cadence", parse_policy,
            "sync | cadence | async, or auto (chosen after calibration).", script=True),
    _engine("backend", "auto", parse_backend, "auto | nccl | cpu.", script=True),
    _engine("epochs", 5, parse_whole("epochs", EPOCHS), "Epochs.", script=True),
    _engine("batch_size", 64, parse_whole("batch_size", BATCH_SIZES),
            "Batch size per worker per step.", script=True),
    _engine("seed", 42, parse_whole("seed", SEEDS, hint="a seed from 0 to 2**63 - 1: the engine "
                                   "seeds torch with it plus the epoch and a rank offset"),
            "Seed for init and data order.", script=True),
    _engine("simulate_slowdown", None, parse_slowdown,
            "Per-worker slowdown factors, e.g. 1,2.5.", env="FDL_SLOWDOWN"),
    _engine("checkpoint_every", None, parse_checkpoint_every,
            "Checkpoint every N epochs, or a time: 10m, 90s, 2h.", script=True),
    _engine("precision", ("auto",), parse_precision,
            "auto | fp32 | bf16 | fp16, or one per worker, e.g. bf16,fp32.", script=True),
    _engine("micro_batch_size", None, parse_micro_batch,
            "Compute each batch in micro-batches of N (gradients accumulated): N, one per "
            "worker (16,64), or auto (the largest that fits on each GPU); off: the batch.",
            env="FDL_MICRO_BATCH", script=True, flag_text="--micro-batch"),
    # Training budgets: training stops at the first one reached (the epochs are one).
    _engine("max_steps", None, parse_budget(parse_whole("max_steps", STEPS)),
            "Stop after N training steps; off: no limit.", script=True),
    _engine("max_samples", None, parse_budget(parse_whole("max_samples", SAMPLES)),
            "Stop after N training samples; off: no limit.", script=True),
    _engine("max_time", None, parse_budget(parse_time("max_time")),
            "Stop after this much training time: 90s, 10m, 1.5h or seconds; off: no limit.",
            script=True),
    # Tuning knobs of the engine, read from the environment only.
    _engine("divergence_threshold", 16.0,
            parse_real("divergence_threshold", DIVERGENCE_THRESHOLDS),
            "How many times its usual level the replicas' drift (per LR and step) may reach "
            "before a round counts as diverging.", flag=False, file=False),
    _engine("overhead_target", 0.02, parse_real("overhead_target", OVERHEAD_TARGETS),
            "Wanted sync time / compute time per round.", flag=False, file=False),
    _engine("tensorboard", None, parse_tensorboard,
            "Write TensorBoard scalars: on (RUN_DIR/tensorboard), off, or a directory.",
            script=True, bare="on"),
    _engine("average_dtype", "fp32", parse_average_dtype,
            "fp32 | bf16 | int8 | int4: what an average sends (bf16: half the bytes, int8: a "
            "quarter, int4: an eighth, with a scale per block; each rank's rounding error "
            "carried to its next average)."),
    _engine("outer_optimizer", "none", parse_outer_optimizer,
            "none | nesterov: step each average's displacement with Nesterov momentum "
            "(DiLoCo/SlowMo) instead of taking the average as it is; cadence and async."),
    _engine("outer_lr", 0.7, parse_real("outer_lr", OUTER_LRS),
            "The outer optimizer's learning rate (1 with momentum 0: plain averaging)."),
    _engine("outer_momentum", 0.9, parse_momentum,
            "The outer optimizer's Nesterov momentum, from 0 to below 1."),
    _engine("collective_timeout", None, parse_collective_timeout,
            "How long a collective waits for a peer before the run stops: 90s, 10m; auto: "
            "5m with several nodes, torch's own on one (30m over gloo)."),
    SettingSpec("run_dir", None, parse_run_dir,
                "Run directory (default runs/<UTC>-<stem>-<policy>).", "FDL_RUN_DIR"),
    SettingSpec("nproc_per_node", "auto", parse_nproc,
                "Workers per node: N, 'auto' (one per GPU, else 2 CPU workers) or 'cpu'.",
                "FDL_NPROC_PER_NODE", panel=TORCHRUN_PANEL),
    SettingSpec("max_restarts", 0, parse_whole("max_restarts", RESTARTS),
                "Restart the worker group up to N times.", "FDL_MAX_RESTARTS",
                panel=TORCHRUN_PANEL),
)
BY_NAME: dict[str, SettingSpec] = {spec.name: spec for spec in SETTINGS}
FILE_KEYS = tuple(spec.name for spec in SETTINGS if spec.file)
ENGINE_DEFAULTS: dict[str, Any] = {s.name: s.default for s in SETTINGS if s.engine}


@dataclass(frozen=True)
class LaunchOption:
    """A flag of ``fdl run`` with no other source: ``kind`` is "text", "int" or "bool"."""

    name: str
    kind: str
    help: str
    panel: str | None = None
    short: str | None = None
    metavar: str | None = None
    after_script: bool = True  # also fdl's when it follows SCRIPT (fdl.launch.request)

    @property
    def flag_name(self) -> str:
        return "--" + self.name.replace("_", "-")


LAUNCH_OPTIONS: tuple[LaunchOption, ...] = (
    LaunchOption("nnodes", "text", "Nodes: N or MIN:MAX.", TORCHRUN_PANEL),
    LaunchOption("node_rank", "int", "This node's rank (static rendezvous).", TORCHRUN_PANEL),
    LaunchOption("rdzv_endpoint", "text", "HOST:PORT of the rendezvous.", TORCHRUN_PANEL),
    LaunchOption("rdzv_backend", "text", "c10d (default) or static.", TORCHRUN_PANEL),
    LaunchOption("rdzv_id", "text", "Job id shared by all nodes.", TORCHRUN_PANEL),
    LaunchOption("standalone", "bool", "Single node, local rendezvous on a free port.",
                 TORCHRUN_PANEL),
    LaunchOption("master_addr", "text", "Static rendezvous address.", TORCHRUN_PANEL),
    LaunchOption("master_port", "int", "Static rendezvous port.", TORCHRUN_PANEL),
    LaunchOption("local_addr", "text", "This node's address for the other nodes (default: the "
                 "one that routes to the rendezvous).", TORCHRUN_PANEL),
    LaunchOption("module", "bool", "SCRIPT is a module name.", TORCHRUN_PANEL, short="-m",
                 after_script=False),
    LaunchOption("devices", "text", "GPU indices to use, e.g. 0,1."),
    LaunchOption("worker_python", "text", "Run local worker N under another environment's "
                 "Python: N=PATH[,N=PATH] (the same fdl and torch release).",
                 metavar="N=PATH"),
    LaunchOption("overwrite_run_dir", "bool",
                 "Replace the earlier run in the run directory (only a directory fdl run "
                 "wrote)."),
    LaunchOption("resume", "text", "Continue RUN_DIR from its last valid checkpoint.",
                 metavar="RUN_DIR"),
    LaunchOption("quiet_ranks", "bool", "Show only rank 0's output on the terminal."),
    LaunchOption("quiet", "bool", "No live progress display: plain lines only."),
    LaunchOption("dry_run", "bool", "Print the launch spec and exit."),
    LaunchOption("json", "bool", "With --dry-run: print JSON."),
)
OPTIONS_BY_NAME: dict[str, LaunchOption] = {option.name: option for option in LAUNCH_OPTIONS}
RUN_FLAGS: tuple[str, ...] = tuple(s.name for s in SETTINGS if s.flag) + tuple(OPTIONS_BY_NAME)


def is_launcher_variable(name: str) -> bool:
    """Whether ``name`` is one of fdl's or torchrun's variables (what a test or a benchmark cell
    scrubs so that the caller's environment cannot leak into it)."""
    return name.startswith(ENV_PREFIXES) or name in TORCHRUN_WORKER_ENV


def setting_env_names() -> tuple[str, ...]:
    """Every ``FDL_*`` variable that sets a setting, plus the ones fdl run gives its workers."""
    return (*(s.env for s in SETTINGS), SOURCES_ENV, RESUME_ENV, LAUNCHER_PID_ENV, PROGRESS_ENV,
            NODE_ADDR_ENV)


def without_run_settings(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` minus every variable that sets a run setting or tells a process it is a worker
    (what a benchmark cell starts from: its flags alone decide how it trains). fdl's other
    variables (``FDL_ALLOW_HTTP``, ``FDL_DEBUG`` ...) and everything else pass."""
    dropped = set(setting_env_names()) | set(TORCHRUN_WORKER_ENV)
    return {name: value for name, value in env.items()
            if name not in dropped and not name.startswith("TORCHELASTIC_")}


def takes_bare(flag: str, following: str | None) -> str | None:
    """The value ``flag`` means when given bare, or None: ``flag`` is a setting's with a
    :attr:`SettingSpec.bare` value and ``following`` (the next word) cannot be its value — none,
    an option, or the script (a ``.py`` name or an existing file: the value is a directory)."""
    spec = next((s for s in SETTINGS if s.bare is not None and s.flag_name == flag), None)
    if spec is None:
        return None
    if following is None or following.startswith("-") or following.endswith(".py") or \
            _names_a_file(following):
        return spec.bare
    return None


def _names_a_file(text: str) -> bool:
    try:
        return Path(text).is_file()
    except (OSError, ValueError):  # a name too long, a NUL byte: no file; the value says so
        return False


def fill_bare_flags(argv: list[str]) -> list[str]:
    """``argv`` with the value of every bare optional-value flag written out, up to ``--``:
    ``["--tensorboard", "train.py"]`` -> ``["--tensorboard", "on", "train.py"]``. The command
    line parser then sees one shape only."""
    filled: list[str] = []
    for index, word in enumerate(argv):
        if word == "--":
            return filled + argv[index:]
        filled.append(word)
        bare = takes_bare(word, argv[index + 1] if index + 1 < len(argv) else None)
        if bare is not None:
            filled.append(bare)
    return filled


def as_flags(values: Mapping[str, Any]) -> list[str]:
    """``fdl run`` flags for ``values`` (setting name -> value; None is left out)."""
    argv: list[str] = []
    for name, value in values.items():
        spec = BY_NAME[name]
        if not spec.flag:
            raise ValueError(f"setting {name} has no fdl run flag")
        if value is not None:
            argv += [spec.flag_name, spec.encode(value)]
    return argv


# ---- resolution -------------------------------------------------------------------------------

def parse_from(spec: SettingSpec, value: Any, *, origin: str) -> Any:
    """``spec.parse(value)``, its error prefixed with where the value came from; an origin that
    ends with the setting's name (a script's argument, a config file's key) stands for the
    name the message starts with: ``tool.fdl.seed must be ...``, not ``tool.fdl.seed: seed
    must be ...``."""
    try:
        return spec.parse(value)
    except UsageError as exc:
        message, name = exc.message, spec.name
        if message.startswith(f"{name} ") and (origin == name or origin.endswith(
                (f".{name}", f": {name}"))):
            raise type(exc)(f"{origin} {message[len(name) + 1:]}", hint=exc.hint) from exc
        raise type(exc)(f"{origin}: {message}", hint=exc.hint) from exc


def resolve_run_settings(*, flags: Mapping[str, Any], env: Mapping[str, str],
                         file_values: Mapping[str, Any],
                         file_path: Path | None) -> dict[str, Setting]:
    """Every setting resolved flag > env > file > default (fdl run). Flags of None are unset;
    ``file_values`` are already parsed (:func:`fdl.launch.config_file.load_config_file`)."""
    resolved = {}
    for spec in SETTINGS:
        if spec.flag and flags.get(spec.name) is not None:
            value = parse_from(spec, flags[spec.name], origin=spec.flag_name)
            resolved[spec.name] = Setting(value, "flag")
        elif env.get(spec.env):
            value = _from_env(spec, env[spec.env])
            resolved[spec.name] = Setting(value, "env")
        elif spec.name in file_values:
            resolved[spec.name] = Setting(file_values[spec.name], f"file:{file_path}")
        else:
            resolved[spec.name] = Setting(spec.default, "default")
    check_outer(resolved["policy"].value, resolved["outer_optimizer"].value)
    return resolved


def check_outer(policy: str, outer_optimizer: str) -> None:
    """An outer optimizer needs averages of the parameters: refused with policy sync (the
    launcher checks what it knows; the worker again, with the script's values)."""
    if outer_optimizer != "none" and policy == "sync":
        raise UsageError(f"outer_optimizer {outer_optimizer} steps the averages of the "
                         "parameters, and policy sync has none (its ranks step every batch "
                         "together)",
                         hint="use policy cadence, async or auto, or outer_optimizer none")


def _from_env(spec: SettingSpec, raw: str) -> Any:
    try:
        return spec.parse(raw)
    except UsageError as exc:
        raise ConfigError(f"{spec.env}: {exc.message}", hint=exc.hint) from exc


def engine_env(settings: Mapping[str, Setting]) -> dict[str, str]:
    """The engine settings as the ``FDL_*`` variables a worker's engine reads: every one not
    left at its default, and ``FDL_SOURCES`` with the provenance of each
    (:func:`resolve_engine_settings` reads them back; fdl.launch.worker_env adds the rest of a
    worker's environment)."""
    engine = [spec for spec in SETTINGS if spec.engine and spec.name in settings]
    env = {spec.env: spec.encode(settings[spec.name].value) for spec in engine
           if settings[spec.name].source != "default"}
    env[SOURCES_ENV] = json.dumps({spec.name: settings[spec.name].source for spec in engine})
    return env


def launcher_sources(env: Mapping[str, str]) -> dict[str, str]:
    """``FDL_SOURCES`` as written by :func:`engine_env` ({} when absent or unreadable)."""
    try:
        sources = json.loads(env.get(SOURCES_ENV, "{}"))
    except json.JSONDecodeError:
        return {}
    return sources if isinstance(sources, dict) else {}


def resolve_engine_settings(*, script: Mapping[str, Any],
                            env: Mapping[str, str]) -> dict[str, Setting]:
    """The engine's settings in a worker: ``FDL_*`` > the script's value > default. A script
    value that means the default counts as default (``precision="auto"``, whose default is
    ``("auto",)``, as much as ``epochs=5``)."""
    sources = launcher_sources(env)
    settings = {}
    for spec in SETTINGS:
        if not spec.engine:
            continue
        if env.get(spec.env):
            value = parse_from(spec, env[spec.env], origin=spec.env)
            settings[spec.name] = Setting(value, str(sources.get(spec.name, "env")))
        elif spec.script and script.get(spec.name) is not None:
            value = parse_from(spec, script[spec.name], origin=spec.name)
            settings[spec.name] = Setting(value, "default" if value == spec.default else "script")
        else:
            settings[spec.name] = Setting(spec.default, "default")
    return settings
