"""``fdl setup``: the right libtorch (and torch wheel) for every GPU, in one command.

    fdl setup                 # survey -> plan -> confirm -> install -> summary
    fdl setup --dry-run       # the plan only
    fdl setup --yes           # no question (scripts, CI)
    fdl setup --variant 2.11.0-cu128   # take another catalog variant (e.g. mixed GPUs)
    fdl setup --install-torch # also pip-install the torch wheel that covers every GPU
    fdl setup --download      # download the libtorch archive even when the wheel's would do
    fdl setup --json          # the plan as one JSON document; changes nothing

When the installed torch wheel covers every GPU, setup links the wheel's own libtorch
(``python/torch-<version>``, 0 bytes, as ``fdl libtorch link-python``) instead of downloading
an archive, and says so::

    why       the installed torch 2.13.0+cu128 wheel covers NVIDIA GeForce GTX 1060 (sm_61) and
              NVIDIA GeForce RTX 5060 Ti (sm_120): linking its libtorch (0 bytes) instead of ...

It downloads when asked (``--download``, ``--variant``), when the wheel misses a GPU (named), or
when torch is not installed. ``--python`` names the interpreter whose torch is checked.
CPU-only hosts without a linkable wheel end with the CPU variant active. Mixed GPUs that no
official build covers get the options: the variant covering the most GPUs, or a source build
(`fdl libtorch build`).
``--allow-http`` (or ``FDL_ALLOW_HTTP=1``) allows a plain-http ``FDL_LIBTORCH_MIRROR``; without
it such a plan is refused before anything is written (exit 2).

The plan (``fdl/libtorch/setup_plan.py``) decides everything, including the exact argv that
``--install-torch`` runs (``<python> -m pip install ...``, shown before it runs); this module
probes, asks, and renders.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

if TYPE_CHECKING:
    from fdl.libtorch.install import ArchiveRequest
    from fdl.libtorch.setup_plan import SetupPlan
    from fdl.libtorch.store import Store
    from fdl.system.gpus import GpuSurvey


def setup(
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Print the plan and change nothing.")] = False,
    variant: Annotated[Optional[str], typer.Option(help="Catalog variant, e.g. 2.11.0-cu128.")] = None,  # noqa: UP045
    version: Annotated[Optional[str], typer.Option(help="libtorch version (default: newest).")] = None,  # noqa: UP045
    install_torch: Annotated[bool, typer.Option(
        "--install-torch", help="Also pip-install the fitting torch wheel.")] = False,
    allow_http: Annotated[bool, typer.Option(
        "--allow-http", help="Allow a plain-http FDL_LIBTORCH_MIRROR (one you trust).")] = False,
    download: Annotated[bool, typer.Option(
        "--download", help="Download the libtorch archive even when the torch wheel's "
        "libtorch covers every GPU.")] = False,
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print the plan as JSON and change nothing.")] = False,
    python: Annotated[Optional[str], typer.Option(  # noqa: UP045
        help="The interpreter whose torch wheel is checked (default: this one).")] = None,
) -> None:
    """Install and activate the libtorch that covers every GPU; check the torch wheel."""
    from fdl.download.urls import http_allowed
    from fdl.libtorch.install import check_request
    from fdl.libtorch.store import Store
    from fdl.paths import libtorch_root

    allow_http = http_allowed(flag=allow_http)
    _check_torch_index(allow_http=allow_http)
    store = Store(libtorch_root())
    plan, survey = _plan(store, version=version, variant=variant, download=download,
                         python=python)
    request = plan.download_request
    if request is not None:  # a bad URL or extraction limit: exit 2 before anything is written
        check_request(request, allow_http=allow_http)
    if json_out:
        from fdl import console

        console.print_json(_plan_doc(plan, survey_line=_survey_line(survey)))
        return
    _render_plan(plan, survey_line=_survey_line(survey))
    if plan.environments is not None and not dry_run:
        if not yes and not _confirm():
            raise typer.Exit(1)
        from fdl import console
        from fdl.libtorch.make_env import make_environments
        from fdl.scaffold.fdl_wheel import build_fdl_wheel

        path = make_environments(plan.environments, wheel=_fdl_wheel_path(),
                                 wheel_data=build_fdl_wheel().data, say=console.info)
        console.info(f"fdl setup: device map {path}: fdl run starts each GPU's worker under "
                     "its environment")
        return
    if dry_run or (plan.action in ("present", "none")
                   and not (install_torch and plan.torch_install)):
        return
    if not yes and not _confirm():
        raise typer.Exit(1)
    _execute(plan, store, request, install_torch=install_torch, allow_http=allow_http)


def _check_torch_index(*, allow_http: bool) -> None:
    """``FDL_TORCH_INDEX`` (a mirror of PyTorch's wheel index for the per-card environments),
    when set, is a URL pip may use: https or file, plain http only with the opt-in, as every
    other URL fdl fetches from. A bad one failed in pip, after a venv was made."""
    from fdl.download.urls import check_url
    from fdl.errors import UsageError
    from fdl.libtorch.environments import TORCH_INDEX_ENV

    index = os.environ.get(TORCH_INDEX_ENV, "").strip()
    if not index:
        return
    try:
        check_url(index, allow_http=allow_http)
    except UsageError as exc:
        raise UsageError(f"{TORCH_INDEX_ENV}: {exc.message}", hint=exc.hint) from None


def _plan(store: Store, *, version: str | None, variant: str | None, download: bool,
          python: str | None) -> tuple[SetupPlan, GpuSurvey]:
    """Survey GPUs and the torch wheel (concurrently) and plan from them and the store."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    from fdl.libtorch.catalog import MIRROR_ENV
    from fdl.libtorch.environments import TORCH_INDEX_ENV
    from fdl.libtorch.setup_plan import plan_setup
    from fdl.paths import flodl_home
    from fdl.system.gpus import probe_gpus
    from fdl.system.torchenv import probe_torch

    with ThreadPoolExecutor(max_workers=2) as pool:
        survey, torch = pool.submit(probe_gpus), pool.submit(probe_torch, python=python)
        survey, torch = survey.result(), torch.result()
    active = store.active()
    plan = plan_setup(survey=survey, torch=torch, installed=[v.id for v in store.variants()],
                      active=active.id if active else None, version=version, variant=variant,
                      download=download, base=os.environ.get(MIRROR_ENV),
                      envs_home=flodl_home(), fdl_requirement=str(_fdl_wheel_path()),
                      env_python=sys.executable, torch_index=os.environ.get(TORCH_INDEX_ENV))
    return plan, survey


def _fdl_wheel_path() -> Path:
    """Where the environments' fdl comes from: the running fdl packed as a wheel
    (fdl.scaffold.fdl_wheel: no index has fdl), written there when they are made."""
    from fdl import version
    from fdl.paths import flodl_home

    return flodl_home() / "envs" / "wheels" / \
        f"fdl-{version.__version__.replace('-', '_')}-py3-none-any.whl"


def _survey_line(survey: GpuSurvey) -> str:
    if not survey.gpus:
        return "no NVIDIA GPU"
    return ", ".join(f"{g.name} ({g.arch})" for g in survey.gpus) + \
        f"; driver {survey.driver_version or 'none'}"


def _render_plan(plan: SetupPlan, *, survey_line: str) -> None:
    import shlex

    from fdl import console

    console.rule("fdl setup")
    what = {"download": "download and activate", "activate": "activate (already installed)",
            "present": "already active", "none": "nothing to install",
            "link": "link the torch wheel's libtorch (0 bytes) and activate"}[plan.action]
    name = plan.variant_id
    console.print_pairs([
        ("GPUs", survey_line),
        ("libtorch", f"{name}: {what}" if name else what),
        ("why", plan.why),
        ("url", plan.archive.url if plan.action == "download" and plan.archive else None),
        ("torch wheel", {True: "covers every GPU", False: "does NOT cover every GPU",
                         None: "not installed"}[plan.torch_covers]),
        ("pip", str(plan.torch_install) if plan.torch_install else None),
    ])
    for note in plan.notes:
        console.out(f"  - {note}")
    if plan.environments is not None:
        for env in plan.environments.environments:
            gpus = ", ".join(f"GPU {g.index} {g.name} ({g.arch})" for g in env.gpus)
            console.out(f"  environment {env.name}: torch {env.build.version}+"
                        f"{env.build.variant} for {gpus}")
            for argv in env.commands:
                console.out(f"    {shlex.join(argv)}")
        console.out("  fdl setup --yes makes them (it writes the fdl wheel the last command of "
                    "each installs, then checks each environment's torch against its GPUs)")


def _plan_doc(plan: SetupPlan, *, survey_line: str) -> dict:
    request = plan.download_request
    return {"gpus": survey_line, "action": plan.action, "source": plan.source,
            "variant": plan.variant_id, "why": plan.why,
            "url": request.url if request else None, "torch_covers": plan.torch_covers,
            "pip": str(plan.torch_install) if plan.torch_install else None,
            "notes": list(plan.notes),
            "environments": plan.environments.to_dict() if plan.environments else None}


def _confirm() -> bool:
    if not sys.stdin.isatty():
        from fdl.errors import UsageError

        raise UsageError("fdl setup needs confirmation and stdin is not a terminal",
                         hint="pass --yes, or --dry-run to see the plan")
    return typer.confirm("Proceed?", default=True)


def _execute(plan: SetupPlan, store: Store, request: ArchiveRequest | None, *,
             install_torch: bool, allow_http: bool) -> None:
    if request is not None:
        from fdl.cli.libtorch.download import install_request_with_progress

        install_request_with_progress(store, request, activate=True, allow_http=allow_http)
    elif plan.action == "link":
        from fdl.libtorch.link import link_python

        store.activate(link_python(store, python=plan.link_python).id)
    elif plan.action == "activate" and plan.variant_id:
        store.activate(plan.variant_id)
    if install_torch and plan.torch_install:
        install_torch_wheel(plan)
    _summary(store)


def install_torch_wheel(plan: SetupPlan) -> None:
    """Run the plan's ``pip_argv``, exactly, after saying so; a source build is refused with
    its instructions as the hint."""
    import shlex
    import subprocess

    from fdl import console
    from fdl.errors import FdlError

    if plan.pip_argv is None:
        raise FdlError("no official torch wheel covers every GPU; torch must be built from "
                       "source", hint=str(plan.torch_install))
    console.info(f"running: {shlex.join(plan.pip_argv)}")
    if subprocess.run(plan.pip_argv, check=False).returncode != 0:
        raise FdlError("pip failed to install the torch wheel", hint=str(plan.torch_install))


def _summary(store: Store) -> None:
    from fdl import console

    active = store.active()
    if active is None:
        return
    console.rule("active libtorch")
    console.out(f"  {active.id} at {active.path}")
    console.out("  to use it in this shell:  eval \"$(fdl libtorch env)\"")
    console.out(store.env(active, shell="bash"))
