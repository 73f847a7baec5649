"""``fdl report RUN_DIR``: where the time of a run went, from its ``summary.json`` and the
per-rank timelines (``timeline/rank<r>.jsonl``). Pure functions over those files' contents;
torch is not needed.

A run that did not finish (interrupted, crashed, still running: no ``summary.json``) is
reported from its timelines and metrics instead, with ``"complete": false`` and the
``"reason"`` (fdl.rundir.report_partial); a finished run's document has ``"complete": true``.

Per rank: its device and precision (``fp32``, ``bf16``, ``fp16``; None where summary.json does
not say: an older run, or a run that did not finish), samples, share of the work, samples/s,
mean step time (compute and emulated sleep), and the wall time split into compute (the steps'
own work), emulated (the sleep of ``--simulate-slowdown``, the rounds' ``sleep_s``), sync
(waiting at the averaging boundaries, and under ``sync`` DDP's gradient all-reduce inside the
steps with the wait for the peers in it: the rounds' ``comm_s``), epoch boundaries (loss
reduction, checkpoints and bookkeeping between the last round of an epoch and the next one;
evaluation itself is excluded from the run's wall time), data loading (fetching and collating
batches between steps: the rounds' ``data_s``) and unexplained (what remains: Python and
scheduling, and what the step loop spent outside its timed steps — a rank waiting there for its
peers, as in the calibration pool's end while a peer is still starting). Compute is the rounds'
timed steps (``busy_s``) less their data loading and emulated sleep; a round written before
``busy_s`` counted its loop's wall time (``compute_s``) instead.

Efficiency: the measured throughput over the ideal, the sum of every rank's solo-equivalent
rate (``batch_size x accumulate / step time``, from the measured step times, communication
excluded) — what the ranks would deliver if none of them ever waited or communicated. It means
the same under every policy: sync's all-reduce is sync, not step time, as cadence's averages
are.

What is read back is checked, not trusted: ``summary.json`` and ``config.json`` by their own
modules (fdl.rundir.summary, fdl.rundir.config), the timelines by fdl.rundir.timeline.
Timelines are tolerated as far as they go: only each rank's last attempt counts (after its last
``start`` event: ``summary.json`` covers the attempt that finished), records with missing or
mistyped fields are left out, and a rank whose timeline is missing, unreadable, damaged or
records other than the samples ``summary.json`` counts for it is listed under ``incomplete``
with what its figures then cover.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from fdl.rundir import config as run_config
from fdl.rundir.fields import is_finite
from fdl.rundir.report_partial import load_partial_run
from fdl.rundir.summary import HINT, has_summary, load_summary
from fdl.rundir.timeline import RankTimeline, read_rank_timeline
from fdl.settings import AVERAGE_DTYPES

SCHEMA = 1


def run_report(run_dir: Path) -> dict[str, Any]:
    """``fdl report RUN_DIR``'s document (``--json`` prints it). A run that did not finish (no
    summary.json) is reported from what it left, marked incomplete with the reason
    (fdl.rundir.report_partial); a directory that holds no run is refused."""
    reason = None
    if has_summary(run_dir) or not run_config.holds_a_run(run_dir):
        summary, timelines, config = load_run(run_dir)
    else:
        summary, timelines, config, reason = load_partial_run(run_dir)
    return build_report(summary, timelines, batch_size=report_batch_size(config,
                                                                          run_dir=run_dir),
                        incomplete_reason=reason, network=config.get("network"))


def load_run(run_dir: Path) -> tuple[dict[str, Any], list[RankTimeline], dict[str, Any]]:
    """summary.json (checked), every rank's timeline and config.json (empty if absent)."""
    summary, config = load_summary_and_config(run_dir)
    timelines = [read_rank_timeline(run_dir, rank=rank) for rank in range(summary["world_size"])]
    return summary, timelines, config


