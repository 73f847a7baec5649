"""``fdl compare``: a user's own training script once per policy and seed, each a real ``fdl run``
in its own run directory under one compare directory, then the runs side by side.

    fdl compare train.py --epochs 3 --seeds 3 --simulate-slowdown 1,2.5

A **cell** is one policy with one seed: ``fdl run [options] --policy P --seed S --run-dir
OUT/<P>-seed<S> SCRIPT -- ARGS``, where the options are the fdl run options given to fdl compare,
the same for every cell, and the seeds are BASE, BASE+1, ... (BASE: ``--seed``, else the seed fdl
run resolves from ``FDL_SEED``, fdl.toml or its default). Cells run in the user's working
directory with the user's environment, exactly as that ``fdl run`` typed there would: fdl.toml
and ``FDL_*`` apply, the flags win. :func:`plan_compare` makes the cells (pure);
:func:`prepare_compare` checks each with fdl run's own planner, so a bad option is a usage error
before anything starts, and records what each run's config.json must hold.

Resuming: ``OUT/plan.json`` names the compare (the script and its SHA-256, its arguments, fdl
run's options).
Running it again with the same ``--out`` skips every finished cell — its run directory holds a
summary.json and metrics.jsonl that fdl can read and a config.json matching the cell's plan
(:mod:`fdl.compare.results`) — and reruns the others from scratch (more seeds or another
policy add cells). A directory holding another compare's plan, or anything but a compare, is
refused. Each cell's output goes to ``OUT/<P>-seed<S>.log`` as well as to the caller.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from fdl.errors import UsageError, os_failure
from fdl.launch.request import flags_argv
from fdl.ranges import NUM_SEEDS, SEEDS, shortened
from fdl.rundir.config import launch_identity
from fdl.settings import BY_NAME, OPTIONS_BY_NAME, POLICIES, parse_from

# fdl run options that fdl compare sets per cell itself, or that have no meaning per cell.
_OWNED = {"policy": "--policies", "run_dir": "--out DIR", "resume": "the same --out (fdl "
          "compare resumes by itself)", "overwrite_run_dir": "a new --out",
          "dry_run": "fdl compare --dry-run", "json": "fdl compare --json",
          "module": "a script file"}


@dataclass(frozen=True)
class CompareRequest:
    """fdl compare's command line: ``flags`` are fdl run options by contract name
    (:data:`fdl.settings.RUN_FLAGS`), as given."""

    script: str
    script_args: tuple[str, ...] = ()
    flags: Mapping[str, Any] = field(default_factory=dict)
    policies: tuple[str, ...] = POLICIES
    num_seeds: int = 1
    out: Path | None = None


@dataclass(frozen=True)
class CompareCell:
    policy: str
    seed: int
    run_dir: Path
    argv: tuple[str, ...]
    flags: Mapping[str, Any]  # the fdl run flags of argv, by contract name
    expected: Mapping[str, Any] = field(default_factory=dict)  # what its config.json must hold

    @property
    def name(self) -> str:
        return self.run_dir.name

    @property
    def log(self) -> Path:
        return self.run_dir.with_name(f"{self.name}.log")


@dataclass(frozen=True)
class ComparePlan:
    out: Path
    cwd: Path
    identity: Mapping[str, Any]  # what makes a compare the same one: script, args, options
    cells: tuple[CompareCell, ...]

    def to_dict(self) -> dict[str, Any]:
        """plan.json, and the plan part of compare.json and of ``--dry-run --json``."""
        return {"out": str(self.out), **self.identity,
                "cells_planned": [{"name": c.name, "policy": c.policy, "seed": c.seed,
                                   "run_dir": str(c.run_dir), "argv": list(c.argv)}
                                  for c in self.cells]}


def parse_policies(text: str) -> tuple[str, ...]:
    """``"sync,async"`` -> ``("sync", "async")``: known policies, each once, in order."""
    names = [part for part in text.split(",") if part.strip()]
    if not names:
        raise UsageError(f"--policies {text!r} names no policy",
                         hint=f"e.g. --policies {','.join(POLICIES)}")
    spec = BY_NAME["policy"]
    return tuple(dict.fromkeys(parse_from(spec, name, origin="--policies") for name in names))


def canonical_flags(flags: Mapping[str, Any]) -> dict[str, Any]:
    """fdl run's options for every cell, checked and in a canonical form (a setting's value as
    its parser reads it back, so ``1, 2.5`` and ``1,2.5`` are the same compare); options fdl
    compare sets itself are usage errors naming what to use instead."""
    canonical: dict[str, Any] = {}
    for name, value in flags.items():
        if value is None or value is False:
            continue
        spec = BY_NAME.get(name)
        flag = spec.flag_name if spec else OPTIONS_BY_NAME[name].flag_name
        if name in _OWNED:
            raise UsageError(f"{flag} is fdl compare's to set", hint=f"use {_OWNED[name]}")
        canonical[name] = spec.encode(parse_from(spec, value, origin=flag)) if spec else value
    return dict(sorted(canonical.items()))


def default_out(script: Path, *, now: datetime) -> Path:
    return Path("runs") / f"compare-{now.strftime('%Y%m%dT%H%M%SZ')}-{script.stem}"


def check_seeds(num_seeds: int, base_seed: int) -> None:
    """``--seeds`` in :data:`~fdl.ranges.NUM_SEEDS`, and the last cell's seed (``base_seed +
    num_seeds - 1``) one that fdl run takes (:data:`~fdl.ranges.SEEDS`): refused before any
    cell is planned."""
    if isinstance(num_seeds, bool) or not isinstance(num_seeds, int) or \
            num_seeds not in NUM_SEEDS:
        raise UsageError(f"--seeds must be a whole number in {NUM_SEEDS}, got {shortened(num_seeds)}",
                         hint="e.g. --seeds 3 (each policy trained with 3 seeds)")
    last = base_seed + num_seeds - 1
    if last not in SEEDS:
        raise UsageError(f"--seeds {num_seeds} from seed {base_seed} reaches seed {last}, past "
                         f"the seeds fdl run takes ({SEEDS})",
                         hint="a smaller --seed or fewer --seeds")


def plan_compare(request: CompareRequest, *, cwd: Path, now: datetime, base_seed: int,
                 script_sha256: str | None = None) -> ComparePlan:
    """The cells, seed by seed and within a seed policy by policy (an interrupted compare has
    every policy of its first seeds). Pure: ``base_seed`` and the script's digest (part of the
    compare's identity: an edited script is another compare) come from the caller."""
    check_seeds(request.num_seeds, base_seed)
    options = canonical_flags(request.flags)
    script = (cwd / request.script).resolve()
    out = (cwd / (request.out or default_out(script, now=now))).resolve()
    shared = {name: value for name, value in options.items() if name != "seed"}
    cells = []
    for seed in range(base_seed, base_seed + request.num_seeds):
        for policy in request.policies:
            run_dir = out / f"{policy}-seed{seed}"
            flags = {**shared, "policy": policy, "seed": str(seed), "run_dir": str(run_dir)}
            tail = ("--", *request.script_args) if request.script_args else ()
            argv = (sys.executable, "-m", "fdl", "run", *flags_argv(flags), str(script), *tail)
            cells.append(CompareCell(policy, seed, run_dir, argv, flags))
    identity = {"script": str(script), "script_sha256": script_sha256,
                "args": list(request.script_args), "options": options}
    return ComparePlan(out, cwd, json.loads(json.dumps(identity)), tuple(cells))


