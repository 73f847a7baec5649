"""curves.png: loss and eval metrics per epoch, drawn with matplotlib (the `report` extra)."""

from __future__ import annotations

import builtins
import importlib.util

import pytest

from fdl.rundir.timeline_plot import write_curves_png

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


def test_nothing_to_plot_writes_nothing(tmp_path):
    assert write_curves_png(tmp_path, [{"epoch": 1, "train_loss": None, "eval": {}}]) is None
    assert not (tmp_path / "timeline").exists()


def test_without_matplotlib_it_returns_none(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert write_curves_png(tmp_path, EPOCHS) is None
    assert not (tmp_path / "timeline").exists()
