"""The body of scripts/bench-loader (see that file for what it measures)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench_elche import EXAMPLE, _env, median_row

from fdl.rundir.timeline import read_events

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--read-ms", type=float, default=0.1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--train-samples", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path,
                        default=ROOT / "runs" / time.strftime("bench-loader-%Y%m%dT%H%M%SZ",
                                                              time.gmtime()))
    args = parser.parse_args()
    if not (args.read_ms > 0 and args.workers >= 1 and args.repeat >= 1):
        parser.error("--read-ms must be > 0, --workers and --repeat >= 1")
    args.out.mkdir(parents=True, exist_ok=True)
    model_args = ["--hidden", str(args.hidden), "--train-samples", str(args.train_samples),
                  "--epochs", str(args.epochs), "--batch-size", str(args.batch_size)]
    slow = ["--read-ms", f"{args.read_ms:g}"]
    cells = [("in memory", []),
             (f"{args.read_ms:g} ms/sample, in process", slow),
             (f"{args.read_ms:g} ms/sample, {args.workers} workers",
              [*slow, "--workers", str(args.workers)])]
    runs: dict[str, list[dict]] = {name: [] for name, _ in cells}
    for repeat in range(args.repeat):  # round-robin: a slow spell of the host hits every cell
        for index, (name, extra) in enumerate(cells):
            result = solo_run(args.out / f"cell{index}-{repeat}", [*model_args, *extra])
            runs[name].append(result)
            print(f"  {repeat + 1}/{args.repeat} {name:<28} {result['samples_per_s']:8.0f} "
                  f"samples/s, data wait {result['data_wait']:.1%}", file=sys.stderr)
    rows = {name: median_row(results) for name, results in runs.items()}
    report = render(rows, args)
    print(report)
    (args.out / "bench-loader.md").write_text(report + "\n")
    (args.out / "bench-loader.json").write_text(json.dumps(rows, indent=2) + "\n")


def solo_run(run_dir: Path, example_args: list[str]) -> dict:
    argv = [shutil.which("fdl") or "fdl", "run", "--quiet-ranks", "--nproc-per-node", "1",
            "--run-dir", str(run_dir), str(EXAMPLE), *example_args]
    proc = subprocess.run(argv, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"bench-loader: {' '.join(argv[:8])} ... exited {proc.returncode}")
    summary = json.loads((run_dir / "summary.json").read_text())
    rounds = [e for e in read_events(run_dir, 0) if e["kind"] == "round"]
    data_s = sum(e.get("data_s", 0.0) for e in rounds)
    return {"samples_per_s": summary["throughput"]["samples_per_s"],
            "wall_s": summary["wall_s"], "data_wait": data_s / summary["wall_s"],
            "rounds": len(rounds)}


def render(rows: dict[str, dict], args: argparse.Namespace) -> str:
    base = rows["in memory"]["samples_per_s"]
    lines = [
        f"Loader benchmark, {time.strftime('%Y-%m-%d')}, CPU ({os.cpu_count()} cores, one "
        f"training thread), one worker (solo); MLP hidden {args.hidden}, batch "
        f"{args.batch_size}, {args.epochs} epochs x {args.train_samples} samples per run; "
        f"median of {args.repeat} interleaved runs per row (min-max in brackets).",
        "",
        "| run | samples/s | x in memory | data wait (of wall) | rounds |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, row in rows.items():
        low, high = row["spread"]
        lines.append(f"| {name} | {row['samples_per_s']:.0f} [{low:.0f}-{high:.0f}] | "
                     f"{row['samples_per_s'] / base:.2f} | {row['data_wait']:.1%} | "
                     f"{row['rounds']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
