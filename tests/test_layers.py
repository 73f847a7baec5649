"""fdl's layers, proven from the source: imports only go down the layer table, and no module
reaches itself through a chain of imports.

The graph is built with ``ast`` from every ``fdl/**/*.py``, without importing anything, and
counts every import a reader would see: module level, inside ``if TYPE_CHECKING:``, inside
functions, absolute and relative, and ``importlib.import_module("fdl....")`` with a literal name.
``from fdl.x import name`` counts as importing ``fdl.x.name`` when that is a module, else
``fdl.x``. The packages a module's name passes through (``fdl``, ``fdl.x``) are not counted:
Python runs their ``__init__.py`` first, but that is the package's own business, and counting it
would make everything depend on ``fdl/__init__.py``.

Lazy imports count as much as eager ones on purpose: a function-level import hides a cycle from
Python's import machinery, not from a reader, and "imports only go downward" is about what a
module needs, not when it loads it. (Which heavy libraries may be imported at module level is
ruff's TID253 in pyproject.toml; :func:`test_only_torch_is_eager_where_ruff_cannot_tell` covers
the one gap ruff leaves.)
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

LAYERS: dict[str, tuple[str, ...]] = {
    "base": ("fdl.errors", "fdl.version", "fdl.paths", "fdl.files", "fdl.readback", "fdl.console",
             "fdl.ranges", "fdl.settings"),
    "system": ("fdl.system",),
    "download": ("fdl.download",),
    "rundir": ("fdl.rundir",),
    "libtorch": ("fdl.libtorch",),
    "engine": ("fdl.engine",),
    "scaffold": ("fdl.scaffold",),
    "launch": ("fdl.launch",),
    "bench": ("fdl.bench",),
    "compare": ("fdl.compare",),
    "cli": ("fdl.cli",),
    "top": ("fdl", "fdl.__main__"),
}
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "base": ("base",),
    "system": ("base",),
    "download": ("base",),
    "rundir": ("base",),
    "libtorch": ("download", "system", "base"),
    "engine": ("rundir", "base"),
    "scaffold": ("libtorch", "system", "base"),
    "launch": ("engine", "rundir", "system", "base"),
    "bench": ("launch", "engine", "libtorch", "rundir", "download", "system", "base"),
    "compare": ("launch", "rundir", "system", "base"),
    "cli": ("bench", "compare", "launch", "scaffold", "engine", "libtorch", "rundir", "download",
            "system", "base"),
    "top": ("cli", "bench", "compare", "launch", "scaffold", "engine", "libtorch", "rundir",
            "download", "system", "base"),
}
"""The layer table, ``LAYERS`` and ``MAY_IMPORT``: which modules form each layer (a package name
covers its whole package), and which layers each layer may import besides its own. This is the
one place the order is written down; docs/architecture.md quotes it. A new module under fdl/
must be placed here (test_every_module_has_a_layer).

* base: leaf modules of the standard library's kind (errors, paths, files, the console, the
  settings contract); they import each other only, without cycles.
* system: the host survey (GPUs, host, installed torch, CUDA rules, machine facts).
* download: fdl's HTTP downloads (the one download-and-verify, ranged connections, the URL
  rule, the HTTP client), shared by libtorch and bench.
* rundir: the run directory, one module per file contract (writes and checks it), and its
  readers (``fdl report``, the merged timeline).
* libtorch: the catalog, store, installs, builds, coverage and the diagnose report, which
  combine the survey with the catalog.
* engine: the El Che training engine that every worker runs; it never imports the launcher.
* scaffold: ``fdl init``'s project templates.
* launch: ``fdl run``, which plans and starts workers running the engine (and runs one
  ``fdl run`` as a child process for bench and compare).
* bench: ``fdl bench``, sweeps of ``fdl run`` cells over the model zoo.
* compare: ``fdl compare``, a user's script under each policy; never imports bench, nor bench
  compare.