def prepare_compare(request: CompareRequest, *, cwd: Path | None = None,
                    env: Mapping[str, str] | None = None) -> ComparePlan:
    """:func:`plan_compare` with the base seed resolved, every cell checked by fdl run's planner
    (usage errors before anything starts) and what its config.json must hold."""
    from datetime import timezone

    from fdl.files import sha256_file
    from fdl.launch import plan_run
    from fdl.launch.request import RunRequest

    cwd = Path.cwd() if cwd is None else cwd
    env = os.environ if env is None else env
    options = canonical_flags(request.flags)
    shared = {name: value for name, value in options.items() if name != "seed"}
    first = plan_run(RunRequest(request.script, request.script_args, shared), env=env, cwd=cwd)
    base_seed = int(options.get("seed", first.settings["seed"].value))
    try:  # the first read of the script: one that cannot be read is refused before any cell
        digest = sha256_file(first.script)
    except OSError as exc:
        raise os_failure(exc, doing="fdl compare cannot read the script", exit_code=2) from exc
    plan = plan_compare(request, cwd=cwd, now=datetime.now(timezone.utc), base_seed=base_seed,
                        script_sha256=digest)
    cells = tuple(replace(cell, expected=launch_identity(plan_run(
        RunRequest(request.script, request.script_args, cell.flags), env=env, cwd=cwd).to_dict()))
        for cell in plan.cells)
    return replace(plan, cells=cells)
