"""fdl speaks HTTP in one place, fdl/download/, proven from the source: no module outside it
imports an HTTP client library, and the modules inside it import httpx but never httpx's own
insides (httpcore, h11, h2), whose private attributes fdl once patched.

Every ``fdl/**/*.py`` is parsed with ``ast``, nothing imported, and every import a reader would
see counts: module level, inside ``if TYPE_CHECKING:``, inside functions and classes, and
``importlib.import_module``/``__import__`` with a literal name. ``from http import client``
counts as importing ``http.client``. A library counts with its submodules (``httpx._client``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from test_layers import is_import_call

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "fdl"
HTTP_HOME = "fdl/download"  # the one folder that may speak HTTP
HTTP_MODULES = ("httpx", "httpcore", "h11", "h2", "http.client", "urllib.request", "requests")
HTTPX_INSIDES = ("httpcore", "h11", "h2")


def imported_names(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, dotted name) for each module an import in ``tree`` may bring in: for ``from m
    import a``, both ``m`` and ``m.a`` (``a`` may be a submodule). Relative imports are fdl's
    own and left out."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            yield node.lineno, node.module
            yield from ((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
        elif is_import_call(node):
            yield node.lineno, node.args[0].value  # type: ignore[attr-defined]


def imports_of(modules: tuple[str, ...], files: list[Path], *, root: Path) -> list[str]:
    """Each import of one of ``modules`` (or a submodule of one) in ``files``, as
    ``path:line imports name`` (one line per statement and module)."""
    found = []
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, name in sorted(imported_names(tree)):
            hit = next((m for m in modules if name == m or name.startswith(f"{m}.")), None)
            if hit is not None:
                found.append(f"{path.relative_to(root)}:{line} imports {hit}")
    return list(dict.fromkeys(found))


def sources(root: Path, *, inside: bool) -> list[Path]:
    """The ``.py`` files of ``root/fdl`` inside ``fdl/download`` or outside it."""
    home = root / HTTP_HOME
    return [path for path in sorted((root / PACKAGE).rglob("*.py"))
            if path.is_relative_to(home) == inside]


def test_only_the_download_package_speaks_http():
    found = imports_of(HTTP_MODULES, sources(ROOT, inside=False), root=ROOT)
    assert found == [], ("HTTP belongs in fdl/download/ (call fdl.download.fetch.download "
                         "instead):\n" + "\n".join(found))


def test_the_download_package_uses_httpx_not_its_insides():
    assert sources(ROOT, inside=True), "fdl/download/ has no modules: did it move?"
    found = imports_of(HTTPX_INSIDES, sources(ROOT, inside=True), root=ROOT)
    assert found == [], ("use httpx's public API; its insides change without notice:\n"
                         + "\n".join(found))


# The checks above must be able to fail: the same finder on a package written for the purpose.

def test_every_kind_of_import_is_seen(tmp_path):
    files = {
        "fdl/download/client.py": "import httpx\nfrom urllib.request import url2pathname\n",
        "fdl/eager.py": "import httpx\nimport h2.connection\n",
        "fdl/typed.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                         "    from httpcore import ConnectionPool\n"),
        "fdl/lazy.py": "def get():\n    from http import client\n    import requests\n",
        "fdl/dynamic.py": "import importlib\nimportlib.import_module('h11')\n__import__('httpx')\n",
        "fdl/fine.py": ("import urllib.parse\nfrom http import HTTPStatus\nfrom . import typed\n"
                        "import http.server\nimport httpxtra\n"),
    }
    for relative, text in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert imports_of(HTTP_MODULES, sources(tmp_path, inside=False), root=tmp_path) == [
        "fdl/dynamic.py:2 imports h11",
        "fdl/dynamic.py:3 imports httpx",
        "fdl/eager.py:1 imports httpx",
        "fdl/eager.py:2 imports h2",
        "fdl/lazy.py:2 imports http.client",
        "fdl/lazy.py:3 imports requests",
        "fdl/typed.py:3 imports httpcore",
    ]
    assert imports_of(HTTPX_INSIDES, sources(tmp_path, inside=True), root=tmp_path) == []
