"""``fdl init``: a training project a person can read top to bottom and run at once.

    fdl init demo                      # mlp template, with a Dockerfile
    fdl init demo --template gpt       # a character-level GPT on a short built-in text
    fdl init demo --template loop      # the same GPT, trained by its own loop (nanoGPT's shape)
    cd demo && fdl run train.py --policy async

A project holds ``train.py`` (model, optimizer, data and ``fdl.Trainer(...).fit()``, or with
``loop`` its own training loop on ``fdl.init()``; runs solo with ``python train.py``),
``fdl.toml`` (the run defaults), ``pyproject.toml``, ``README.md``, ``Makefile`` (install,
train, compare — ``fdl compare`` — test, docker-build), ``tests/test_train.py`` (a smoke test
of the training loop), ``.gitignore``,
``wheels/fdl-<version>-py3-none-any.whl`` (the running fdl, which the project installs: no
index has fdl; see :mod:`fdl.scaffold.fdl_wheel`) and, unless ``docker=False``, a
``Dockerfile`` whose torch wheel is the one ``fdl setup`` would pick for this host's GPUs (see
:mod:`fdl.scaffold.docker`).

:func:`create_project` validates the name, checks the target, packs the fdl wheel, renders every
file (:mod:`fdl.scaffold.render`) and writes them all or none (:mod:`fdl.scaffold.write`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from fdl.scaffold.docker import TorchImage, probe_torch_image
from fdl.scaffold.fdl_wheel import FdlWheel, build_fdl_wheel
from fdl.scaffold.render import TEMPLATES, parse_template, render_project, validate_name
from fdl.scaffold.write import WriteResult, check_target, write_project

__all__ = ["TEMPLATES", "Project", "create_project"]


@dataclass(frozen=True)
class Project:
    name: str
    template: str
    written: WriteResult
    image: TorchImage | None  # what the Dockerfile installs; None without one
    fdl: FdlWheel  # the fdl the project installs, written at fdl.path


def create_project(path: str | os.PathLike[str], *, template: str = "mlp", docker: bool = True,
                   force: bool = False, env: Mapping[str, str] | None = None) -> Project:
    """Create the project at ``path``; its last component is the project's name.

    UsageError (exit 2) for a bad name or template, a non-empty target without ``force``, or a
    path under a file; FdlError (exit 1) when fdl cannot be packed or writing fails, in which
    case nothing is left.
    ``env`` is the environment the GPU survey reads (``os.environ`` by default).
    """
    raw = os.fspath(path)
    target = Path(os.path.abspath(raw))
    name = validate_name(target.name if raw.strip() else raw)
    template = parse_template(template)
    check_target(target, force=force)  # before the GPU survey: fail fast on a taken folder
    image = probe_torch_image(env=env) if docker else None
    wheel = build_fdl_wheel()
    files: dict[str, str | bytes] = {
        **render_project(name=name, template=template, image=image,
                         fdl_version=wheel.version, fdl_wheel=wheel.path),
        wheel.path: wheel.data}
    return Project(name, template, write_project(target, files, force=force), image, wheel)
