"""The body of scripts/bench-elche (see that file for what it measures)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "mlp_synthetic.py"
PLAIN_DDP = ROOT / "examples" / "ddp_plain.py"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train-samples", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--slow", type=float, default=2.5,
                        help="the slow worker's emulated slowdown factor (> 1)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs per cell, interleaved round-robin; the table shows medians")
    parser.add_argument("--out", type=Path,
                        default=ROOT / "runs" / time.strftime("bench-elche-%Y%m%dT%H%M%SZ",
                                                              time.gmtime()))
    args = parser.parse_args()
    if not args.slow > 1:
        parser.error(f"--slow must be > 1, got {args.slow}")
    slow, pair = f"{args.slow:g}", f"1,{args.slow:g}"
    args.out.mkdir(parents=True, exist_ok=True)
    model_args = ["--hidden", str(args.hidden), "--train-samples", str(args.train_samples),
                  "--epochs", str(args.epochs), "--batch-size", str(args.batch_size)]
    cells = [("solo fast", 1, None, "cadence"), (f"solo slow ({slow}x)", 1, slow, "cadence"),
             ("sync", 2, pair, "sync"), ("cadence", 2, pair, "cadence"),
             ("async", 2, pair, "async"), (f"torch DDP, {pair} slept on compute", 2, pair, None),
             # DDP between fdl's two syncs on equal workers: each is paired with the DDP run
             # beside it (paired_ratios), which a slow spell of the host hits alike
             ("sync, equal workers", 2, None, "sync"),
             ("torch DDP, equal workers", 2, None, None),
             ("loop: sync, equal workers", 2, None, "sync --loop"),
             (f"solo fast + solo slow ({slow}x) at once", 2, slow, "concurrent"),
             ("loop: sync", 2, pair, "sync --loop"), ("loop: cadence", 2, pair, "cadence --loop"),
             ("loop: async", 2, pair, "async --loop"),
             ("auto", 2, pair, "auto"), ("auto, equal workers", 2, None, "auto")]
    runs: dict[str, list[dict]] = {name: [] for name, *_ in cells}
    for repeat in range(args.repeat):  # round-robin: a slow spell of the host hits every cell
        for name, nproc, slowdown, policy in cells:
            slug = f"{name.split(' (')[0].replace(' ', '-').replace(',', '').replace(':', '')}" \
                   f"-{repeat}"
            if policy is None:
                result = plain_ddp(args.out / slug, slowdown, model_args)
            elif policy == "concurrent":
                result = concurrent_solos(args.out / slug, slowdown, args, model_args)
            else:
                result = fdl_run(args.out / slug, nproc, slowdown, policy, model_args)
            runs[name].append(result)
            print(f"  {repeat + 1}/{args.repeat} {name:<26} {result['samples_per_s']:8.0f} "
                  "samples/s", file=sys.stderr)
    rows = {name: median_row(results) for name, results in runs.items()}
    report = render(rows, args, runs)
    print(report)
    (args.out / "bench-elche.md").write_text(report + "\n")
    (args.out / "bench-elche.json").write_text(json.dumps(rows, indent=2) + "\n")


def fdl_run(run_dir: Path, nproc: int, slowdown: str | None, policy: str,
            model_args: list[str]) -> dict:
    """``policy`` may end in `` --loop``: the example's own-loop form (fdl.init)."""
    policy, _, loop = policy.partition(" ")
    argv = [shutil.which("fdl") or "fdl", "run", "--quiet-ranks", "--nproc-per-node", str(nproc),
            "--policy", policy, "--run-dir", str(run_dir)]
    if slowdown:
        argv += ["--simulate-slowdown", slowdown]
    _run([*argv, str(EXAMPLE), *model_args, *([loop] if loop else [])])
    summary = json.loads((run_dir / "summary.json").read_text())
    from fdl.rundir.report import run_report  # the checkout's fdl (PYTHONPATH), as the runs'

    return {"samples_per_s": summary["throughput"]["samples_per_s"],
            "in_run": run_report(run_dir)["efficiency"],
            "per_rank": summary["throughput"]["per_rank_samples_per_s"],
            "accuracy": summary["eval"].get("accuracy"), "wall_s": summary["wall_s"],
            "sync_overhead": summary["sync"]["overhead"], "syncs": summary["sync"]["rounds"],
            "idle": summary["idle_fraction"], "final_anchor": summary.get("final_anchor"),
            "policy": summary.get("policy")}


