"""Shared fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture
def flodl_home(tmp_path, monkeypatch):
    home = tmp_path / "flodl-home"
    monkeypatch.setenv("FLODL_HOME", str(home))
    return home