* cli: the Typer commands, adapters over everything below.
* top: ``fdl/__init__.py`` (the lazy ``fdl.Trainer``) and ``fdl/__main__.py``.

Modules inside one layer may import each other; the cycle check keeps that a tree.
"""

ENGINE_ORDER: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("api", ("loop", "trainer")),
    ("round", ("assembly", "boundary", "finish", "rounds")),
    ("parts", ("checks", "feed", "parts", "recorder", "recovery", "replica", "tallies")),
    ("primitives", ()),  # every other module of fdl.engine
)
"""The engine's own order, highest first (docs/architecture.md "The engine"): the public face
(``fdl.init``'s ``Run``, ``fdl.Trainer``); the round (the parts' assembly, the loop of steps, its
boundary, the run's end); the parts of one rank's run (the replica, the feed, the tallies, the
recorder, the checkpointer, the checks of what the script gives); and the primitives every part
is made of (the plan and the policies, averaging, the gradient syncs, collectives, data,
timing). A module imports its own level or the levels below it."""

# ruff's per-file-ignores switch TID253 off for a whole file, so in these packages, which may
# import torch at module level, httpx, pynvml and rich are held to lazy imports here instead.
EAGER_TORCH_PACKAGES = ("fdl.engine", "fdl.bench")
LAZY_ONLY = ("httpx", "pynvml", "rich")


@dataclass(frozen=True)
class Import:
    """One import of one fdl module by another, where a reader finds it."""

    source: str  # the importing module, e.g. "fdl.launch.spec"
    target: str  # the imported module, e.g. "fdl.system.gpus"
    path: Path
    line: int
    where: str  # "module level", "TYPE_CHECKING" or "function level"

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} ({self.path}:{self.line}, {self.where})"


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` under ``root`` by dotted name (a package by its own name)."""
    names = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def import_graph(root: Path, package: str) -> list[Import]:
    """Every import between modules of ``package`` (a directory under ``root``), by the rules in
    the module docstring; imports of anything outside ``package`` are left out."""
    modules = module_names(root, package)
    found = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        for node, where in _imports(tree):
            targets = _targets(node, source=name, is_package=is_package, modules=modules)
            for target in dict.fromkeys(targets):  # `from m import a, b` is one import of m
                if target in modules and target != name:
                    found.append(Import(name, target, path.relative_to(root), node.lineno, where))
    return found


def _imports(tree: ast.Module) -> Iterator[tuple[ast.AST, str]]:
    """Each import statement or literal ``import_module`` call, and the context it sits in."""
    def walk(node: ast.AST, where: str) -> Iterator[tuple[ast.AST, str]]:
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                inner = "function level"
            elif isinstance(child, ast.If) and where == "module level" and _is_type_checking(child):
                inner = "TYPE_CHECKING"
            if isinstance(child, (ast.Import, ast.ImportFrom)) or is_import_call(child):
                yield child, where
            yield from walk(child, inner)

    yield from walk(tree, "module level")


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def is_import_call(node: ast.AST) -> bool:
    """An ``import_module("...")`` or ``__import__("...")`` call with a literal name."""
    if not isinstance(node, ast.Call) or not node.args:
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    first = node.args[0]
    return name in ("import_module", "__import__") and isinstance(first, ast.Constant) \
        and isinstance(first.value, str)


def _targets(node: ast.AST, *, source: str, is_package: bool,
             modules: dict[str, Path]) -> list[str]:
    """The dotted names one import statement or call brings in (modules or not)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.Call):
        return [node.args[0].value]  # type: ignore[attr-defined]  (_is_import_call checked it)
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if node.level:  # relative: strip one package per dot, counting from source's own package
        anchor = source.split(".")
        anchor = anchor[:len(anchor) - node.level + (1 if is_package else 0)]
        base = ".".join([*anchor, *([base] if base else [])])
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
            for alias in node.names]


def fdl_imports() -> list[Import]:
    return import_graph(ROOT, "fdl")


def layer_of(module: str) -> str | None:
    """The layer whose longest listed name is ``module`` or a package containing it."""
    best = max(((name, layer) for layer, names in LAYERS.items() for name in names
                if module == name or (name != "fdl" and module.startswith(f"{name}."))),
               key=lambda pair: len(pair[0]), default=None)
    return best[1] if best else None


def layer_violations(edges: list[Import]) -> list[str]:
    """The edges that import upward or sideways in the layer table, as readable lines."""
    problems = []
    for edge in edges:
        mine, theirs = layer_of(edge.source), layer_of(edge.target)
        if mine is None or theirs is None:
            continue  # reported by test_every_module_has_a_layer
        if theirs != mine and theirs not in MAY_IMPORT[mine]:
            problems.append(f"{edge}: {mine} may import only {', '.join(MAY_IMPORT[mine])}, "
                            f"not {theirs}")
    return problems


def cycles(edges: list[Import]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), sorted."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, set()).add(edge.target)
        graph.setdefault(edge.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def cycle_report(edges: list[Import]) -> list[str]:
    """Each cycle with the imports that close it, for the failure message."""
    lines = []
    for component in cycles(edges):
        members = set(component)
        lines.append(f"cycle among {', '.join(component)}:")
        lines += [f"    {edge}" for edge in edges
                  if edge.source in members and edge.target in members]
    return lines


def test_every_module_has_a_layer():
    unplaced = [name for name in module_names(ROOT, "fdl") if layer_of(name) is None]
    assert unplaced == [], f"add these modules to LAYERS in {__file__}: {unplaced}"


def test_imports_only_go_down_the_layers():
    problems = layer_violations(fdl_imports())
    assert problems == [], "imports against the layer order:\n" + "\n".join(problems)


def test_no_module_imports_itself_through_others():
    report = cycle_report(fdl_imports())
    assert report == [], "import cycles between fdl's files:\n" + "\n".join(report)


def engine_level(module: str) -> int | None:
    """The index of ``module``'s level in :data:`ENGINE_ORDER` (0 the highest); None outside
    the engine."""
    if not module.startswith("fdl.engine."):
        return None
    name = module.removeprefix("fdl.engine.").split(".")[0]
    return next((index for index, (_, names) in enumerate(ENGINE_ORDER) if name in names),
                len(ENGINE_ORDER) - 1)


def engine_violations(edges: list[Import]) -> list[str]:
    """The engine's imports that go up its own order."""
    problems = []
    for edge in edges:
        mine, theirs = engine_level(edge.source), engine_level(edge.target)
        if mine is not None and theirs is not None and theirs < mine:
            problems.append(f"{edge}: {ENGINE_ORDER[mine][0]} may not import "
                            f"{ENGINE_ORDER[theirs][0]}")
    return problems


def test_the_engine_imports_only_down_its_own_order():
    names = {name.removeprefix("fdl.engine.") for name in module_names(ROOT, "fdl")
             if name.startswith("fdl.engine.")}
    listed = {name for _, members in ENGINE_ORDER for name in members}
    assert listed <= names, f"ENGINE_ORDER names modules that do not exist: {listed - names}"
    problems = engine_violations(fdl_imports())
    assert problems == [], "imports against the engine's order:\n" + "\n".join(problems)


@pytest.mark.parametrize(("source", "target", "allowed"), [
    ("fdl.engine.loop", "fdl.engine.assembly", True),
    ("fdl.engine.rounds", "fdl.engine.boundary", True),
    ("fdl.engine.boundary", "fdl.engine.parts", True),
    ("fdl.engine.replica", "fdl.engine.hook_sync", True),
    ("fdl.engine.plan", "fdl.engine.policies", True),
    ("fdl.engine.rounds", "fdl.engine.loop", False),
    ("fdl.engine.replica", "fdl.engine.rounds", False),
    ("fdl.engine.averaging", "fdl.engine.replica", False),
    ("fdl.engine.plan", "fdl.engine.boundary", False),
])
def test_engine_rule_tells_down_from_up(source, target, allowed):
    edge = Import(source, target, Path("x.py"), 1, "module level")
    assert (engine_violations([edge]) == []) is allowed


def test_only_torch_is_eager_where_ruff_cannot_tell():
    eager = []
    for name, path in module_names(ROOT, "fdl").items():
        if not name.startswith(tuple(f"{p}." for p in EAGER_TORCH_PACKAGES)):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node, where in _imports(tree):
            roots = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [getattr(node, "module", None) or ""]
            eager += [f"{path.relative_to(ROOT)}:{node.lineno} imports {r}" for r in roots
                      if where == "module level" and r.split(".")[0] in LAZY_ONLY]
    assert eager == [], "import these inside the function that needs them:\n" + "\n".join(eager)


# The checks above must be able to fail: the graph builder on a package written for the purpose.

def _write(root: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_graph_sees_lazy_type_checking_relative_and_dynamic_imports(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "def f():\n    from pkg.b import thing\n    return thing\n",
        "pkg/b.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from pkg import a\nthing = 1\n"),
        "pkg/sub/__init__.py": "from . import c\n",
        "pkg/sub/c.py": "from ..b import thing\nimport importlib\nimportlib.import_module('pkg.a')\n",
        "pkg/d.py": "import json\nimport pkg.sub.c\nfrom pkg.sub import missing_name\n",
    })
    edge_list = import_graph(tmp_path, "pkg")
    edges = {(e.source, e.target, e.where) for e in edge_list}
    assert edges == {
        ("pkg.a", "pkg.b", "function level"),
        ("pkg.b", "pkg.a", "TYPE_CHECKING"),
        ("pkg.sub", "pkg.sub.c", "module level"),
        ("pkg.sub.c", "pkg.b", "module level"),
        ("pkg.sub.c", "pkg.a", "module level"),
        ("pkg.d", "pkg.sub.c", "module level"),
        ("pkg.d", "pkg.sub", "module level"),
    }
    assert cycles(edge_list) == [["pkg.a", "pkg.b"]]
    assert any("pkg/a.py:2, function level" in line for line in cycle_report(edge_list))


