"""``fdl init NAME``: write a training project you can read top to bottom and run at once.

    fdl init demo                        # the mlp template, with a Dockerfile
    fdl init demo --template gpt         # mlp | cnn | gpt | loop
    fdl init demo --no-docker            # no Dockerfile, .dockerignore or docker-build target
    fdl init demo --force                # write into a non-empty folder (replaces fdl's files)
    cd demo && fdl run train.py --policy async

NAME is a folder to create (a path works: its last part is the project's name: letters,
digits, '-' and '_', starting with a letter). Nothing is written unless every file is.
The project installs the fdl that wrote it, packed into wheels/fdl-<version>-py3-none-any.whl.
"""

from __future__ import annotations

import shlex
from typing import Annotated

import typer


def init(
    name: Annotated[str, typer.Argument(
        metavar="NAME", help="Project folder to create; its last part is the project name.")],
    template: Annotated[str, typer.Option(
        "--template", "-t", help="mlp (synthetic clusters) | cnn (synthetic images) | "
                                 "gpt (character-level transformer) | loop (the same "
                                 "transformer, trained by its own loop).")] = "mlp",
    docker: Annotated[bool, typer.Option(
        "--docker/--no-docker", help="Write a Dockerfile with the torch wheel for this "
                                     "host's GPUs.")] = True,
    force: Annotated[bool, typer.Option(
        "--force", help="Write into a non-empty folder, replacing the files fdl init "
                        "writes.")] = False,
) -> None:
    """Create a training project: train.py, fdl.toml, tests, Makefile, Dockerfile."""
    from fdl import console
    from fdl.scaffold import create_project

    with console.status("writing the project..."):
        project = create_project(name, template=template, docker=docker, force=force)
    written = project.written
    console.out(f"created {project.name} ({project.template} template) in {written.target}")
    console.out(f"  files: {', '.join(written.files)}")
    if written.replaced:
        console.out(f"  replaced: {', '.join(written.replaced)}")
    console.out(f"  fdl: {project.fdl.path}, this fdl {project.fdl.version} packed from "
                f"{project.fdl.source} (`make install` installs it)")
    if project.image is not None:
        image = project.image
        console.out(f"  Dockerfile: torch {image.torch_version}+{image.variant} on "
                    f"{image.base_image} ({image.reason})")
    console.out("next:")
    console.out(f"  cd {shlex.quote(name)}")
    console.out("  fdl run train.py --policy async   # or: python train.py (solo)")
