"""One owner per run-directory file: no module outside fdl/rundir/ names a file or directory of
a run directory; each is named once, by the module that writes and checks it.

Read from the source with ``ast``: every string constant a module holds (f-string pieces too),
docstrings aside (prose may name a file; code may not). A file name counts wherever it appears
in a string (``"summary.json"``, ``f"{d}/summary.json"``); a directory name (``timeline``,
``logs``...) only as a whole string or a path component, since the words are common.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from fdl.rundir import (
    checkpoints,
    config,
    crash,
    layout,
    metrics,
    model,
    progress,
    summary,
    timeline,
    timeline_merge,
    timeline_plot,
    timeline_trace,
)

ROOT = Path(__file__).resolve().parents[2]
FILES = (config.FILE, summary.FILE, metrics.FILE, model.FILE, progress.FILE,
         checkpoints.MANIFEST, checkpoints.ENGINE_FILE, timeline_merge.HTML_FILE,
         timeline_plot.FILE, timeline_trace.TRACE_FILE, "samples-node", ".error.json",
         crash.SUFFIX, layout.AGENT_LOG)
# (not layout.TENSORBOARD: the directory is named after its setting, a key many modules use)
DIRECTORIES = (layout.LOGS, checkpoints.DIRNAME, timeline.DIRNAME)


def strings(tree: ast.Module) -> Iterator[ast.Constant]:
    """Every string constant of ``tree`` but docstrings."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docstrings:
            yield node


def names_a_run_file(text: str) -> str | None:
    for name in FILES:
        if name in text:
            return name
    parts = text.replace("\\", "/").split("/")
    return next((name for name in DIRECTORIES if name in parts), None)


def run_file_mentions(root: Path, package: Path) -> list[str]:
    found = []
    for path in sorted(package.rglob("*.py")):
        if (package / "rundir") in path.parents:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in strings(tree):
            name = names_a_run_file(node.value)
            if name is not None:
                found.append(f"{path.relative_to(root)}:{node.lineno} names {name!r}")
    return found


def test_only_the_run_directory_package_names_its_files():
    found = run_file_mentions(ROOT, ROOT / "fdl")
    assert found == [], ("name these through fdl.rundir (the module that owns the file):\n"
                         + "\n".join(found))


def test_the_check_sees_a_file_named_in_code_but_not_in_prose(tmp_path):
    package = tmp_path / "fdl"
    (package / "rundir").mkdir(parents=True)
    (package / "rundir" / "summary.py").write_text('FILE = "summary.json"\n')
    (package / "report.py").write_text(
        '"""Reads summary.json."""\n'
        'def read(run_dir):\n'
        '    """From run_dir/timeline."""\n'
        '    return run_dir / "summary.json", f"{run_dir}/timeline", "a timeline of events"\n')
    assert run_file_mentions(tmp_path, package) == [
        "fdl/report.py:4 names 'summary.json'", "fdl/report.py:4 names 'timeline'"]
