"""``fdl libtorch``: the libtorch variants in ``$FLODL_HOME/libtorch`` and which one is active.

    fdl libtorch list [--json]          # installed variants; the active one is marked
    fdl libtorch info [NAME] [--json]   # one variant (default: the active one)
    fdl libtorch activate NAME          # NAME is "kind/name", or the bare name when unique
    fdl libtorch remove NAME [--force]  # --force is needed to remove the active one
    fdl libtorch env [--shell fish]     # exports for the active variant:
                                        #   eval "$(fdl libtorch env)"
    fdl libtorch link-python            # use the libtorch inside this environment's torch wheel

The two long commands have modules of their own, registered on :data:`libtorch_app` by
``fdl/cli/main.py``: ``fdl libtorch download`` (:mod:`fdl.cli.libtorch.download`) and ``fdl
libtorch build`` (:mod:`fdl.cli.libtorch.build`).

``--json`` prints one document. ``list``::

    {"schema": 1, "active": "precompiled/2.13.0-cu130" | null,
     "variants": [{"id": "precompiled/2.13.0-cu130", "kind": "precompiled",
                   "name": "2.13.0-cu130", "path": "...", "active": true,
                   ...every key of the variant's variant.json: "version", "cuda", "archs",
                   "source", "url", "sha256", "size", "installed_at", ...}]}

``info`` prints ``{"schema": 1, ...}`` with the keys of one entry of ``variants``. The keys
``id``, ``kind``, ``name``, ``path`` and ``active`` always come from the store, never from
variant.json. A broken entry (a ``variant.json`` or ``.active`` that cannot be read or is not what
fdl writes) is skipped with one ``warning:`` line on stderr; ``list`` also names each partial
download kept in ``.staging`` to be resumed. Exit codes: 0 ok, 1 failure (no active variant,
store locked, disk full), 2 usage (unknown name, unknown shell, refusing to remove the active
variant without ``--force``, a ``FLODL_HOME`` that is not a directory).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from fdl.errors import FdlError

if TYPE_CHECKING:
    from fdl.libtorch.store import Store, Variant

_NOTHING_ACTIVE_HINT = ("install one with `fdl libtorch download` or `fdl libtorch link-python`, "
                        "then `fdl libtorch activate NAME`")
_STORE_KEYS = ("id", "kind", "name", "path", "active")
_INFO_KEYS = ("version", "cuda", "archs", "source", "url", "sha256", "size", "installed_at")

libtorch_app = typer.Typer(
    help="Manage the libtorch variants in $FLODL_HOME/libtorch.",
    no_args_is_help=True,
    rich_markup_mode=None,  # plain help, as for `fdl` itself: no markdown-it at start-up
    context_settings={"help_option_names": ["-h", "--help"]},
)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON document.")]


def _store(*, warn: bool = True) -> Store:
    """The store; with ``warn``, one warning line on stderr per broken entry it will skip."""
    from fdl import console
    from fdl.libtorch.store import Store
    from fdl.paths import libtorch_root

    store = Store(libtorch_root())
    for problem in store.problems() if warn else ():
        console.warn(f"libtorch store {store.root}: {problem}")
    return store


@libtorch_app.command("list")
def list_variants(json_output: JsonFlag = False) -> None:
    """List the installed variants; the active one is marked with *."""
    from fdl import console

    store = _store()
    variants, active = store.variants(), store.active()
    active_id = active.id if active else None
    for path, size in store.partial_downloads():
        console.info(f"partial download: {path} ({size / 2**20:.1f} MiB); unless it is still "
                     "running, the next `fdl libtorch download` of it resumes it (or delete it)")
    if json_output:
        console.print_json({"schema": 1, "active": active_id,
                            "variants": [_document(v, active_id=active_id) for v in variants]})
        return
    if not variants:
        console.out(f"no libtorch installed in {store.root}; {_NOTHING_ACTIVE_HINT}")
        return
    rows = [["*" if v.id == active_id else "", v.id, v.meta.get("version"), v.meta.get("cuda"),
             _archs(v.meta.get("archs")), v.meta.get("source"), v.meta.get("installed_at")]
            for v in variants]
    console.print_table(["", "id", "version", "cuda", "archs", "source", "installed"], rows,
                        styles=["bold" if row[0] else None for row in rows])


@libtorch_app.command("info")
def info(
    name: Annotated[Optional[str], typer.Argument(  # noqa: UP045 (typer reads the annotation)
        metavar="NAME",
        help="kind/name or a unique name (default: the active variant).")] = None,
    json_output: JsonFlag = False,
) -> None:
    """Show one variant: version, CUDA, archs, where it came from and where it lives."""
    from fdl import console

    store = _store()
    active = store.active()
    variant = store.find(name) if name else _require(active)
    document = _document(variant, active_id=active.id if active else None)
    if json_output:
        console.print_json({"schema": 1, **document})
        return
    extra = [(k, v) for k, v in document.items() if k not in (*_STORE_KEYS, *_INFO_KEYS)]
    console.print_pairs([
        ("id", variant.id), ("kind", variant.kind),
        *[(key, _show(key, document.get(key))) for key in _INFO_KEYS],
        ("path", str(variant.path)), ("active", "yes" if document["active"] else "no"),
        *[(key, _show(key, value)) for key, value in extra],
    ])


@libtorch_app.command("activate")
def activate(name: Annotated[str, typer.Argument(metavar="NAME", help="kind/name or a unique name.")]) -> None:
    """Make NAME the libtorch that `fdl libtorch env` and builds use."""
    from fdl import console

    variant = _store(warn=False).activate(name)
    console.out(f"active libtorch: {variant.id}")
    console.info('set up this shell with: eval "$(fdl libtorch env)"')


@libtorch_app.command("remove")
def remove(
    name: Annotated[str, typer.Argument(metavar="NAME", help="kind/name or a unique name.")],
    force: Annotated[bool, typer.Option("--force", help="Remove it even when active.")] = False,
) -> None:
    """Delete a variant from the store (a linked python variant leaves the wheel alone)."""
    from fdl import console

    variant = _store(warn=False).remove(name, force=force)
    console.out(f"removed {variant.id}")


@libtorch_app.command("env")
def env(
    shell: Annotated[str, typer.Option(help="bash, zsh, fish or powershell.")] = "bash",
) -> None:
    """Print the exports for the active variant: eval "$(fdl libtorch env)"."""
    store = _store()
    text = store.env(_require(store.active()), shell=shell)
    # Written as is: a script for eval must come out byte for byte (rich would swap :emoji:
    # codes in paths).
    sys.stdout.write(text)


@libtorch_app.command("link-python")
def link_python(
    python: Annotated[Optional[str], typer.Option(  # noqa: UP045 (typer reads the annotation)
        help="Interpreter whose torch to use (default: the one running fdl).")] = None,
) -> None:
    """Register the libtorch inside the torch wheel as python/torch-<version> (symlinks)."""
    from fdl import console
    from fdl.libtorch.link import link_python as link

    with console.status("probing the torch wheel..."):
        variant = link(_store(warn=False), python=python)
    console.out(f"linked {variant.id} -> {variant.meta.get('wheel_path')}")
    console.info(f"use it with: fdl libtorch activate {variant.id}")


def _require(active: Variant | None) -> Variant:
    if active is None:
        raise FdlError("no libtorch is active", hint=_NOTHING_ACTIVE_HINT)
    return active


def _document(variant: Variant, *, active_id: str | None) -> dict[str, Any]:
    meta = {k: v for k, v in variant.meta.items() if k not in _STORE_KEYS}
    return {"id": variant.id, "kind": variant.kind, "name": variant.name,
            "path": str(variant.path), "active": variant.id == active_id, **meta}


def _archs(archs: Any) -> str | None:
    if isinstance(archs, (list, tuple)):
        return " ".join(map(str, archs)) or "none"
    return None if archs is None else str(archs)


def _show(key: str, value: Any) -> Any:
    if key == "archs":
        return _archs(value)
    if key == "size" and isinstance(value, int):
        return f"{value / 2**20:.1f} MiB ({value} bytes)"
    return value
