"""What a benchmark figure depends on, for the records of ``fdl bench`` (``sweep.json``) and
``fdl compare`` (``compare.json``): the host (:func:`machine_facts`), the installed torch's
version and CUDA version (:func:`torch_build`), and how many CUDA devices workers will see
(:func:`count_gpus`).

``machine_facts`` and ``torch_build`` read torch's version from the wheel's ``torch/version.py``
without importing torch (a slow import, timed in docs/run.md "Launch latency", and ``fdl
compare`` runs its cells and writes its report without it); only ``count_gpus`` imports torch,
because what counts is what a worker's torch sees (none with a CPU-only build, whatever the
host has).

Example::

    >>> machine_facts()["torch"], torch_build()
    ('2.13.0+cu128', {'torch': '2.13.0+cu128', 'cuda': '12.8'})
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from typing import Any


def machine_facts() -> dict[str, Any]:
    """What the numbers depend on: CPU, cores, RAM, GPUs, torch, OS, Python."""
    from fdl.system.gpus import probe_gpus
    from fdl.system.host import probe_host

    host = probe_host(tool_timeout_s=2.0)
    gpus = probe_gpus()
    return {
        "cpu_model": host.cpu_model, "physical_cores": host.physical_cores,
        "logical_cores": host.logical_cores, "ram_gib": round(host.ram_mib / 1024, 1),
        "gpus": [{"index": g.index, "name": g.name, "compute_capability": g.cc,
                  "memory_mib": g.memory_mib} for g in gpus.gpus],
        "gpu_driver": gpus.driver_version, **torch_build(),
        "os": f"{host.os_name} {host.os_release}".strip(),
        "kernel": host.kernel, "python": host.python_version,
    }


def torch_build() -> dict[str, str | None]:
    """``{"torch": version, "cuda": CUDA version or None}`` of the installed torch: from the
    module when it is loaded, else read from the wheel's ``torch/version.py`` without importing
    torch (a slow import: ``fdl compare`` asks for this once its runs are done).
    Values it cannot read are None."""
    loaded = sys.modules.get("torch")
    if loaded is not None:
        return {"torch": str(loaded.__version__), "cuda": loaded.version.cuda}
    facts: dict[str, str | None] = {"torch": None, "cuda": None}
    spec = importlib.util.find_spec("torch")  # finds the package without running it
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    try:
        tree = ast.parse((Path(folders[0]) / "version.py").read_text(encoding="utf-8"))
    except (IndexError, OSError, SyntaxError, ValueError):
        return facts
    keys = {"__version__": "torch", "cuda": "cuda"}
    for node in tree.body:  # __version__ = '2.13.0+cu128'; cuda: Optional[str] = '12.8'
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        elif isinstance(node, ast.AnnAssign):
            target = node.target
        else:
            continue
        value = node.value
        if isinstance(target, ast.Name) and target.id in keys and \
                isinstance(value, ast.Constant) and isinstance(value.value, str | None):
            facts[keys[target.id]] = value.value
    return facts


def count_gpus() -> int:
    """CUDA devices the workers will see (0 with a CPU-only torch, whatever the host has)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
