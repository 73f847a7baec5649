"""``fdl libtorch build``: a libtorch built from source for exactly your GPUs' architectures.

    fdl libtorch build                          # the archs of every GPU found (e.g. "6.1;12.0")
    fdl libtorch build --archs "6.1;12.0" --version 2.13.0 --jobs 8
    fdl libtorch build --docker                 # inside a CUDA devel image (empty build context)
    fdl libtorch build --dry-run [--json]       # the plan: steps, argv, env, Dockerfile

The checkout is cached (``<cache>/pytorch-src/v<version>``) so an interrupted build resumes; the
log goes to a file and its tail is shown live; the result is verified, installed as
``builds/<version>-sm61-sm120`` with the real CUDA version and archs, and activated. A real
build takes hours.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer


def build(
    archs: Annotated[Optional[str], typer.Option(help='e.g. "6.1;12.0" (default: every GPU).')] = None,  # noqa: UP045
    version: Annotated[Optional[str], typer.Option(help="PyTorch version (default: newest).")] = None,  # noqa: UP045
    jobs: Annotated[Optional[int], typer.Option(help="Parallel compile jobs (default: cores).")] = None,  # noqa: UP045
    docker: Annotated[bool, typer.Option("--docker/--native", help="Build in Docker or here.")] = False,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Print the plan; build nothing.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="With --dry-run: JSON.")] = False,
    no_activate: Annotated[bool, typer.Option(
        "--no-activate", help="Install without activating.")] = False,
) -> None:
    """Build libtorch from source for the given CUDA architectures."""
    import os

    from fdl import console
    from fdl.errors import UsageError
    from fdl.libtorch.build import plan_build
    from fdl.libtorch.build_runner import run_build
    from fdl.libtorch.catalog import latest_version
    from fdl.libtorch.store import Store
    from fdl.paths import cache_dir, libtorch_root

    if jobs is not None and jobs < 1:
        raise UsageError(f"--jobs must be a whole number >= 1, got {jobs}",
                         hint=f"leave it out to use every core ({os.cpu_count() or 1})")
    if archs is None:
        from fdl.system.gpus import probe_gpus

        survey = probe_gpus()
        if not survey.gpus:
            raise UsageError("no NVIDIA GPU found to build for", hint='pass --archs "8.6;12.0"')
        archs = ";".join(sorted({g.cc for g in survey.gpus}))
    cuda_home = os.environ.get("CUDA_HOME")
    plan = plan_build(version=version or latest_version(), archs=archs.replace(",", ";").split(";"),
                      jobs=(os.cpu_count() or 1) if jobs is None else jobs, mode="docker" if docker else "native",
                      cache_dir=cache_dir(), cuda_home=cuda_home,
                      nvcc=None if docker else _nvcc_version(cuda_home))
    if dry_run:
        _print_plan(plan.to_dict(), as_json=json_output)
        return
    if plan.toolkit_problem:  # hours into the build, after the clone, otherwise
        raise UsageError(plan.toolkit_problem,
                         hint="install a CUDA toolkit in that range and set CUDA_HOME to it, or "
                              "build in a container with --docker")
    store = Store(libtorch_root())
    staging = store.staging() / f"{plan.output_name}.build"
    console.info(f"building libtorch {plan.version} for {plan.torch_cuda_arch_list}; "
                 f"log: {plan.log_path}")
    result = run_build(plan, staging=staging, on_line=_tail)
    variant = store.install(kind="builds", name=plan.output_name, tree=result.tree,
                            meta=result.meta)
    if not no_activate:
        store.activate(variant.id)
    console.info(f"installed {variant.id}" + ("" if no_activate else " and activated it"))


def _nvcc_version(cuda_home: str | None) -> str | None:
    """The version of the nvcc a native build would use: CUDA_HOME's, else PATH's."""
    import os

    from fdl.libtorch.build_runner import probe_nvcc

    return probe_nvcc(cuda_home=cuda_home, env=os.environ)


def _tail(line: str) -> None:
    from fdl import console

    console.info(f"  | {line.rstrip()}")


def _print_plan(document: dict, *, as_json: bool) -> None:
    import shlex

    from fdl import console

    if as_json:
        console.print_json(document)
        return
    console.rule("fdl libtorch build --dry-run")
    console.print_pairs([(k, v) for k, v in document.items()
                         if k not in ("steps", "dockerfile", "toolkit_problem")])
    console.out(f"  toolkit: {document['toolkit_problem'] or 'fits'}"
                if document["mode"] == "native" else "  toolkit: the container's")
    for step in document["steps"]:  # each line pastes into a shell as it is
        env = "".join(f"{k}={shlex.quote(str(v))} " for k, v in step.get("env", {}).items())
        console.out(f"  [{step['name']}] (cd {shlex.quote(step['cwd'])} && "
                    f"{env}{shlex.join(step['argv'])})")
    if document.get("dockerfile"):
        console.out(document["dockerfile"])
