"""The ``fdl bench`` sweep report: results.jsonl -> report.json, report.md and PNG charts.

The sweep appends one JSON record per finished cell (model x mode x seed) to
``<dir>/results.jsonl`` and writes ``<dir>/sweep.json`` (machine facts, start time, arguments).
:func:`write_report` turns them into:

* ``report.json`` — ``{"schema": 1, "machine": {...}, "rows": [...]}``, one row per
  (model, mode), aggregated over seeds (a re-run of the same seed replaces the earlier record);
* ``report.md`` — one table per model;
* ``loss-<model>.png`` (train loss per epoch, mean over seeds, one line per mode) and
  ``throughput.png`` (samples/s of every mode beside the ideal), when matplotlib is installed.

Figures in a row:

* ``eval`` / ``wall_s`` / ``samples_per_s``: means over seeds; ``eval_std`` is the sample
  standard deviation (null with one seed).
* ``speedup_vs_fast_solo``: the row's samples/s over that of the model's fastest solo mode.
* ``efficiency_vs_ideal`` (multi-worker rows): the row's samples/s over the sum, across the
  run's workers, of the solo rate at that worker's slowdown factor — a 1.0 + 2.5 run is measured
  against solo@1x + solo@2.5x. Null when a needed solo row is missing.
* ``efficiency_by_seed`` (multi-worker rows): ``[least, most]`` over the seeds of each seed's
  run against the same seed's solo runs (run beside it in the sweep), so the spread of a
  short sweep shows beside its mean; null with fewer than two such seeds.
* ``syncs`` / ``sync_overhead`` / ``idle_fraction``: means; null for solo rows.
* ``measurement_error``: one line saying why a figure of the row is impossible, else null: an
  efficiency above 1 against the solo rows (a run faster than its workers alone, summed), or a
  seed faster than its own run's ideal (``ideal_samples_per_s``). The table shows "measurement
  error" for such an efficiency, never the figure, and lists why under the model's table.

Everything here is pure standard library; matplotlib is imported only to draw. Files are
written atomically (a temp file beside the target, then ``os.replace``).
"""

from __future__ import annotations

import io
import json
import math
import re
import statistics
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fdl.bench.results import load_results
from fdl.console import shown
from fdl.errors import FdlError, UsageError, os_failure
from fdl.files import write_atomic

SCHEMA = 1
POLICY_ORDER = {"solo": 0, "sync": 1, "cadence": 2, "async": 3}
_AVERAGED = ("wall_s", "samples_per_s")
_MULTI_WORKER_ONLY = ("syncs", "sync_overhead", "idle_fraction")
_GPU_SOLO = re.compile(r"solo@gpu(\d+)")


def build_report(records: list[dict[str, Any]], *, machine: dict[str, Any]) -> dict[str, Any]:
    """Aggregate cell records into report rows (see the module docstring for each figure)."""
    cells: dict[tuple[str, str], dict[Any, dict[str, Any]]] = {}
    for record in records:  # the last record of a (model, mode, seed) wins
        cells.setdefault((record["model"], record["mode"]), {})[record.get("seed")] = record
    models = list(dict.fromkeys(model for model, _ in cells))
    rows = []
    for model in models:
        groups = sorted((list(seeds.values()) for (m, _), seeds in cells.items() if m == model),
                        key=_mode_order)
        rows.extend(_model_rows(model, groups))
    emulated = next((r["slowdown"] for r in records if r.get("emulated")
                     and r.get("slowdown") and (r.get("world_size") or 1) > 1), None)
    return {"schema": SCHEMA, "machine": {**machine, "emulated_slowdown": emulated},
            "rows": rows}


def _mode_order(group: list[dict[str, Any]]) -> tuple[int, float, str, str]:
    first = group[0]
    factor = (first.get("slowdown") or [1.0])[0] if first.get("policy") == "solo" else 0.0
    return (POLICY_ORDER.get(first.get("policy"), len(POLICY_ORDER)), float(factor),
            str(first.get("backend")), first["mode"])


def _solo_key(record: dict[str, Any]) -> tuple[str, float]:
    """What a solo run stands for: ("gpu", i) for solo@gpu<i>, else ("x", its slowdown)."""
    device = _GPU_SOLO.fullmatch(record["mode"])
    if device and not record.get("slowdown"):
        return ("gpu", float(device.group(1)))
    return ("x", float((record.get("slowdown") or [1.0])[0]))


