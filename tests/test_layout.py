"""The test tree stays collectable: pytest's default import mode needs unique basenames for test
modules in folders without __init__.py (a duplicate breaks collection of the whole suite)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path


def test_test_module_basenames_are_unique():
    names = Counter(path.name for path in Path(__file__).parent.rglob("test_*.py"))
    assert [name for name, count in names.items() if count > 1] == []
