"""The body of scripts/bench-lan (see that file for what it measures)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "mlp_synthetic.py"
PORT = 29400
DEADLINE_S = 900  # a guard against a cell that hangs: never a measurement
sys.path[:0] = [str(ROOT / "tests" / "nodes"), str(ROOT / "tests")]  # the tests' namespace nodes

from helpers import wait_all  # noqa: E402
from netns import namespaces_unavailable, two_nodes  # noqa: E402

from fdl.engine.simulator import (  # noqa: E402
    BENCH_MLP_PARAMS,
    GIGABIT_GBS,
    profiles,
    simulate,
)
from fdl.engine.wire import value_bytes  # noqa: E402
from fdl.settings import AVERAGE_DTYPES  # noqa: E402

POLICIES = ("sync", "cadence", "async")
RATE_GBS = {"gbit": 1e9 / 8 / 1e9, "mbit": 1e6 / 8 / 1e9}  # GB/s per unit of a tc rate


def main() -> None:
    parser = argparse.ArgumentParser(prog="scripts/bench-lan")
    parser.add_argument("--rates", default="1gbit,100mbit",
                        help="link caps, comma-separated (tc units: gbit, mbit)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train-samples", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--slow", type=float, default=2.5)
    parser.add_argument("--repeat", type=int, default=3,
                        help="seeds per cell (1..N), interleaved; the table shows medians")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="the policies run on two nodes, comma-separated")
    parser.add_argument("--average-dtype", default="fp32", choices=AVERAGE_DTYPES,
                        help="what an average sends on two nodes (fdl run --average-dtype)")
    parser.add_argument("--outer-optimizer", default="none", choices=("none", "nesterov"),
                        help="the outer optimizer on two nodes (fdl run --outer-optimizer, "
                             "its default lr and momentum)")
    parser.add_argument("--sync-time", default="40s",
                        help="sync's cells behind a cap stop after this much training (their "
                             "samples/s is what counts; a full run at 100 Mbit/s takes "
                             "many minutes)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / time.strftime(
        "bench-lan-%Y%m%dT%H%M%SZ", time.gmtime()))
    args = parser.parse_args()
    rates = [rate.strip() for rate in args.rates.split(",") if rate.strip()]
    bad = [rate for rate in rates if not any(rate.endswith(u) for u in RATE_GBS)]
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if bad or not args.slow > 1 or args.repeat < 1 or not set(args.policies) <= set(POLICIES):
        parser.error(f"--rates takes gbit/mbit caps (got {bad}), --policies some of "
                     f"{','.join(POLICIES)}, --slow > 1, --repeat >= 1")
    why = namespaces_unavailable()
    if why is not None:
        raise SystemExit(f"bench-lan: {why} (two network namespaces stand for two machines)")
    args.out.mkdir(parents=True, exist_ok=True)
    model = ["--hidden", str(args.hidden), "--train-samples", str(args.train_samples),
             "--epochs", str(args.epochs), "--batch-size", str(args.batch_size)]
    pair = f"1,{args.slow:g}"
    cells = [("solo fast", None, "cadence"), ("solo slow", None, "cadence"),
             ("sync, one node (accuracy)", None, "sync")]
    cells += [(policy, rate, policy) for rate in rates for policy in args.policies]
    runs: dict[tuple[str, str | None], list[dict]] = {(n, r): [] for n, r, _ in cells}
    for seed in range(1, args.repeat + 1):  # round-robin: a slow spell hits every cell
        for name, rate, policy in cells:
            out = args.out / f"{name.split(',')[0].replace(' ', '-')}-{rate or 'host'}-s{seed}"
            if rate is None:
                slowdown = f"{args.slow:g}" if name == "solo slow" else None
                result = one_node(out, policy, seed, model, nproc=1 if "solo" in name else 2,
                                  slowdown=slowdown if "solo" in name else pair)
            else:
                budget = ["--max-time", args.sync_time] if policy == "sync" else []
                result = two_node_run(out, rate, policy, seed, [*model, *budget], pair,
                                      average_dtype=args.average_dtype,
                                      outer_optimizer=args.outer_optimizer)
            runs[(name, rate)].append(result)
            print(f"  seed {seed} {name:<26} {rate or 'no network':<10} "
                  f"{result['samples_per_s']:8.0f} samples/s", file=sys.stderr, flush=True)
    # measured here, after the runs (it would slow a run beside it), for the simulator's rows
    args.outer_ms = outer_step_ms(BENCH_MLP_PARAMS) if args.outer_optimizer != "none" else 0.0
    report = render(runs, rates, args)
    print(report)
    (args.out / "bench-lan.md").write_text(report + "\n")
    (args.out / "bench-lan.json").write_text(json.dumps(
        {f"{name} @ {rate or 'host'}": rows for (name, rate), rows in runs.items()}, indent=2)
        + "\n")


def one_node(out: Path, policy: str, seed: int, model: list[str], *, nproc: int,
             slowdown: str | None) -> dict:
    """A run on this host alone (no link): the solos of the ideal, sync's reference accuracy
    (sync's maths does not depend on the link, only its time does)."""
    argv = [sys.executable, "-m", "fdl", "run", "--quiet", "--nproc-per-node", str(nproc),
            "--policy", policy, "--seed", str(seed), "--run-dir", str(out),
            *(["--simulate-slowdown", slowdown] if slowdown else []), str(EXAMPLE), *model]
    proc = subprocess.run(argv, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=DEADLINE_S)
    _check(proc.returncode, proc.stdout, argv)
    return _summary(out)


def two_node_run(out: Path, rate: str, policy: str, seed: int, model: list[str],
                 pair: str, *, average_dtype: str, outer_optimizer: str = "none") -> dict:
    """docs/run.md's two-node command on two namespace nodes whose link is capped at
    ``rate``; node 0 trains at full speed, node 1 emulated ``pair``'s slower."""
    with two_nodes(rate=rate) as nodes:
        endpoint = f"{nodes[0].address}:{PORT}"
        procs = []
        for n, node in enumerate(nodes):
            argv = node.command([sys.executable, "-m", "fdl", "run", "--nnodes", "2",
                                 "--nproc-per-node", "1", "--rdzv-endpoint", endpoint,
                                 "--quiet", "--policy", policy, "--seed", str(seed),
                                 "--average-dtype", average_dtype,
                                 "--outer-optimizer", outer_optimizer,
                                 "--simulate-slowdown", pair, "--run-dir", str(out / f"node{n}"),
                                 str(EXAMPLE), *model])
            procs.append(subprocess.Popen(argv, env=_env(), stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        outputs = wait_all(procs, deadline=time.monotonic() + DEADLINE_S)  # a hang: stopped
        for proc, text in zip(procs, outputs, strict=True):
            _check(proc.returncode, text, proc.args)
    return _summary(out / "node0")


def _summary(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"samples_per_s": summary["throughput"]["samples_per_s"],
            "accuracy": summary["eval"].get("accuracy"),
            "averages": summary["sync"]["rounds"], "sync_overhead": summary["sync"]["overhead"],
            "wall_s": summary["wall_s"]}


def _check(code: int, output: str, argv: list[str]) -> None:
    if code != 0:
        sys.stderr.write(output[-4000:])
        raise SystemExit(f"bench-lan: {' '.join(map(str, argv[:12]))} ... exited {code}")


def _env() -> dict[str, str]:
    """One thread per worker; fdl and the example importable from this checkout."""
    path = [str(ROOT), str(EXAMPLE.parent), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(path)}


def _rate_gbs(rate: str) -> float:
    unit = next(u for u in RATE_GBS if rate.endswith(u))
    return float(rate[:-len(unit)]) * RATE_GBS[unit]


def outer_step_ms(numel: int, *, repeat: int = 5) -> float:
    """The outer optimizer's step on ``numel`` float32 parameters in host memory (the cpu
    backend's buffer), one thread as the workers have: median of ``repeat``, in ms."""
    import torch

    from fdl.engine.outer import OuterOptimizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        outer = OuterOptimizer(numel, lr=0.7, momentum=0.9, device=torch.device("cpu"),
                               dtype=torch.float32)
        times = []
        for _ in range(repeat):
            average = outer.consensus + 1e-3
            start = time.perf_counter()
            outer.step(average)
            times.append((time.perf_counter() - start) * 1000)
        return statistics.median(times)
    finally:
        torch.set_num_threads(threads)


def simulated(rate: str, policy: str, args: argparse.Namespace) -> float:
    """The simulator's efficiency for this bench's MLP at ``rate`` (its bench profile, the
    link's bandwidth), median of the bench's seeds."""
    bench = next(p for p in profiles() if p.name.startswith("this machine's bench"))
    solo_ms = bench.batch_ms[0]
    profile = replace(bench, name=f"bench MLP at {rate}", batch_ms=(solo_ms, solo_ms * args.slow),
                      bandwidth_gbs=_rate_gbs(rate), latency_ms=0.3 if _rate_gbs(rate) >=
                      GIGABIT_GBS else 3.0, overlap="thread", contention=0.1,
                      dataset_size=args.train_samples, epochs=args.epochs,
                      batch_size=args.batch_size,
                      value_bytes=value_bytes(args.average_dtype),
                      outer_ms=args.outer_ms)
    return statistics.median(simulate(profile, policy, seed=seed).efficiency
                             for seed in range(args.repeat))


def render(runs: dict[tuple[str, str | None], list[dict]], rates: list[str],
           args: argparse.Namespace) -> str:
    def median(name: str, rate: str | None) -> float:
        return statistics.median(r["samples_per_s"] for r in runs[(name, rate)])

    ideal = median("solo fast", None) + median("solo slow", None)
    reference = [r["accuracy"] for r in runs[("sync, one node (accuracy)", None)]]
    lines = [
        f"El Che across two machines (two network namespaces of this host, one CPU worker "
        f"each, one thread), {time.strftime('%Y-%m-%d')}; node 1 emulated {args.slow:g}x "
        f"slower; MLP hidden {args.hidden}, batch {args.batch_size}, {args.epochs} epochs x "
        f"{args.train_samples} samples; medians of {args.repeat} seeds (min-max); sync behind "
        f"a cap stops after {args.sync_time} of training; averages sent in "
        f"{args.average_dtype}; outer optimizer {args.outer_optimizer}"
        f"{f' (its step: {args.outer_ms:.1f} ms, measured here)' if args.outer_ms else ''}.",
        "",
        f"ideal = solo fast + solo slow (no network) = {ideal:.0f} samples/s",
        "",
        "| link | policy | samples/s | x ideal | simulator | accuracy - sync's (mean) | "
        "averages |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for rate in rates:
        for policy in args.policies:
            rows = runs[(policy, rate)]
            rates_s = sorted(r["samples_per_s"] for r in rows)
            gaps = [r["accuracy"] - ref for r, ref in zip(rows, reference, strict=True)
                    if r["accuracy"] is not None and ref is not None]
            gap = f"{100 * statistics.mean(gaps):+.2f} pt" if gaps and policy != "sync" else "-"
            lines.append(
                f"| {rate} | {policy} | {median(policy, rate):.0f} [{rates_s[0]:.0f}-"
                f"{rates_s[-1]:.0f}] | {median(policy, rate) / ideal:.3f} | "
                f"{simulated(rate, policy, args):.3f} | {gap} | "
                f"{statistics.median(r['averages'] for r in rows)} |")
    lines += ["", "sync's accuracy (one node, the same maths): "
              + ", ".join(f"{a:.4f}" for a in reference if a is not None)]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