def concurrent_solos(out: Path, slowdown: str, args: argparse.Namespace,
                     model_args: list[str]) -> dict:
    """Solo fast and solo slow as two independent runs at the same time, the slow one on
    1/slowdown of the samples so that both run about as long: what the two workers deliver
    together on this host when neither waits for the other (two processes on one host share
    its caches and memory bandwidth, which the ideal, made of runs alone, does not)."""
    slow_samples = max(args.batch_size,
                       round(args.train_samples / args.slow / args.batch_size) * args.batch_size)
    slow_args = list(model_args)
    slow_args[slow_args.index("--train-samples") + 1] = str(slow_samples)
    argv = [shutil.which("fdl") or "fdl", "run", "--quiet-ranks", "--nproc-per-node", "1",
            "--policy", "cadence"]
    logs = [out.with_name(out.name + f"-{name}.log") for name in ("fast", "slow")]
    out.parent.mkdir(parents=True, exist_ok=True)
    with logs[0].open("w") as fast_log, logs[1].open("w") as slow_log:
        procs = [subprocess.Popen([*argv, "--run-dir", str(out / "fast"), str(EXAMPLE),
                                   *model_args], env=_env(), stdout=subprocess.DEVNULL,
                                  stderr=fast_log),
                 subprocess.Popen([*argv, "--run-dir", str(out / "slow"), "--simulate-slowdown",
                                   slowdown, str(EXAMPLE), *slow_args], env=_env(),
                                  stdout=subprocess.DEVNULL, stderr=slow_log)]
        codes = [proc.wait() for proc in procs]
    for log, code in zip(logs, codes, strict=True):
        if code != 0:
            sys.stderr.write(log.read_text()[-4000:])
            raise SystemExit(f"bench-elche: the solo runs at once: {log} (exit {code})")
    rates = [json.loads((out / name / "summary.json").read_text())["throughput"]["samples_per_s"]
             for name in ("fast", "slow")]
    return {"samples_per_s": sum(rates), "per_rank": rates, "accuracy": None,
            "sync_overhead": None}