def _worker_keys(record: dict[str, Any], *, on_gpus: bool) -> list[tuple[str, float]]:
    """The solo run each worker of a multi-worker run is measured against: its slowdown factor;
    without one, rank r's GPU r on a GPU host, else the CPU at 1x."""
    if record.get("slowdown"):
        return [("x", float(f)) for f in record["slowdown"]]
    ranks = range(int(record.get("world_size") or 1))
    return [("gpu", float(rank)) if on_gpus else ("x", 1.0) for rank in ranks]


def _model_rows(model: str, groups: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = [_aggregate(model, group) for group in groups]
    solo_rates = {_solo_key(g[0]): row["samples_per_s"]
                  for g, row in zip(groups, rows, strict=True) if row["policy"] == "solo"}
    solo_seeds = {_solo_key(g[0]): {r.get("seed"): r.get("samples_per_s") for r in g}
                  for g, row in zip(groups, rows, strict=True) if row["policy"] == "solo"}
    fastest = max((r for r in solo_rates.values() if r is not None), default=None)
    on_gpus = any(kind == "gpu" for kind, _ in solo_rates)
    for group, row in zip(groups, rows, strict=True):
        rate = row["samples_per_s"]
        row["speedup_vs_fast_solo"] = rate / fastest if rate is not None and fastest else None
        if row["policy"] != "solo":
            keys = _worker_keys(group[0], on_gpus=on_gpus)
            ideal = _ideal_rate(keys, solo_rates)
            row["efficiency_vs_ideal"] = rate / ideal if rate is not None and ideal else None
            row["efficiency_by_seed"] = _seed_range(group, keys, solo_seeds)
            row["measurement_error"] = measurement_error(row, group)
    return rows


def _seed_range(group: list[dict[str, Any]], keys: list[tuple[str, float]],
                solo_seeds: dict[tuple[str, float], dict[Any, Any]]) -> list[float] | None:
    """``[least, most]`` of each seed's efficiency against its own seed's solo rows (a seed
    without all of them is left out); None with fewer than two seeds to compare."""
    found = []
    for record in group:
        rate = record.get("samples_per_s")
        ideal = _ideal_rate(keys, {key: by_seed.get(record.get("seed"))
                                   for key, by_seed in solo_seeds.items()})
        if rate is not None and ideal:
            found.append(rate / ideal)
    return [min(found), max(found)] if len(found) >= 2 else None


def measurement_error(row: dict[str, Any], group: list[dict[str, Any]]) -> str | None:
    """Why a multi-worker row's figures are impossible (None: they are not)."""
    efficiency = row["efficiency_vs_ideal"]
    if efficiency is not None and efficiency > 1:
        return (f"efficiency {efficiency:.1%} of the ideal (the solo rows' samples/s at each "
                "worker's factor, summed) is impossible: the solo baseline or this run was "
                "mis-measured; re-run")
    own = [r["samples_per_s"] / r["ideal_samples_per_s"] for r in group
           if r.get("samples_per_s") and r.get("ideal_samples_per_s")]
    if own and max(own) > 1:
        return (f"{max(own):.1%} of the run's own ideal (its ranks' solo-equivalent rates, "
                "summed) is impossible: a measurement error; re-run")
    return None


def _ideal_rate(keys: list[tuple[str, float]],
                solo_rates: dict[tuple[str, float], float | None]) -> float | None:
    total = 0.0
    for kind, value in keys:
        rate = next((r for (k, v), r in solo_rates.items()
                     if k == kind and math.isclose(v, value)), None)
        if rate is None:
            return None
        total += rate
    return total


def _aggregate(model: str, group: list[dict[str, Any]]) -> dict[str, Any]:
    first, solo = group[0], group[0].get("policy") == "solo"
    evals = [r["eval"] for r in group if r.get("eval") is not None]
    row = {"model": model, "mode": first["mode"], "policy": first.get("policy"),
           "backend": first.get("backend"), "seeds": len(group), "eval": _mean(evals),
           "eval_std": statistics.stdev(evals) if len(evals) > 1 else None,
           "reference": next((r["reference"] for r in group if r.get("reference") is not None),
                             None)}
    row.update({key: _mean([r.get(key) for r in group]) for key in _AVERAGED})
    row["speedup_vs_fast_solo"] = None
    row["efficiency_vs_ideal"] = None
    row["efficiency_by_seed"] = None
    row["measurement_error"] = None
    row.update({key: None if solo else _mean([r.get(key) for r in group])
                for key in _MULTI_WORKER_ONLY})
    return row


def _mean(values: list[Any]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


# --- markdown ----------------------------------------------------------------------------------

COLUMNS = ("mode", "eval (mean ± std)", "published", "wall s", "samples/s",
           "speedup vs fast solo", "efficiency vs ideal", "syncs", "sync overhead", "idle %")
DASH = "—"
ERROR = "measurement error"


def render_markdown(report: dict[str, Any], *, title_note: str) -> str:
    """The report as Markdown: a header on the machine, then one table per model."""
    lines = ["# fdl bench report", ""]
    if title_note:
        lines += [title_note, ""]
    lines += [*_machine_lines(report.get("machine") or {}), ""]
    models = list(dict.fromkeys(row["model"] for row in report["rows"]))
    for model in models:
        lines += [f"## {model}", "", "| " + " | ".join(COLUMNS) + " |",
                  "|" + "|".join("---" for _ in COLUMNS) + "|"]
        rows = [row for row in report["rows"] if row["model"] == model]
        lines += ["| " + " | ".join(_cells(row)) + " |" for row in rows]
        lines.append("")
        errors = [f"- {row['mode']}: {row['measurement_error']}" for row in rows
                  if row.get("measurement_error")]
        if errors:
            lines += ["Measurement errors (not results):", "", *errors, ""]
    return "\n".join(lines)


def _machine_lines(machine: dict[str, Any]) -> list[str]:
    cpu = machine.get("cpu_model") or "unknown CPU"
    cores = machine.get("logical_cores")
    gpus = [g.get("name", "?") if isinstance(g, dict) else str(g)
            for g in machine.get("gpus") or []]
    slowdown = machine.get("emulated_slowdown")
    return [
        f"- machine: {cpu}" + (f" ({cores} cores)" if cores else ""),
        f"- GPUs: {', '.join(gpus) if gpus else 'none'}",
        f"- date: {machine.get('date') or DASH}",
        "- emulated slowdown: " + (" + ".join(f"{f:g}x" for f in slowdown) if slowdown
                                   else "none"),
    ]


def _cells(row: dict[str, Any]) -> list[str]:
    evaluation = _fmt(row["eval"], "{:.4f}")
    if row["eval"] is not None and row["eval_std"] is not None:
        evaluation += f" ± {row['eval_std']:.4f}"
    return [row["mode"], evaluation, _fmt(row["reference"], "{:.4f}"),
            _fmt(row["wall_s"], "{:.1f}"), _fmt(row["samples_per_s"], "{:,.0f}"),
            _fmt(row["speedup_vs_fast_solo"], "{:.2f}x"),
            ERROR if row.get("measurement_error") else _efficiency(row),
            _fmt(row["syncs"], "{:.3g}"),
            _fmt(row["sync_overhead"], "{:.1%}"), _fmt(row["idle_fraction"], "{:.1%}")]


def _efficiency(row: dict[str, Any]) -> str:
    """``93.0% [85.3-99.9%]``: the mean's efficiency, then the seeds' least and most."""
    text = _fmt(row["efficiency_vs_ideal"], "{:.1%}")
    spread = row.get("efficiency_by_seed")
    if row["efficiency_vs_ideal"] is not None and spread:
        text += f" [{100 * spread[0]:.1f}-{spread[1]:.1%}]"
    return text


def _fmt(value: float | None, spec: str) -> str:
    return DASH if value is None else spec.format(value)


# --- files -----------------------------------------------------------------------------------

def write_report(directory: Path) -> list[Path]:
    """Write report.json, report.md and the PNG charts into ``directory``; return their paths."""
    directory = Path(directory)
    records, meta = _load(directory)
    machine = dict(meta.get("machine") or {})
    if not machine.get("date"):
        machine["date"] = meta.get("started") or datetime.now(timezone.utc).isoformat(
            timespec="seconds")
    report = build_report(records, machine=machine)
    pngs = _render_plots(report, records)
    # the names in report.md are shown as a terminal shows them, so `cat report.md` is safe
    markdown = shown(render_markdown(report, title_note=_title_note(meta)), lines=True)
    if pngs is None:
        markdown += "\nPlots skipped: matplotlib is not installed (pip install 'fdl[report]').\n"
    else:
        markdown += "\n## Plots\n\n" + "\n\n".join(f"![{name}]({name})" for name in pngs) + "\n"
    files = {"report.json": (json.dumps(report, indent=2) + "\n").encode(),
             "report.md": markdown.encode(), **(pngs or {})}
    try:
        return [write_atomic(directory / name, data) for name, data in files.items()]
    except OSError as exc:  # a read-only or full sweep directory
        raise os_failure(exc, doing=f"cannot write the report into {directory}") from exc


def _load(directory: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """:func:`load_results`, a directory that holds no sweep fdl bench can read being a usage
    error (exit 2, as ``fdl report`` given a directory that is no run's); an OS failure reading
    it stays a failure (exit 1)."""
    try:
        return load_results(directory)
    except FdlError as exc:
        if isinstance(exc, UsageError) or isinstance(exc.__cause__, OSError):
            raise
        raise UsageError(exc.message, hint=exc.hint) from exc


def _title_note(meta: dict[str, Any]) -> str:
    args = meta.get("args") or {}
    return "Sweep: " + ", ".join(f"{key}={value}" for key, value in args.items()) if args else ""


def _render_plots(report: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, bytes] | None:
    """PNG bytes by file name, or None when matplotlib is not installed."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return None
    pngs = {}
    for model in dict.fromkeys(row["model"] for row in report["rows"]):
        figure = Figure(figsize=(6, 4))
        axes = figure.add_subplot()
        for row in (r for r in report["rows"] if r["model"] == model):
            curve = loss_curve([r for r in records
                                if r["model"] == model and r["mode"] == row["mode"]])
            if curve:
                axes.plot(*zip(*curve, strict=True), marker="o", label=shown(row["mode"]))
        axes.set(title=f"{shown(model)}: train loss", xlabel="epoch",
                 ylabel="train loss (mean over seeds)")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        if axes.lines:
            axes.legend()
        pngs[f"loss-{_safe_name(model)}.png"] = _png(figure)
    pngs["throughput.png"] = _png(_throughput_figure(Figure, report))
    return pngs


def loss_curve(records: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(epoch, mean train loss over the records that reached that epoch), by epoch."""
    by_epoch: dict[int, list[float]] = {}
    for record in records:
        for entry in record.get("history") or []:
            if entry.get("train_loss") is not None:
                by_epoch.setdefault(int(entry["epoch"]), []).append(float(entry["train_loss"]))
    return [(epoch, statistics.fmean(losses)) for epoch, losses in sorted(by_epoch.items())]


def _throughput_figure(figure_class: Any, report: dict[str, Any]) -> Any:
    models = list(dict.fromkeys(row["model"] for row in report["rows"]))
    figure = figure_class(figsize=(max(6, 4 * len(models)), 4))
    for index, model in enumerate(models, start=1):
        axes = figure.add_subplot(1, len(models), index)
        rows = [r for r in report["rows"] if r["model"] == model and r["samples_per_s"]]
        labels = [shown(r["mode"]) + (" (measurement error)" if r.get("measurement_error") else "")
                  for r in rows]
        heights = [r["samples_per_s"] for r in rows]
        ideals = sorted({round(r["samples_per_s"] / r["efficiency_vs_ideal"], 6)
                         for r in rows if r["efficiency_vs_ideal"]})
        bars = axes.bar(labels + [f"ideal {i + 1}" if len(ideals) > 1 else "ideal"
                                  for i in range(len(ideals))], heights + ideals)
        for bar in bars[len(rows):]:
            bar.set_hatch("//")
            bar.set_alpha(0.5)
        for bar, row in zip(bars, rows, strict=False):  # an impossible figure is no result
            if row.get("measurement_error"):
                bar.set_color("lightgrey")
                bar.set_hatch("xx")
        axes.set(title=shown(model), ylabel="samples/s")
        axes.tick_params(axis="x", labelrotation=45)
    figure.tight_layout()
    return figure


def _png(figure: Any) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "-", name)
