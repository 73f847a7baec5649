"""``fdl report RUN_DIR [--json]``: where the time of a run went.

    fdl report runs/20260101T120000Z-train-async          # tables, then the run-wide lines
    fdl report runs/20260101T120000Z-train-async --json   # one document ("schema": 1)

Per rank: device and precision, throughput and share of the work, and where its time went
(compute, emulated slowdown, sync — waiting at averages, and DDP's all-reduce under sync —,
epoch boundaries, data loading, unexplained); then sync count/mean/overhead, the link, tips, the
anchor's history, efficiency against the ideal and the final metrics (what each figure means:
docs/run.md, section "fdl report RUN_DIR"). ``fdl run`` prints the same report when a run that
used fdl's engine finishes. A run that did not finish (interrupted or crashed: no
summary.json) is reported from its timelines, under an ``incomplete`` line that says why and
where it stopped.

Exit codes: 0, also when a rank's timeline is incomplete (one ``warning:`` line on stderr per
rank says what its figures cover); 2 when RUN_DIR holds no run, or a summary.json or
config.json fdl cannot use.

The text fits an 80-column terminal without cutting a header or a figure: the devices table (a
long device name wraps in its cell), then two per-rank tables of at most seven columns
(throughput; where the time went, in seconds); the run-wide lines wrap under their own column,
and the last line says where ``timeline/trace.json`` is and how to open it (Perfetto,
chrome://tracing). Every figure of ``--json`` is in the text, rounded, except anchor changes
before the last five (counted)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

import typer


def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (runs/<time>-<script>-<policy>).")],
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON document.")] = False,
) -> None:
    """Explain a run: throughput, idle time by cause, sync, anchor, metrics (a run that did not
    finish: what its timelines hold, marked incomplete)."""
    from fdl import console
    from fdl.rundir.report import run_report
    from fdl.rundir.timeline_trace import trace_path

    document = run_report(run_dir)
    if json_output:
        console.print_json(document)
        warn_incomplete(document)
    else:
        trace = trace_path(run_dir)
        render(document, trace=trace if trace.is_file() else None)


def warn_incomplete(doc: dict[str, Any]) -> None:
    """One ``warning:`` line on stderr per rank whose timeline does not cover its run, and per
    file of a run that did not finish whose figures are left out (``left_out``)."""
    from fdl import console

    for item in doc["incomplete"]:
        console.warn(item["message"])
    for note in doc.get("left_out", []):
        console.warn(note)


def render(doc: dict[str, Any], *, trace: Path | None = None) -> None:
    """The report as text: two per-rank tables (throughput; where the time went, in seconds)
    narrow enough for an 80-column terminal, then the run's figures, then ``trace`` (a
    trace.json to open in Perfetto) when given."""
    from fdl import console
    from fdl.rundir.timeline_trace import trace_note

    console.rule(f"fdl report: {doc['policy']} on {doc['world_size']} worker(s), "
                 f"backend {doc['backend']}")
    if not doc.get("complete", True):
        console.print_pairs([("incomplete", doc["reason"])], wrap=True)
    ranks = list(enumerate(doc["ranks"]))
    # a run that did not finish has neither
    if any(x.get("device") or x.get("precision") for _, x in ranks):
        console.print_table(
            ["rank", "device", "precision"],
            [[r, x.get("device") or "-", x.get("precision") or "-"] for r, x in ranks],
            title="devices", justify=["right", "left", "left"])
    console.print_table(
        ["rank", "samples", "steps", "samples/s", "share", "ms/step", "idle"],
        [[r, x["samples"], x["steps"], _num(x["samples_per_s"]), _pct(x["share"]),
          _num(x["step_ms"], ".1f"), _pct(x["idle_fraction"])] for r, x in ranks],
        title="throughput", justify=["right"] * 7, no_wrap=True)
    console.print_table(
        ["rank", "compute", "emulated", "sync", "epoch ends", "data", "other"],
        [[r, *(_num(x["time_s"].get(key), ".2f") for key in _TIME_KEYS)] for r, x in ranks],
        title="where the time went, in seconds", justify=["right"] * 7, no_wrap=True)
    pairs = _figures(doc)
    if trace is not None:
        pairs.append(("trace", trace_note(trace)))
    console.print_pairs(pairs, wrap=True)
    warn_incomplete(doc)


_TIME_KEYS = ("compute", "emulated", "sync_wait", "epoch_boundary", "data_loading",
              "unexplained")
_ANCHORS_SHOWN = 5


def _figures(doc: dict[str, Any]) -> list[tuple[str, Any]]:
    """The run-wide lines under the tables, each anchor change on a line of its own."""
    sync, history = doc["sync"], doc["anchor_history"]
    solo = " + ".join(_num(r["solo_samples_per_s"]) for r in doc["ranks"])
    anchors = [f"round {r}: {a} ({why})" for r, a, why in history[-_ANCHORS_SHOWN:]]
    if len(history) > _ANCHORS_SHOWN:
        anchors.insert(0, f"{len(history)} changes, the last {_ANCHORS_SHOWN}:")
    return [
        ("throughput", f"{_num(doc['samples_per_s'])} samples/s over {doc['wall_s']:.2f} s"),
        ("ideal", f"{_num(doc['ideal_samples_per_s'])} samples/s = {solo}, the ranks' "
                  "solo-equivalent rates"),
        ("efficiency", _pct(doc["efficiency"])),
        ("sync", f"{sync['rounds']} averages, mean {_num(sync['mean_ms'], '.1f')} ms, "
                 f"overhead {_pct(sync['overhead'])}"),
        ("link", _link(doc.get("link") or {})),
        *[("tip" if index == 0 else "", line)
          for index, line in enumerate(doc.get("advice") or [])],
        *[("anchor" if index == 0 else "", line)
          for index, line in enumerate(anchors or ["unchanged"])],
        ("emulated", ",".join(f"{f:g}" for f in doc["emulated_slowdown"])
         if doc["emulated_slowdown"] else None),
        ("eval", "  ".join(f"{k} {_num(v, '.4f')}" for k, v in doc["eval"].items()) or None),
        ("final loss", _num(doc["final_loss"], ".4f")),
    ]


def _size(count: float, *, digits: int) -> str:
    """Bytes as people read them: ``9.90 MB`` (``digits`` decimals) from a megabyte up, then
    ``340.1 kB`` and ``112 B``, so a sync run's epoch-end average of a few buffers is not
    ``0.00 MB``."""
    if count >= 1e6:
        return f"{count / 1e6:.{digits}f} MB"
    return f"{count / 1e3:.1f} kB" if count >= 1e3 else f"{count:.0f} B"


def _link(link: dict[str, Any]) -> str | None:
    """What crossed the link, in one line (None: nothing recorded)."""
    parts = []
    if link.get("average_bytes"):
        part = f"{_size(link['average_bytes'], digits=2)} per average"
        if link.get("average_dtype") not in (None, "fp32"):  # sent encoded: bf16, int8 or int4
            part += f" ({link['average_dtype']})"
        if link.get("blocking_mb_per_s"):
            part += (f", blocking ones {link['blocking_average_ms']:.0f} ms: "
                     f"{_size(link['blocking_mb_per_s'] * 1e6, digits=1)}/s")
            if link.get("interface_share") is not None:
                part += (f" ({link['interface_share']:.1%} of {link['interface']}'s rated "
                         f"{link['interface_mbit']} Mbit/s)")
        parts.append(part)
    if link.get("gradient_bytes"):
        part = f"{_size(link['gradient_bytes'], digits=2)} of gradients per step"
        if link.get("gradient_mb_per_s"):
            part += (f", {link['gradient_ms_per_step']:.1f} ms each: "
                     f"{_size(link['gradient_mb_per_s'] * 1e6, digits=1)}/s")
        parts.append(part)
    return "; ".join(parts) or None


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _num(x: float | None, fmt: str = ".0f") -> str:
    """``x`` in ``fmt``; ``-`` for no figure, and NaN or an infinity named as what it is (a
    diverged loss), not printed as if it were a figure."""
    if x is None:
        return "-"
    if not math.isfinite(x):
        return "NaN (diverged)" if math.isnan(x) else "infinite (diverged)"
    return format(x, fmt)
