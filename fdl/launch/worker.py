"""The first thing each ``fdl run`` worker executes: run the user's script as ``python SCRIPT``.

The elastic agent starts ``python -u -m fdl.launch.worker SCRIPT ARGS...`` in every worker with
torchrun's environment. This module merges stderr into stdout (so ``logs/rank<r>.log`` holds
both, in order), then runs SCRIPT as ``__main__`` with ``sys.argv`` and ``sys.path[0]`` exactly
as ``python SCRIPT ARGS`` would set them. Exceptions and exit codes propagate unchanged.
``--module NAME`` runs a module as ``python -m NAME`` would.
"""

from __future__ import annotations

import os
import runpy
import sys


def main(argv: list[str]) -> None:
    os.dup2(sys.stdout.fileno(), sys.stderr.fileno())
    if argv[:1] == ["--module"]:
        sys.argv = argv[1:]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
