"""``summary.json``: what a finished run did, for people and tools (``fdl report``, ``fdl bench``,
``fdl compare``; docs/elche.md "Outputs" lists the fields). Rank 0 builds it at the end of a
run (:class:`RunSummary`, typed whole) and writes it atomically; :func:`load_summary` reads it back,
checked: a document that does not hold what fdl writes is a UsageError naming the file, the
field, its value and what is allowed. Fields added later (``precision``: each rank's ``fp32``,
``bf16`` or ``fp16``) are optional when read: an older run's summary stays readable, and its
readers show such a field as unknown.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fdl import readback
from fdl.errors import UsageError
from fdl.files import write_json_atomic
from fdl.rundir.fields import (
    MOST_METRIC,
    MOST_RATE,
    MOST_SECONDS,
    is_figure,
    is_int,
    is_metric,
    read_json,
    show,
)

FILE = "summary.json"
HINT = "summary.json and config.json are written by fdl run; restore them or re-run"


@dataclass(frozen=True, kw_only=True)
class RankSummary:
    """One rank's part of a run: its device and precision (None: not given), the samples it
    trained, its busy time (whole steps, emulated sleep included, DDP's all-reduce not), the
    emulated sleep, its waits for batches inside its steps, its time in the gradient
    all-reduce inside its steps (sync), its micro-batch size, its GPU's peak allocated bytes
    (None off CUDA) and fdl's averaging memory on the device and in host memory."""

    device: str
    precision: str | None = None
    samples: int = 0
    busy_s: float = 0.0
    emulated_sleep_s: float = 0.0
    data_wait_s: float = 0.0
    ddp_comm_s: float = 0.0
    micro_batch_size: int = 0
    peak_memory_bytes: int | None = None
    fdl_device_bytes: int = 0
    fdl_host_bytes: int = 0


@dataclass(frozen=True, kw_only=True)
class OuterStep:
    """The outer optimizer and how many steps it took (0: none, or sync's averages)."""

    name: str = "none"
    lr: float = 0.0
    momentum: float = 0.0
    steps: int = 0


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    """Everything ``summary.json`` holds, typed; :meth:`to_dict` is the document (docs/elche.md
    "Outputs"). ``comm_ms``: what each average cost, the communication proper (the least over
    ranks); ``syncs``: the averages; what crosses the link: an average's ``average_bytes`` (as
    sent: encoded on the wire, fewer) and, for sync, the ``gradient_bytes`` all-reduced every
    step (float32). ``nccl_p2p``: node 0's ``NCCL_P2P_DISABLE`` and why; ``policy_choice``:
    ``--policy auto``'s pick and its figures (None: a policy was given)."""

    policy: str
    backend: str
    emulated_slowdown: list[float] | None
    epochs: int
    wall_s: float
    ranks: list[RankSummary]
    syncs: int
    comm_ms: list[float]
    eval: dict[str, float] = field(default_factory=dict)
    final_loss: float | None = None
    eval_s: float = 0.0
    seed: int = 0
    anchor_history: list[tuple[int, int, str]] = field(default_factory=list)
    final_anchor: int = 0
    checksum: str = ""
    average_bytes: int = 0
    average_dtype: str = "fp32"
    outer_optimizer: OuterStep = field(default_factory=OuterStep)
    gradient_bytes: int = 0
    accumulate: int = 1
    samples_planned: int = 0
    attempt: int = 0
    resumed_from: str | None = None
    nccl_p2p: dict[str, Any] | None = None
    policy_choice: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The document: the rates, the averages' overhead and the idle fractions derived
        here, once. The overhead is the communication proper (the averages', and the least
        over the ranks of the all-reduce inside the steps) over the busiest rank's compute."""
        ranks, wall_s = self.ranks, self.wall_s
        samples = [rank.samples for rank in ranks]
        busy = [rank.busy_s for rank in ranks]
        compute_s = max(busy) if busy else 0.0
        step_comm = [rank.ddp_comm_s for rank in ranks]
        sync_s = sum(self.comm_ms) / 1000 + (min(step_comm) if step_comm else 0.0)
        precisions = [rank.precision for rank in ranks]
        return {
            "policy": self.policy,
            "backend": self.backend,
            "world_size": len(ranks),
            "devices": [rank.device for rank in ranks],
            "precision": None if None in precisions else precisions,
            "emulated_slowdown": list(self.emulated_slowdown) if self.emulated_slowdown
            else None,
            "epochs": self.epochs,
            "samples": sum(samples),
            "wall_s": wall_s,
            "throughput": {
                "samples_per_s": sum(samples) / wall_s if wall_s > 0 else None,
                "per_rank_samples_per_s": [s / wall_s if wall_s > 0 else None
                                           for s in samples],
            },
            "sync": {
                "rounds": self.syncs,
                "mean_ms": sum(self.comm_ms) / len(self.comm_ms) if self.comm_ms else None,
                "overhead": sync_s / compute_s if (self.comm_ms or sync_s) and compute_s > 0
                else None,
            },
            "idle_fraction": [max(0.0, 1 - b / wall_s) if wall_s > 0 else None for b in busy],
            "eval": self.eval,
            "final_loss": self.final_loss,
            "eval_s": self.eval_s,
            "seed": self.seed,
            "anchor_history": [list(item) for item in self.anchor_history],
            "final_anchor": self.final_anchor,
            "checksum": self.checksum,
            "emulated_sleep_s": [rank.emulated_sleep_s for rank in ranks],
            "data_wait_s": [rank.data_wait_s for rank in ranks],
            "micro_batch_size": [rank.micro_batch_size for rank in ranks],
            "peak_memory_bytes": [rank.peak_memory_bytes for rank in ranks],
            "fdl_memory_bytes": [{"device": rank.fdl_device_bytes, "host": rank.fdl_host_bytes}
                                 for rank in ranks],
            "ddp_comm_s": step_comm,
            "average_bytes": self.average_bytes,
            "average_dtype": self.average_dtype,
            "outer_optimizer": asdict(self.outer_optimizer),
            "gradient_bytes": self.gradient_bytes,
            "accumulate": self.accumulate,
            "samples_planned": self.samples_planned,
            "attempt": self.attempt,
            "resumed_from": self.resumed_from,
            "nccl_p2p": self.nccl_p2p,
            "policy_choice": self.policy_choice,
        }


def write_summary(run_dir: Path, summary: RunSummary | dict[str, Any]) -> Path:
    """``summary.json`` written atomically (a RunSummary as its document)."""
    document = summary.to_dict() if isinstance(summary, RunSummary) else summary
    return write_json_atomic(run_dir / FILE, document)


def has_summary(run_dir: Path) -> bool:
    """Whether the run finished with a summary (the script trained with fdl's engine): there
    is an entry of that name, whatever it is (:func:`load_summary` says what is wrong with one
    that is not a summary fdl wrote)."""
    return os.path.lexists(run_dir / FILE)


def diverged_loss(run_dir: Path) -> str | None:
    """``NaN`` or ``infinite`` when ``run_dir``'s summary has a final loss that is no number
    (the run diverged: ``fdl run`` exits 1 for it, and ``fdl bench`` and ``fdl compare`` record
    it as a result), else None; None too for a summary that cannot be read (the report says
    what is wrong with it)."""
    import math

    from fdl.errors import FdlError

    if not has_summary(run_dir):
        return None
    try:
        loss = load_summary(run_dir).get("final_loss")
    except FdlError:
        return None
    if isinstance(loss, float) and not math.isfinite(loss):
        return "NaN" if math.isnan(loss) else "infinite"
    return None


def load_summary(run_dir: Path) -> dict[str, Any]:
    """summary.json, checked (see the module docstring)."""
    path = run_dir / FILE
    if not has_summary(run_dir):
        raise UsageError(f"{run_dir} has no {FILE} (not a finished fdl run)",
                         hint="pass a run directory, e.g. runs/<time>-train-async")
    summary = read_json(path, hint=HINT, limit=readback.DOCUMENT_BYTES)
    _check_summary(summary, path)
    return summary


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    """summary.json as an object, unchecked, or None when there is none that parses (the
    merged timeline shows what it has)."""
    try:
        summary = readback.read_json(run_dir / FILE, limit=readback.DOCUMENT_BYTES)
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def _figure(most: float, *, null: bool = True) -> tuple[Any, str]:
    """A finite figure in [0, most] (or null, a figure the run could not measure)."""
    return (lambda v: (null and v is None) or is_figure(v, most=most),
            f"a number in [0, {most:g}]" + (" or null" if null else ""))


_FIELDS: dict[str, tuple[Any, str]] = {
    "policy": (lambda v: isinstance(v, str), "a string"),
    "backend": (lambda v: isinstance(v, str), "a string"),
    "world_size": (lambda v: is_int(v) and v >= 1, "a positive integer"),
    "wall_s": _figure(MOST_SECONDS, null=False),
    "throughput": (lambda v: isinstance(v, dict), "an object"),
    "throughput.samples_per_s": _figure(MOST_RATE),
    "throughput.per_rank_samples_per_s": (
        lambda v: isinstance(v, list) and all(
            x is None or is_figure(x, most=MOST_RATE) for x in v),
        f"a list of numbers in [0, {MOST_RATE:g}] or nulls, one per rank"),
    "sync": (lambda v: isinstance(v, dict), "an object"),
    "sync.rounds": (lambda v: is_int(v) and v >= 0, "an integer >= 0"),
    "sync.mean_ms": _figure(MOST_RATE),
    "sync.overhead": _figure(MOST_RATE),
    "emulated_slowdown": (lambda v: v is None or (isinstance(v, list) and all(
        is_figure(x, most=MOST_RATE) for x in v)), "a list of numbers >= 0 or null"),
}
_OPTIONAL_FIELDS: dict[str, tuple[Any, str]] = {
    "anchor_history": (lambda v: isinstance(v, list) and all(is_anchor_change(x) for x in v),
                       "a list of [round, anchor, reason]: a round >= 0, an anchor in "
                       f"[0, {MOST_RATE:g}], a reason"),
    "eval": (lambda v: isinstance(v, dict), "an object of numbers"),
    "final_loss": (lambda v: v is None or is_metric(v),
                   f"a number at most {MOST_METRIC:g} in size, or null"),
    "devices": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
                "a list of strings, one per rank"),
    "precision": (lambda v: v is None or (isinstance(v, list)
                                          and all(isinstance(x, str) for x in v)),
                  "a list of strings, one per rank, or null"),
}


