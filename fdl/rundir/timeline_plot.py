"""``timeline/curves.png``: training loss and every evaluation metric per epoch, from the lines
of ``metrics.jsonl``, beside ``timeline.html`` for a report or a README.

Losses (``train_loss`` and any eval metric whose name contains "loss") share the left panel;
the other eval metrics (accuracy, ...) the right one. matplotlib is the optional ``report``
extra (``pip install 'fdl[report]'``): it is imported inside :func:`write_curves_png`, through
its object API and the Agg canvas, so no global backend is switched and no window can open.
"""

from __future__ import annotations

import contextlib
import io
import math
import threading
import warnings
from pathlib import Path
from typing import Any

from fdl.rundir.timeline import directory

FILE = "curves.png"


def load_in_background() -> None:
    """Import matplotlib's figure and Agg canvas on a thread of their own (a daemon, once per
    process), so that :func:`write_curves_png` at a run's end finds them loaded. ``fdl run``
    calls it as its workers start: its launcher then waits idle while they train, and the
    import is the larger part of the curves' cost, otherwise paid after the training. Not
    earlier: it holds the GIL against the rendezvous. Nothing happens without matplotlib
    (:func:`write_curves_png` then says so; figures: docs/run.md "Timeline")."""
    global _loading
    with _loading_lock:
        if _loading is not None:
            return
        _loading = threading.Thread(target=_import_matplotlib, name="fdl-matplotlib-import",
                                    daemon=True)
    with contextlib.suppress(RuntimeError):  # no thread to be had: imported at the end
        _loading.start()


def _import_matplotlib() -> None:
    try:
        from matplotlib import figure  # noqa: F401
        from matplotlib.backends import backend_agg  # noqa: F401
    except Exception:  # none, or a broken one: write_curves_png's own import says
        pass


_loading: threading.Thread | None = None
_loading_lock = threading.Lock()


def write_curves_png(run_dir: Path, epochs: list[dict[str, Any]]) -> Path | None:
    """Write ``run_dir/timeline/curves.png`` from ``epochs`` (``metrics.jsonl`` lines) and return
    its path; None when no epoch has a number to plot (matplotlib is then not imported: it is
    most of the curves' cost) or matplotlib is not installed."""
    losses, others = _curves(epochs)
    if not losses and not others:
        return None
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    from fdl.files import write_atomic

    panels = [(panel, label) for panel, label in ((losses, "loss"), (others, "metric")) if panel]
    figure = Figure(figsize=(5.5 * len(panels), 4), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    buffer = io.BytesIO()
    # A metric's name is the script's: a glyph the font lacks is a warning that would print the
    # name raw on the terminal (a control character acted on), so none is shown from here
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for index, (panel, ylabel) in enumerate(panels):
            axes = figure.add_subplot(1, len(panels), index + 1)
            for name, points in panel.items():
                axes.plot([x for x, _ in points], [y for _, y in points], marker="o",
                          label=_label(name))
            axes.set_xlabel("epoch")
            axes.set_ylabel(ylabel)
            axes.xaxis.get_major_locator().set_params(integer=True)
            axes.grid(alpha=0.3)
            axes.legend()
        figure.savefig(buffer, format="png")
    path = directory(run_dir) / FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, buffer.getvalue())
    return path


def _label(name: str) -> str:
    """A metric's name as a legend shows it: control characters escaped (fdl.console.shown) and
    ``$`` taken literally (matplotlib reads ``$...$`` as mathtext)."""
    from fdl.console import shown

    return shown(name).replace("$", r"\$")


def plottable(epochs: list[dict[str, Any]]) -> bool:
    """Whether an epoch of ``epochs`` has a number :func:`write_curves_png` would plot."""
    return any(_curves(epochs))


def _curves(epochs: list[dict[str, Any]]) -> tuple[dict[str, list], dict[str, list]]:
    """``(losses, others)``: metric name -> [(epoch, value)], numbers only, in epoch order."""
    losses: dict[str, list] = {}
    others: dict[str, list] = {}
    for position, line in enumerate(epochs, start=1):
        epoch = line.get("epoch", position)
        values = {"train loss": line.get("train_loss")}
        evals = line.get("eval")
        if isinstance(evals, dict):
            values.update({f"eval {name}": value for name, value in evals.items()})
        for name, value in values.items():
            if not _is_number(value) or not _is_number(epoch):
                continue
            target = losses if "loss" in name else others
            target.setdefault(name, []).append((epoch, value))
    return losses, others


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))