def median_row(results: list[dict]) -> dict:
    """The run with the median throughput (its other figures come with it), plus the spread."""
    ordered = sorted(results, key=lambda row: row["samples_per_s"])
    row = dict(ordered[len(ordered) // 2])
    row["spread"] = [ordered[0]["samples_per_s"], ordered[-1]["samples_per_s"]]
    row["runs"] = [r["samples_per_s"] for r in results]
    return row


def plain_ddp(out: Path, slowdown: str | None, model_args: list[str]) -> dict:
    """torch DDP without fdl (examples/ddp_plain.py); with ``slowdown``, each rank sleeps
    (f - 1) x each step's time less its all-reduce, never the all-reduce."""
    out.mkdir(parents=True, exist_ok=True)
    result = out / "torch-ddp.json"
    torchrun = shutil.which("torchrun") or "torchrun"
    _run([torchrun, "--standalone", "--nproc-per-node", "2", str(PLAIN_DDP), str(result),
          *(["--slowdown", slowdown] if slowdown else []), *model_args])
    return {**json.loads(result.read_text()), "accuracy": None, "sync_overhead": None}


def _run(argv: list[str]) -> None:
    """Run one cell; on failure show the end of what it printed, then stop the benchmark."""
    proc = subprocess.run(argv, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"bench-elche: {' '.join(argv[:8])} ... exited {proc.returncode}")


def _env() -> dict[str, str]:
    """One thread per worker; the examples importable, after whatever PYTHONPATH holds (a
    checkout's own fdl ahead of an installed one)."""
    path = [str(EXAMPLE.parent), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(path)}


def render(rows: dict[str, dict], args: argparse.Namespace,
           runs: dict[str, list[dict]]) -> str:
    ideal = rows["solo fast"]["samples_per_s"] + rows[f"solo slow ({args.slow:g}x)"]["samples_per_s"]
    lines = [
        f"El Che benchmark, {time.strftime('%Y-%m-%d')}, CPU ({os.cpu_count()} cores, one "
        f"thread per worker), emulated {args.slow:g}x slowdown; MLP hidden {args.hidden}, batch "
        f"{args.batch_size}, {args.epochs} epochs x {args.train_samples} samples per run; "
        f"median of {args.repeat} interleaved runs per row (min-max in brackets).",
        "",
        "| run | samples/s | x ideal | eval accuracy | sync overhead | syncs |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, row in rows.items():
        acc = f"{row['accuracy']:.4f}" if row.get("accuracy") is not None else "-"
        over = f"{row['sync_overhead']:.3f}" if row.get("sync_overhead") is not None else "-"
        ratio = row["samples_per_s"] / ideal
        low, high = row["spread"]
        lines.append(f"| {name} | {row['samples_per_s']:.0f} [{low:.0f}-{high:.0f}] | "
                     f"{ratio:.2f} | {acc} | {over} | {row.get('syncs', '-')} |")
    sync_eq, ddp = rows["sync, equal workers"]["samples_per_s"], \
        rows["torch DDP, equal workers"]["samples_per_s"]
    sync_slowed = rows["sync"]["samples_per_s"]
    ddp_slowed = rows[f"torch DDP, 1,{args.slow:g} slept on compute"]["samples_per_s"]
    at_once = rows[f"solo fast + solo slow ({args.slow:g}x) at once"]["samples_per_s"]
    lines += ["", f"ideal = solo fast + solo slow = {ideal:.0f} samples/s; "
                  f"fdl sync / torch DDP on equal workers = {sync_eq / ddp:.3f} "
                  f"({paired_ratios(runs, 'sync, equal workers')}), at 1,{args.slow:g} "
                  f"(both slept on compute only) = {sync_slowed / ddp_slowed:.3f}; the two solo "
                  f"runs at once: {at_once / ideal:.2f} of ideal (this host's ceiling for two "
                  "workers)"]
    loop_eq = rows["loop: sync, equal workers"]["samples_per_s"]
    lines.append(f"the same training as a loop of its own (fdl.init): cadence "
                 f"{rows['loop: cadence']['samples_per_s'] / ideal:.1%}, async "
                 f"{rows['loop: async']['samples_per_s'] / ideal:.1%} of ideal (the Trainer: "
                 f"{rows['cadence']['samples_per_s'] / ideal:.1%}, "
                 f"{rows['async']['samples_per_s'] / ideal:.1%}); loop sync / torch DDP on "
                 f"equal workers = {loop_eq / ddp:.3f} "
                 f"({paired_ratios(runs, 'loop: sync, equal workers')})")
    lines.append("in the run itself (its samples/s over the sum of each rank's own rate in "
                 "that run, fdl report's efficiency: what averaging and waiting cost, the "
                 "host's drift between runs left out; data loading counts as lost): "
                 + "; ".join(f"{name} {in_run(runs[name])}" for name in
                             ("cadence", "async", "loop: cadence", "loop: async")))
    for name, fixed in (("auto", ("sync", "cadence", "async")),
                        ("auto, equal workers", ("sync, equal workers",))):
        picks = sorted({str(result["policy"]) for result in runs[name]})
        best = max(fixed, key=lambda f: rows[f]["samples_per_s"])
        lines.append(f"{name}: picked {' / '.join(picks)}; {rows[name]['samples_per_s']:.0f} "
                     f"samples/s, {rows[name]['samples_per_s'] / rows[best]['samples_per_s']:.3f}"
                     f" of the best fixed policy here ({best})")
    for name in ("cadence", "async"):
        row = rows[name]
        lines.append(f"{name}: {row['samples_per_s'] / ideal:.1%} of ideal; per-rank samples/s "
                     f"{', '.join(f'{r:.0f}' for r in row['per_rank'])}; idle "
                     f"{', '.join(f'{i:.1%}' for i in row['idle'])}; final anchor "
                     f"{row['final_anchor']}; {row['samples_per_s'] / at_once:.1%} of the two "
                     "solo runs at once")
    return "\n".join(lines)


def in_run(results: list[dict]) -> str:
    """The runs' own efficiencies (fdl report's): their median, and the least and most."""
    values = sorted(result["in_run"] for result in results)
    return f"{values[len(values) // 2]:.3f} [{values[0]:.3f}-{values[-1]:.3f}]"


def paired_ratios(runs: dict[str, list[dict]], name: str) -> str:
    """Run ``name``'s throughput over the torch DDP run of the same repeat (run next to it),
    each repeat, and their median: a slow spell of this host hits both runs of a pair."""
    ratios = sorted(mine["samples_per_s"] / theirs["samples_per_s"]
                    for mine, theirs in zip(runs[name], runs["torch DDP, equal workers"],
                                            strict=True))
    return f"run by run {', '.join(f'{r:.3f}' for r in ratios)}: median " \
           f"{ratios[len(ratios) // 2]:.3f}"


if __name__ == "__main__":
    main()