def is_anchor_change(entry: Any) -> bool:
    """One entry of ``anchor_history``: ``[round, anchor, reason]``."""
    return isinstance(entry, list) and len(entry) == 3 and is_int(entry[0]) and entry[0] >= 0 \
        and is_figure(entry[1], most=MOST_RATE) and isinstance(entry[2], str)


def _check_summary(summary: Any, path: Path) -> None:
    """A UsageError naming the first field of ``summary`` a reader cannot use."""
    if not isinstance(summary, dict):
        raise UsageError(f"{path} holds {show(summary)}, not a JSON object", hint=HINT)
    fields = {**_FIELDS, **{k: v for k, v in _OPTIONAL_FIELDS.items() if k in summary}}
    for name, (valid, allowed) in fields.items():
        parent, _, key = name.rpartition(".")
        holder = summary[parent] if parent else summary
        if key not in holder:
            raise UsageError(f"{path} has no {name}", hint=HINT)
        if not valid(holder[key]):
            raise UsageError(f"{path}: {name} is {show(holder[key])}, expected {allowed}",
                             hint=HINT)
    for key, value in summary.get("eval", {}).items():
        if not is_metric(value):
            raise UsageError(f"{path}: eval.{key} is {show(value)}, expected a number at most "
                             f"{MOST_METRIC:g} in size", hint=HINT)
    per_rank = [("throughput.per_rank_samples_per_s",
                 summary["throughput"]["per_rank_samples_per_s"]),
                ("devices", summary.get("devices")), ("precision", summary.get("precision"))]
    for name, values in per_rank:
        if values is not None and len(values) != summary["world_size"]:
            raise UsageError(f"{path}: world_size is {summary['world_size']} but {name} has "
                             f"{len(values)} entries", hint=HINT)
