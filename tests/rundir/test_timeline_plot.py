"""curves.png: loss and eval metrics per epoch, drawn with matplotlib (the `report` extra)."""

from __future__ import annotations

import importlib.util
import warnings

import pytest
from helpers import without_module

from fdl.rundir.timeline_plot import plottable, write_curves_png

EPOCHS = [{"epoch": e, "samples": 100 * e, "train_loss": 1.0 / e,
           "eval": {"accuracy": 0.5 + 0.1 * e, "loss": 1.2 / e}} for e in (1, 2, 3)]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib not installed: pip install 'fdl[report]'")
def test_curves_png_is_written_beside_the_timeline(tmp_path):
    path = write_curves_png(tmp_path, EPOCHS)
    assert path == tmp_path / "timeline" / "curves.png"
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 10_000  # two panels of lines, not an empty canvas
    assert [p.name for p in path.parent.iterdir()] == ["curves.png"]  # no temporary left


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib not installed: pip install 'fdl[report]'")
@pytest.mark.parametrize("name", ["acc\x1b]0;owned\x07", "\u202eycarucca", "$\\frac{", "正確率"])
def test_a_hostile_metric_name_is_drawn_and_nothing_reaches_the_terminal(tmp_path, name):
    """A glyph the font lacked was a warning that printed the name raw (its escape sequence
    acted on): the control characters and the CJK name failed before the fix; the ``$`` and
    right-to-left names passed before it too and stay as cases the drawing must survive."""
    epochs = [{"epoch": e, "eval": {name: 0.5 + 0.1 * e}} for e in (1, 2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = write_curves_png(tmp_path, epochs)
    assert path is not None and path.read_bytes().startswith(PNG_SIGNATURE)
    assert [str(w.message) for w in caught] == []


def test_nothing_to_plot_writes_nothing(tmp_path):
    assert write_curves_png(tmp_path, [{"epoch": 1, "train_loss": None, "eval": {}}]) is None
    assert not (tmp_path / "timeline").exists()


def test_nothing_to_plot_imports_no_matplotlib(tmp_path):
    """A loop that logs no loss and evaluates nothing: its epochs have no number, and the
    launcher's end is not made to wait for matplotlib's import (0.5-0.8 s of a 5 s run on this
    2-core VM). A fresh interpreter, so nothing is loaded yet."""
    import json
    import subprocess
    import sys

    code = f"""
import json, sys
from pathlib import Path
from fdl.rundir.timeline_plot import plottable, write_curves_png
epochs = [{{"epoch": 1, "samples": 64, "train_loss": None, "eval": {{}}}}, {{"epoch": 2}}]
print(json.dumps({{"plottable": plottable(epochs),
                  "written": write_curves_png(Path({str(tmp_path)!r}), epochs),
                  "imported": any(m.startswith("matplotlib") for m in sys.modules)}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert json.loads(out.splitlines()[-1]) == {"plottable": False, "written": None,
                                                "imported": False}
    assert plottable(EPOCHS)


def test_without_matplotlib_it_returns_none(tmp_path, monkeypatch):
    without_module(monkeypatch, "matplotlib")
    assert write_curves_png(tmp_path, EPOCHS) is None
    assert not (tmp_path / "timeline").exists()


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib not installed: pip install 'fdl[report]'")
def test_matplotlib_is_imported_once_on_a_thread_of_its_own():
    """What fdl run's launcher calls as its workers start: the import runs on a thread of its
    own, once however often it is called, and leaves the modules write_curves_png imports
    loaded. A fresh interpreter, so nothing is loaded yet."""
    import json
    import subprocess
    import sys

    code = """
import json, sys, threading
from fdl.rundir import timeline_plot
before = "matplotlib.figure" in sys.modules
timeline_plot.load_in_background()
first = timeline_plot._loading
timeline_plot.load_in_background()
again = timeline_plot._loading
first.join(timeout=120)
print(json.dumps({"before": before, "once": first is again,
                  "own_thread": first.ident not in (None, threading.main_thread().ident),
                  "loaded": all(m in sys.modules for m in
                                ("matplotlib.figure", "matplotlib.backends.backend_agg"))}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=180, check=True).stdout
    assert json.loads(out.splitlines()[-1]) == {"before": False, "once": True, "own_thread": True,
                                                "loaded": True}


def test_a_thread_that_cannot_start_leaves_the_run_alone(monkeypatch):
    """Called inside torch's agent as the workers start: a process out of threads must not fail
    the run for its curves (they are imported at the end instead)."""
    import threading

    from fdl.rundir import timeline_plot

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(timeline_plot, "_loading", None)
    monkeypatch.setattr(threading.Thread, "start", no_thread)
    timeline_plot.load_in_background()  # returns, raising nothing
