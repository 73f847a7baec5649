"""``fdl compare``'s document (compare.json) as text and a picture: the side-by-side table (for
the terminal and compare.md), compare.md itself, and compare.png — the train loss and the main
eval metric of every run against training seconds and against samples.

Pure functions of the document: ``compare.md`` and ``compare.png`` can be rebuilt from
``compare.json`` alone. matplotlib is the optional ``report`` extra; :func:`render_png` returns
None without it (through its object API and the Agg canvas: no window, no global backend).
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fdl.compare.figures import format_seconds
from fdl.console import shown

PLOT_FILE = "compare.png"
ERROR = "measurement error"
NO_MATPLOTLIB = "matplotlib is not installed (pip install 'fdl[report]')"


def tables(document: Mapping[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """The side-by-side tables as text, one row per policy: speed (samples/s, speedup over
    sync, time to sync's final loss, idle, sync overhead) and results (final train loss and
    eval metrics). A figure over several seeds reads ``median (min–max)``. A row whose figures
    are impossible reads ``measurement error`` where its speedup would be
    (:func:`measurement_errors` says why)."""
    metrics = list(dict.fromkeys(name for row in document["rows"] for name in row["eval"]))
    has_target = document["sync_loss_target"] is not None
    speed = ["policy", "runs", "samples/s", "vs sync", "to sync's loss", "idle", "sync overhead"]
    results = ["policy", "train loss", *(f"eval {name}" for name in metrics)]
    speed_rows, result_rows = [], []
    for row in document["rows"]:
        runs = f"{row['runs']}/{row['runs'] + row['failed']}"
        if not row["runs"]:
            speed_rows.append([row["policy"], runs, *["failed"] * (len(speed) - 2)])
            result_rows.append([row["policy"], *["failed"] * (len(results) - 1)])
            continue
        speedup = row["speedup_vs_sync"]
        shown = "-" if speedup is None else f"{speedup:.2f}x"
        speed_rows.append([row["policy"], runs, _figure(row["samples_per_s"], ",.0f"),
                           ERROR if row.get("measurement_error") else shown,
                           _time_to_loss(row, has_target=has_target),
                           _figure(row["idle_fraction"], ".1%"),
                           _figure(row["sync_overhead"], ".1%")])
        result_rows.append([row["policy"], _figure(row["final_loss"], ".4f"),
                            *(_figure(row["eval"].get(name), ".4f") for name in metrics)])
    return [("speed", speed, speed_rows), ("results", results, result_rows)]


def measurement_errors(document: Mapping[str, Any]) -> list[str]:
    """``policy: why`` for each row whose figures are impossible."""
    return [f"{row['policy']}: {row['measurement_error']}" for row in document["rows"]
            if row.get("measurement_error")]


def _figure(value: Mapping[str, Any] | None, spec: str) -> str:
    if value is None:
        return "-"
    text = format(value["median"], spec)
    if value["runs"] > 1:
        text += f" ({format(value['min'], spec)}–{format(value['max'], spec)})"
    return text


def _time_to_loss(row: Mapping[str, Any], *, has_target: bool) -> str:
    value = row["time_to_sync_loss_s"]
    if value is None:
        return "not reached" if has_target else "-"
    text = format_seconds(value["median"])
    if value["runs"] > 1:
        text += f" ({format_seconds(value['min'])}–{format_seconds(value['max'])})"
    if row["reached_sync_loss"] < row["runs"]:
        text += f", {row['reached_sync_loss']}/{row['runs']} seeds"
    return text


def render_markdown(document: Mapping[str, Any], *, plot: bool) -> str:
    """compare.md: what was compared, the table, the recommendation and why the others lost,
    the failed cells, and the plot (or why there is none). Outside text in it (the script's
    path and arguments, metric names, GPU names, failures) is shown as the terminal shows it
    (:func:`fdl.console.shown`: control characters escaped, a table cell on one line), so
    ``cat compare.md`` cannot act on the terminal; compare.json keeps the exact values."""
    lines = [f"# fdl compare: {document['script']}", "", *_facts(document), ""]
    for _, columns, rows in tables(document):
        lines += [_markdown_row(columns), "|" + "---|" * len(columns),
                  *(_markdown_row(row) for row in rows), ""]
    errors = measurement_errors(document)
    if errors:
        lines += ["Measurement errors (not results):", "", *(f"- {line}" for line in errors), ""]
    lines += [f"**Recommendation** ({document['recommendation']['basis']}): "
             f"{document['recommendation']['text']}", ""]
    lines += [f"- {note}" for note in document["recommendation"]["notes"]]
    failed = [cell for cell in document["cells"] if cell["status"] == "failed"]
    if failed:
        lines += ["", "Failed runs:", ""]
        lines += [f"- `{c['name']}`: {c['failure']} (output: `{c['name']}.log`)" for c in failed]
    lines += ["", f"![{PLOT_FILE}]({PLOT_FILE})" if plot else f"Plot skipped: {NO_MATPLOTLIB}."]
    return "\n".join(shown(line) for line in lines) + "\n"


def _markdown_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _facts(document: Mapping[str, Any]) -> list[str]:
    machine = document.get("machine") or {}
    gpus = ", ".join(g["name"] for g in machine.get("gpus", [])) or "none"
    options = " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
                       for k, v in document["options"].items())
    return [f"- script: `{' '.join([document['script'], *document['args']])}`",
            f"- fdl run options: `{options}`" if options else "- fdl run options: none",
            f"- seeds: {', '.join(str(s) for s in document['seeds'])}; epochs: "
            f"{document['epochs'] if document['epochs'] is not None else 'as the script sets'}",
            f"- machine: {machine.get('cpu_model', '?')} ({machine.get('logical_cores', '?')} "
            f"cores), GPUs: {gpus}, torch {machine.get('torch', '?')}",
            "- figures: median over seeds (min–max with several); seconds are training "
            "seconds, evaluation excluded", *_target_fact(document)]


def _target_fact(document: Mapping[str, Any]) -> list[str]:
    target = document["sync_loss_target"]
    if target is None:
        return []
    return [f"- to sync's loss: until the train loss first reached {target['threshold']:.4f}, "
            f"sync's final train loss {target['final_loss']:.4f} plus its noise "
            f"{target['noise']:.4f} (its range over seeds, or 1 %)"]


def render_png(document: Mapping[str, Any]) -> bytes | None:
    """compare.png (:func:`compare_figure`); None without matplotlib."""
    figure = compare_figure(document)
    if figure is None:
        return None
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def compare_figure(document: Mapping[str, Any]) -> Any:
    """2 x 2 axes — train loss (top) and the main eval metric (bottom) against training seconds
    (left) and samples (right), one colour per policy, one line per seed; None without
    matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    metric = document["metric"]
    figure = Figure(figsize=(11, 8), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(2, 2)
    colours = {policy: f"C{i}" for i, policy in enumerate(document["policies"])}
    seen: set[str] = set()
    for cell in document["cells"]:
        _plot_cell(axes, cell, metric=metric, colour=colours[cell["policy"]],
                   first=cell["policy"] not in seen)
        if cell.get("epochs"):  # the legend names a policy at its first drawn run
            seen.add(cell["policy"])
    figure.suptitle(f"fdl compare: {Path(document['script']).name} (one line per seed)")
    target = document["sync_loss_target"]
    for (row, column), ax in _grid(axes):
        if row == 0 and target is not None:
            ax.axhline(target["threshold"], color="grey", linestyle="--", linewidth=1,
                       label="sync's final loss + noise")
        ax.set(xlabel=("training seconds", "samples")[column],
               ylabel="train loss" if row == 0 else f"eval {metric or '(none)'}")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    return figure


def _plot_cell(axes: Any, cell: Mapping[str, Any], *, metric: str | None, colour: str,
               first: bool) -> None:
    epochs = cell.get("epochs") or []
    if not epochs:  # a failed run: nothing to draw
        return
    label = cell["policy"] if first else None
    for column, key in enumerate(("elapsed_s", "samples")):
        xs = [point[key] for point in epochs]
        axes[0][column].plot(xs, [p["train_loss"] for p in epochs], marker="o", color=colour,
                             label=label)
        if metric is not None:
            points = [(x, p["eval"][metric]) for x, p in zip(xs, epochs, strict=True)
                      if metric in p["eval"]]
            axes[1][column].plot([x for x, _ in points], [y for _, y in points], marker="o",
                                 color=colour, label=label)


def _grid(axes: Any) -> Sequence[tuple[tuple[int, int], Any]]:
    return [((row, column), axes[row][column]) for row in range(2) for column in range(2)]