def load_summary_and_config(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """summary.json (checked) and config.json (empty if absent), without the timelines."""
    summary = load_summary(run_dir)
    return summary, run_config.read_config(run_dir, hint=HINT)


def report_batch_size(config: dict[str, Any], *, run_dir: Path) -> int:
    """The run's batch size from config.json's engine section; 1 when it has none."""
    return run_config.batch_size(config, run_dir=run_dir, hint=HINT)


def build_report(summary: dict[str, Any], timelines: list[RankTimeline],
                 *, batch_size: int, incomplete_reason: str | None = None,
                 network: Any = None) -> dict[str, Any]:
    """The report's document; ``incomplete_reason``: why the run has no summary.json (the
    figures of ``summary`` were rebuilt from its timelines); ``network``: config.json's (node
    0's interface and its rated speed, for the link)."""
    wall = float(summary["wall_s"])
    # a step of a loop that accumulates is `accumulate` batches (the timelines' steps are steps)
    step_samples = batch_size * _accumulate(summary)
    ranks = [_rank(t.events, wall=wall, batch_size=step_samples) for t in timelines]
    total = sum(r["samples"] for r in ranks) or 1
    devices, precisions = (_per_rank(summary, key, len(ranks)) for key in ("devices", "precision"))
    for rank, row in enumerate(ranks):
        row["share"] = row["samples"] / total
        row["device"], row["precision"] = devices[rank], precisions[rank]
    # a rank without a solo-equivalent rate (its timeline missing: another node's rank, a lost
    # file) leaves the ideal unknown: the others' sum would understate it and inflate the
    # efficiency
    rates = [r["solo_samples_per_s"] for r in ranks]
    ideal = sum(rates) if rates and all(rates) else None
    measured = summary["throughput"]["samples_per_s"]
    return {
        "schema": SCHEMA, "complete": incomplete_reason is None, "reason": incomplete_reason,
        "policy": summary["policy"], "backend": summary["backend"],
        "world_size": summary["world_size"], "emulated_slowdown": summary["emulated_slowdown"],
        "wall_s": wall, "samples_per_s": measured,
        "ideal_samples_per_s": ideal or None,
        "efficiency": measured / ideal if ideal and measured else None,
        "ranks": ranks, "sync": summary["sync"],
        "link": (link := link_figures(summary, [t.events for t in timelines], network=network)),
        "advice": [*link_advice(summary, link), *sync_advice(summary, ranks, wall=wall),
                   *data_advice(ranks, wall=wall)],
        "anchor_history": summary.get("anchor_history", []),
        "eval": summary.get("eval", {}), "final_loss": summary.get("final_loss"),
        "incomplete": _incomplete(summary, timelines, ranks),
        "left_out": list(summary.get("left_out", [])),
    }


def link_figures(summary: dict[str, Any], ranks_events: list[list[dict[str, Any]]], *,
                 network: Any = None) -> dict[str, Any]:
    """What crossed the link between the ranks: an average's bytes as sent (``average_bytes``,
    or rank 0's sync events' ``bytes``), the blocking averages' median time and the rate that
    makes, which is about what the link carried. An average's time is the shortest of the
    ranks' that recorded it (their sync events of the same round): the rank that arrived last
    waited for the transfer and its packing only, where one that came first also waited for
    the others (a fast rank's view alone makes the link look several times slower); on
    several nodes a node's run directory holds its own ranks' timelines. For sync, the float32
    gradients DDP all-reduces each step and, where the run timed that all-reduce
    (``ddp_comm_s``, under an emulated slowdown), its rate, from rank 0's steps. None where
    the run did not record a figure (an older summary, a single worker).
    What the link allows is node 0's interface's rated speed, from ``network`` (config.json's,
    read back: anything that is not a plain interface name and a whole number of Mbit/s is
    left out), and the share of it the blocking averages got; the path to the other node may
    be slower than that (WiFi, the other node's interface), so it is a ceiling."""
    events = ranks_events[0] if ranks_events else []
    syncs = [e for e in events if e["kind"] == "sync"]
    sent = summary.get("average_bytes")
    recorded = [e["bytes"] for e in syncs if _whole(e.get("bytes"))]
    if not _whole(sent) and recorded:
        sent = max(recorded)
    sent = sent if _whole(sent) and sent > 0 else None
    blocking = sorted(_blocking_averages(ranks_events))
    median_s = blocking[len(blocking) // 2] if blocking else None
    gradient = summary.get("gradient_bytes")
    gradient = gradient if _whole(gradient) and gradient > 0 else None
    steps = sum(e["steps"] for e in events if e["kind"] == "round")
    comm = summary.get("ddp_comm_s")
    comm_s = comm[0] if isinstance(comm, list) and comm and is_finite(comm[0]) and \
        comm[0] > 0 else None
    per_step = comm_s / steps if comm_s and steps and summary.get("policy") == "sync" else None
    dtype = summary.get("average_dtype")
    interface, rated = _rated_link(network)
    rate = sent / median_s / 1e6 if sent and median_s else None
    return {
        "average_bytes": sent, "average_dtype": dtype if dtype in AVERAGE_DTYPES else None,
        "averages": len(syncs), "blocking_average_ms": median_s * 1000 if median_s else None,
        "blocking_mb_per_s": rate,
        "interface": interface, "interface_mbit": rated,
        "interface_share": rate / (rated / 8) if rate and rated else None,
        "gradient_bytes": gradient if summary.get("policy") == "sync" else None,
        "gradient_ms_per_step": per_step * 1000 if per_step else None,
        "gradient_mb_per_s": gradient / per_step / 1e6 if gradient and per_step else None,
    }


def _blocking_averages(ranks_events: list[list[dict[str, Any]]]) -> list[float]:
    """Each of rank 0's blocking averages' time, the shortest of the ranks' sync events of its
    round (a sync event without a round, from an older run: rank 0's own)."""
    def blocking(events: list[dict[str, Any]]) -> list[tuple[Any, float]]:
        return [(e.get("round"), e["end"] - e["start"]) for e in events
                if e["kind"] == "sync" and e.get("blocking") is True
                and is_finite(e.get("start")) and is_finite(e.get("end"))
                and e["end"] > e["start"]]
    shortest: dict[Any, float] = {}
    for events in ranks_events[1:]:
        for key, spent in blocking(events):
            if key is not None:
                shortest[key] = min(spent, shortest.get(key, spent))
    return [min(spent, shortest.get(key, spent)) if key is not None else spent
            for key, spent in (blocking(ranks_events[0]) if ranks_events else [])]


# communication over compute (summary.json's sync.overhead) from which a run is told what sends
# less: the anchor holds cadence's and async's averages near overhead_target (2 % by default)
# where a run is long enough: 10 % is well above what the anchor alone leaves
ADVICE_OVERHEAD = 0.10
# the bytes per average below which no smaller --average-dtype is suggested: an average's time
# is then the link's round trips (64 kB: 0.5 ms at 1 Gbit/s, 5 ms at 100 Mbit/s), which fewer
# bytes do not shorten (docs/run.md "Slow links")
ADVICE_MIN_BYTES = 64 * 1024
_BITS = {"fp32": 32, "bf16": 16, "int8": 8, "int4": 4}  # per value sent (int8/int4: + scales)


def link_advice(summary: dict[str, Any], link: dict[str, Any]) -> list[str]:
    """What to try when a cadence or async run's averages cost ``ADVICE_OVERHEAD`` or more of
    its compute time (the summary's ``sync.overhead``: each average's communication, the least
    over the ranks, so the transfer and not a wait for a slower rank): each
    ``--average-dtype`` that sends fewer bytes than the one it used, with the share it sends
    (:func:`bytes_share`). Empty otherwise: sync (:func:`sync_advice`), one worker, nothing
    smaller left, a summary without the figure (an older one), or averages of fewer than
    ``ADVICE_MIN_BYTES`` (``link``'s ``average_bytes``, :func:`link_figures`)."""
    sync, dtype, world = summary.get("sync"), summary.get("average_dtype"), \
        summary.get("world_size")
    overhead = sync.get("overhead") if isinstance(sync, dict) else None
    sent = link.get("average_bytes")
    if summary.get("policy") not in ("cadence", "async") or dtype not in _BITS or \
            not _whole(world) or world < 2 or not is_finite(overhead) or \
            overhead < ADVICE_OVERHEAD or (_whole(sent) and sent < ADVICE_MIN_BYTES):
        return []
    shares = ", ".join(f"{name} {share:.0%}" for name in _BITS
                       if (share := bytes_share(dtype, name, world_size=world)) < 1)
    if not shares:
        return []
    return [f"the averages cost {overhead:.0%} of the compute time, sent in {dtype}: "
            f"--average-dtype {shares} of its bytes (docs/run.md \"Slow links\")"]


def sync_advice(summary: dict[str, Any], ranks: list[dict[str, Any]], *,
                wall: float) -> list[str]:
    """A tip for a sync run in which a rank spent ``ADVICE_OVERHEAD`` or more of the wall time
    in the gradient all-reduces (its ``sync_wait``: the transfer, and the wait for a slower
    rank's step, El Che's case): cadence and async, named with that rank and its share."""
    worst = _largest_share(ranks, "sync_wait", wall=wall)
    if summary.get("policy") != "sync" or len(ranks) < 2 or worst is None or \
            worst[0] < ADVICE_OVERHEAD:
        return []
    share, rank = worst
    return [f"rank {rank} spent {share:.0%} of the run in sync's gradient all-reduces, waiting "
            "for the link and for slower ranks' steps: cadence and async let each rank step at "
            "its own speed and average once a round (--policy auto picks one after "
            "calibration; fdl compare measures them on your script)"]


# the share of a rank's wall time spent fetching and collating batches from which it is told
DATA_ADVICE = 0.15


def data_advice(ranks: list[dict[str, Any]], *, wall: float) -> list[str]:
    """A tip when a rank spent ``DATA_ADVICE`` or more of the run's wall time fetching and
    collating its batches between steps (its ``data_loading``): the one that spent the most
    named, with loader workers as the remedy (they fetch ahead while the step computes)."""
    worst = _largest_share(ranks, "data_loading", wall=wall)
    if worst is None or worst[0] < DATA_ADVICE:
        return []
    share, rank = worst
    return [f"rank {rank} spent {share:.0%} of the run fetching and collating batches: loader "
            "workers fetch them while the step computes (run.batches(num_workers=N) or "
            "the DataLoader's); with workers already, more where the CPU has cores to spare, "
            "a cheaper collate_fn, or data stored as tensors"]


def _largest_share(ranks: list[dict[str, Any]], part: str, *,
                   wall: float) -> tuple[float, int] | None:
    """The largest share of the wall time any rank spent in ``part`` of its time split, and
    that rank (None: no rank has the figure)."""
    shares = [(row["time_s"][part] / wall, rank) for rank, row in enumerate(ranks)
              if wall > 0 and is_finite(row["time_s"].get(part))]
    return max(shares) if shares else None


def bytes_share(sent: str, instead: str, *, world_size: int) -> float:
    """The bytes a rank sends per average in ``instead`` over those in ``sent``, scales left
    out: fp32 is all-reduced (a ring sends 2 (W-1)/W of the buffer), the encodings gathered
    (W-1 encoded buffers), so an encoding saves less as ranks are added (bf16 half for two
    ranks, nothing from four; docs/run.md "Slow links")."""
    def sends(dtype: str) -> float:
        if dtype == "fp32":
            return 2 * (world_size - 1) / world_size * _BITS["fp32"]
        return (world_size - 1) * _BITS[dtype]
    return sends(instead) / sends(sent)


def _rated_link(network: Any) -> tuple[str | None, int | None]:
    """Node 0's interface and its rated Mbit/s from config.json's ``network``, each None
    unless it is what fdl writes there (a short interface name of plain characters, a whole
    number of Mbit/s below a petabit)."""
    if not isinstance(network, dict) or not network.get("several_nodes"):
        return None, None
    name, mbit = network.get("interface"), network.get("link_mbit")
    name = name if isinstance(name, str) and _INTERFACE_NAME.fullmatch(name) else None
    mbit = mbit if _whole(mbit) and 0 < mbit < 10**9 else None
    return name, mbit if name else None


_INTERFACE_NAME = re.compile(r"[A-Za-z0-9_.:@-]{1,32}")


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def _per_rank(summary: dict[str, Any], key: str, count: int) -> list[str | None]:
    """``summary[key]``, one string per rank (checked by fdl.rundir.summary), None for each rank
    it does not cover (an older summary has no ``precision``, a rebuilt one no ``devices``)."""
    values = summary.get(key)
    values = values if isinstance(values, list) else []
    return [values[rank] if rank < len(values) else None for rank in range(count)]


def _incomplete(summary: dict[str, Any], timelines: list[RankTimeline],
                ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ranks whose figures do not cover their whole run, each with a one-line message."""
    wall, rates = summary["wall_s"], summary["throughput"]["per_rank_samples_per_s"]
    found = []
    for timeline, row in zip(timelines, ranks, strict=True):
        expected = round(rates[timeline.rank] * wall) if rates[timeline.rank] is not None \
            else None
        problems = list(timeline.problems)
        if expected is not None and row["samples"] != expected:
            problems.append(f"it records {row['samples']} of the {expected} samples "
                            "summary.json counts for it")
        if not problems:
            continue
        found.append({"rank": timeline.rank, "problems": problems,
                      "recorded_samples": row["samples"], "summary_samples": expected,
                      "message": f"rank {timeline.rank}'s timeline is incomplete: "
                                 f"{'; '.join(problems)}. Its figures (samples/s, share, "
                                 f"ms/step, time split, and so the ideal) cover only the "
                                 f"{row['samples']} samples it records"})
    return found


def _accumulate(summary: dict[str, Any]) -> int:
    """The batches per optimizer step summary.json records (1 when it does not, or holds
    something else than a whole number >= 1: a summary from before the field, or a hostile
    one)."""
    value = summary.get("accumulate")
    return value if isinstance(value, int) and not isinstance(value, bool) and \
        1 <= value <= 1_000_000 else 1


def _rank(events: list[dict[str, Any]], *, wall: float, batch_size: int) -> dict[str, Any]:
    rounds = [e for e in events if e["kind"] == "round"]
    syncs = [e for e in events if e["kind"] == "sync"]
    steps = sum(e["steps"] for e in rounds)
    data, emulated, comm = (sum(e.get(key, 0.0) for e in rounds)
                            for key in ("data_s", "sleep_s", "comm_s"))
    compute = max(0.0, sum(timed_steps_s(e) for e in rounds) - data - emulated)
    waiting = sum(e["wait_s"] for e in syncs) + comm
    boundary = _epoch_boundaries(events)
    busy = compute + emulated
    step_s = busy / steps if steps else None
    samples = sum(e["samples"] for e in rounds)
    return {
        "samples": samples, "steps": steps,
        "samples_per_s": samples / wall if wall > 0 else None,
        "step_ms": step_s * 1000 if step_s else None,
        "solo_samples_per_s": batch_size / step_s if step_s else None,
        "time_s": {"compute": compute, "emulated": emulated, "sync_wait": waiting,
                   "epoch_boundary": boundary, "data_loading": data,
                   "unexplained": max(0.0, wall - busy - waiting - boundary - data)},
        "idle_fraction": max(0.0, 1 - busy / wall) if wall > 0 else None,
    }


def timed_steps_s(event: dict[str, Any]) -> float:
    """A round's timed steps — data, compute and emulated sleep, DDP's all-reduce not — in
    seconds: its ``busy_s``, or for a round written before that field its loop's wall time
    less its ``comm_s``."""
    busy = event.get("busy_s")
    if is_finite(busy):
        return float(busy)
    return max(0.0, event["compute_s"] - event.get("comm_s", 0.0))


def _epoch_boundaries(events: list[dict[str, Any]]) -> float:
    """Time from each epoch's end event to the next round's start (its end minus compute)."""
    total, pending = 0.0, None
    for event in events:
        if event["kind"] == "epoch":
            pending = event["t"]
        elif event["kind"] == "round" and pending is not None:
            total += max(0.0, (event["t"] - event["compute_s"]) - pending)
            pending = None
    return total
