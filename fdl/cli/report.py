"""``fdl report RUN_DIR [--json]``: per-rank throughput and share of the work, where each rank's
time went (compute, waiting at sync, epoch boundaries, data loading, unexplained), sync count/mean/overhead,
the anchor's history, efficiency against the ideal, and the final metrics. ``fdl run`` prints
the same report when a run that used fdl.Trainer finishes. A rank whose timeline is incomplete
gets a ``warning:`` line on stderr saying what its figures cover (exit 0); a summary.json or
config.json fdl cannot use is an ``error:`` (exit 2)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer


def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (runs/<time>-<script>-<policy>).")],
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON document.")] = False,
) -> None:
    """Explain a finished run: throughput, idle time by cause, sync, anchor, metrics."""
    from fdl import console

    document = run_report(run_dir)
    if json_output:
        console.print_json(document)
        warn_incomplete(document)
    else:
        render(document)


def run_report(run_dir: Path) -> dict[str, Any]:
    from fdl.launch.report import build_report, load_run, report_batch_size

    summary, timelines, config = load_run(run_dir)
    batch = report_batch_size(config, path=run_dir / "config.json")
    return build_report(summary, timelines, batch_size=batch)


def warn_incomplete(doc: dict[str, Any]) -> None:
    """One ``warning:`` line on stderr per rank whose timeline does not cover its run."""
    from fdl import console

    for item in doc["incomplete"]:
        console.warn(item["message"])


def render(doc: dict[str, Any]) -> None:
    from fdl import console

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1%}"

    def num(x: float | None, fmt: str = ".0f") -> str:
        return "-" if x is None else format(x, fmt)

    console.rule(f"fdl report: {doc['policy']} on {doc['world_size']} worker(s), "
                 f"backend {doc['backend']}")
    rows = [[r, num(x["samples_per_s"]), pct(x["share"]), num(x["step_ms"], ".1f"),
             num(x["time_s"]["compute"], ".2f"), num(x["time_s"]["sync_wait"], ".2f"),
             num(x["time_s"]["epoch_boundary"], ".2f"),
             num(x["time_s"].get("data_loading"), ".2f"), num(x["time_s"]["unexplained"], ".2f"),
             pct(x["idle_fraction"])] for r, x in enumerate(doc["ranks"])]
    console.print_table(["rank", "samples/s", "share", "ms/step", "compute s", "sync wait s",
                         "epoch ends s", "data s", "other s", "idle"], rows)
    sync = doc["sync"]
    anchors = ", ".join(f"round {r}: {a} ({why})" for r, a, why in doc["anchor_history"][-5:])
    console.print_pairs([
        ("throughput", f"{num(doc['samples_per_s'])} samples/s over {doc['wall_s']:.2f} s"),
        ("ideal", f"{num(doc['ideal_samples_per_s'])} samples/s (sum of solo-equivalent rates)"),
        ("efficiency", pct(doc["efficiency"])),
        ("sync", f"{sync['rounds']} averages, mean {num(sync['mean_ms'], '.1f')} ms, "
                 f"overhead {pct(sync['overhead'])}"),
        ("anchor", anchors or "unchanged"),
        ("emulated", ",".join(f"{f:g}" for f in doc["emulated_slowdown"])
         if doc["emulated_slowdown"] else None),
        ("eval", "  ".join(f"{k} {v:.4f}" for k, v in doc["eval"].items()) or None),
        ("final loss", num(doc["final_loss"], ".4f")),
    ])
    warn_incomplete(doc)