@pytest.mark.parametrize(("source", "target", "allowed"), [
    ("fdl.engine.config", "fdl.launch.settings", False),
    ("fdl.system.report", "fdl.libtorch.catalog", False),
    ("fdl.settings", "fdl.system.gpus", False),
    ("fdl.launch.spec", "fdl", False),
    ("fdl.engine.trainer", "fdl.settings", True),
    ("fdl.libtorch.coverage", "fdl.system.gpus", True),
    ("fdl.cli.run", "fdl.launch", True),
    ("fdl.__main__", "fdl.cli.main", True),
    ("fdl.files", "fdl.download.fetch", False),
    ("fdl.download.fetch", "fdl.libtorch.store", False),
    ("fdl.download.ranged", "fdl.files", True),
    ("fdl.bench.fetch", "fdl.download.fetch", True),
    ("fdl.compare.run", "fdl.launch.child", True),
    ("fdl.compare.run", "fdl.system.facts", True),
    ("fdl.cli.compare", "fdl.compare.plan", True),
    ("fdl.compare.run", "fdl.bench.results", False),
    ("fdl.bench.sweep", "fdl.compare.run", False),
    ("fdl.system.facts", "fdl.launch.child", False),
    ("fdl.engine.loop", "fdl.rundir.summary", True),
    ("fdl.rundir.report", "fdl.engine.state", False),
    ("fdl.rundir.config", "fdl.settings", True),
    ("fdl.launch.spec", "fdl.rundir.layout", True),
    ("fdl.rundir.timeline", "fdl.system.gpus", False),
])
def test_layer_rule_tells_down_from_up(source, target, allowed):
    edge = Import(source, target, Path("x.py"), 1, "module level")
    assert (layer_violations([edge]) == []) is allowed
