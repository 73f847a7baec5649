"""An `fdl init` project installs where fdl is not: into a fresh venv, offline, fdl from the
wheel in the project's `wheels/`, then its smoke test with `make test`. And the Docker build
context holds every file the Dockerfile copies, the wheel among them.

The fresh venv has no fdl, and no package index is reachable (``--no-index``). What fdl and
the project need from elsewhere (torch, typer, pytest, setuptools to build the project) is
the copy this test runs with: only the installed distributions the project's declarations
reach — its ``dependencies`` and ``build-system.requires``, fdl's own requirements read from
the wheel's METADATA, and theirs, transitively — are linked into a folder the venv sees
through a ``.pth`` file. So a dependency the project forgets to declare is missing there, as
in a real fresh venv, and pip resolves every requirement against what is present (then `pip
check`). ``python -m venv --system-site-packages`` cannot do this here: torch lives in the venv
that runs the tests, not in a system site, and it would bring every package, declared or not.
pip is this environment's, pointed at the venv with ``--python``.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from importlib import metadata
from pathlib import Path

import pytest
from helpers import GPU_FIXTURES, clean_env, run_fdl
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

NO_GPU = {"FDL_GPU_SURVEY": str(GPU_FIXTURES / "none.json")}


def init_project(root: Path, *args: str) -> Path:
    proc = run_fdl("init", "demo", *args, cwd=root, env=NO_GPU)
    assert proc.returncode == 0, proc.stderr
    return root / "demo"


def fresh_env() -> dict[str, str]:
    """The environment for the venv's commands: nothing that would find this checkout's fdl
    or another package source."""
    env = {name: value for name, value in clean_env().items()
           if not name.startswith("PIP_") and name not in ("PYTHONPATH", "PYTHONHOME")}
    # No pip configuration files either: this host's add find-links and local indexes.
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "PIP_NO_INPUT": "1"}


def declared_requirements(project: Path) -> list[Requirement]:
    """What the project asks for: its dependencies (fdl's expanded from the wheel it carries)
    and what builds it."""
    pyproject = tomllib.loads((project / "pyproject.toml").read_text())
    roots = [Requirement(text) for text in (*pyproject["project"]["dependencies"],
                                            *pyproject["build-system"]["requires"])]
    wanted: list[Requirement] = []
    for requirement in roots:
        if canonicalize_name(requirement.name) != "fdl":
            wanted.append(requirement)
            continue
        for wheel in sorted(project.glob("wheels/fdl-*.whl")):  # none: pip says so below
            wanted += [req for req in wheel_requirements(wheel) if wanted_by(req, requirement)]
    return wanted


def wheel_requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        headers = Parser().parsestr(archive.read(name).decode("utf-8"))
    return [Requirement(text) for text in headers.get_all("Requires-Dist") or []]


def wanted_by(requirement: Requirement, parent: Requirement) -> bool:
    """Whether ``requirement`` of a distribution applies when ``parent`` asked for it."""
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({"extra": extra})
               for extra in (*parent.extras, ""))


def installed_closure(requirements: list[Requirement]) -> list[metadata.Distribution]:
    """The distributions of this environment that ``requirements`` reach, transitively."""
    found: dict[str, metadata.Distribution] = {}
    todo = list(requirements)
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        if name in found:
            continue
        dist = metadata.distribution(name)  # PackageNotFoundError: this environment lacks it
        found[name] = dist
        todo += [req for req in map(Requirement, dist.requires or [])
                 if wanted_by(req, requirement)]
    return list(found.values())


def link_distributions(dists: list[metadata.Distribution], folder: Path) -> None:
    """Link each distribution's top-level entries (packages, modules, dist-info) into
    ``folder``; scripts outside site-packages are left out."""
    folder.mkdir()
    for dist in dists:
        site = Path(dist.locate_file(""))
        tops = {Path(str(file)).parts[0] for file in dist.files or []}
        for top in sorted(tops - {".."}):
            if (site / top).exists() and not (folder / top).exists():
                (folder / top).symlink_to(site / top)


def make_venv(tmp_path: Path, project: Path) -> Path:
    """A fresh venv that sees only what ``project`` declares; returns its python."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   env=fresh_env(), timeout=60)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, env=fresh_env()).stdout.strip()
    link_distributions(installed_closure(declared_requirements(project)), tmp_path / "deps")
    (Path(site) / "declared_deps.pth").write_text(f"{tmp_path / 'deps'}\n")
    return python


def pip(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "--python", str(python), *args],
                          cwd=cwd, env=fresh_env(), capture_output=True, text=True, timeout=240)


def test_the_project_installs_offline_in_a_fresh_venv_and_its_smoke_test_passes(tmp_path):
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    project = init_project(tmp_path, "--no-docker")
    python = make_venv(tmp_path, project)

    # The README's install (make install: pip install --find-links wheels -e .), offline: no
    # index, and setuptools from the venv rather than downloaded into an isolated build.
    proc = pip(python, "install", "--no-index", "--no-build-isolation", "--find-links",
               "wheels", "-e", ".", cwd=project)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = pip(python, "check", cwd=project)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    where = subprocess.run([str(python), "-c", "import fdl; print(fdl.__file__)"],
                           cwd=tmp_path, env=fresh_env(), capture_output=True, text=True)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(tmp_path / "venv"), where.stdout
    version = subprocess.run([str(python.parent / "fdl"), "--version"], env=fresh_env(),
                             capture_output=True, text=True)
    assert version.returncode == 0 and "0." in version.stdout, version.stdout + version.stderr

    proc = subprocess.run([make, "test", f"PYTHON={python}"], cwd=project, env=fresh_env(),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 passed" in proc.stdout


def docker_context(project: Path) -> set[str]:
    """The files `docker build .` sends: every file not matched by .dockerignore (its patterns
    here are names and folders, matched against each path and the folders above it)."""
    patterns = [line.strip().rstrip("/") for line in
                (project / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    context = set()
    for path in project.rglob("*"):
        relative = path.relative_to(project)
        prefixes = ["/".join(relative.parts[:n]) for n in range(1, len(relative.parts) + 1)]
        if path.is_file() and not any(fnmatch.fnmatch(prefix, pattern)
                                      for prefix in prefixes for pattern in patterns):
            context.add(relative.as_posix())
    return context


def test_the_docker_context_holds_what_the_dockerfile_copies_and_installs(tmp_path):
    project = init_project(tmp_path)
    context = docker_context(project)
    wheels = [path for path in context if path.startswith("wheels/")]
    assert len(wheels) == 1 and wheels[0].endswith("-py3-none-any.whl")
    lines = (project / "Dockerfile").read_text().splitlines()
    copies = [line.split()[1:] for line in lines if line.startswith("COPY ")]
    assert copies == [[wheels[0], wheels[0]], [".", "."]]
    assert f'RUN python3 -m pip install "./{wheels[0]}[torch]"' in lines
    assert {"train.py", "pyproject.toml", "README.md", "tests/test_train.py"} <= context
    assert not any(path.startswith(("runs/", ".venv/")) for path in context)
    assert zipfile.is_zipfile(project / wheels[0])
