"""scripts/bench-live: the live progress display's cost (see the wrapper for what it runs)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "mlp_synthetic.py"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train-samples", type=int, default=16384)
    parser.add_argument("--out", type=Path,
                        default=ROOT / "runs" / time.strftime("bench-live-%Y%m%dT%H%M%SZ",
                                                              time.gmtime()))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = ["--hidden", "1536", "--batch-size", "128", "--train-samples",
             str(args.train_samples), "--epochs", str(args.epochs)]
    rates: dict[str, list[float]] = {"live": [], "quiet": []}
    for repeat in range(args.repeat):  # interleaved: a slow spell of the host hits both
        for mode in rates:
            run_dir = args.out / f"{mode}-{repeat}"
            rates[mode].append(run_on_terminal(run_dir, model, quiet=mode == "quiet"))
            print(f"  {repeat + 1}/{args.repeat} {mode:<5} {rates[mode][-1]:8.0f} samples/s",
                  file=sys.stderr)
    live, quiet = (statistics.median(rates[m]) for m in ("live", "quiet"))
    result = {"live": rates["live"], "quiet": rates["quiet"], "median_live": live,
              "median_quiet": quiet, "ratio": live / quiet}
    (args.out / "bench-live.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"live display, {args.repeat} runs each, cadence 1,2.5 on 2 CPU workers: median "
          f"{live:.0f} samples/s with it, {quiet:.0f} with --quiet; live / quiet = "
          f"{live / quiet:.3f}")


def run_on_terminal(run_dir: Path, model: list[str], *, quiet: bool) -> float:
    """One fdl run with stdout and stderr on a pseudo-terminal (drained as a terminal would)."""
    argv = [shutil.which("fdl") or "fdl", "run", "--run-dir", str(run_dir), "--policy", "cadence",
            "--nproc-per-node", "2", "--simulate-slowdown", "1,2.5",
            *(["--quiet"] if quiet else []), str(EXAMPLE), *model]
    master, slave = os.openpty()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "100", "TERM": "xterm"}
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    drained = bytearray()
    drain = threading.Thread(target=_drain, args=(master, drained), daemon=True)
    drain.start()
    code = proc.wait()
    drain.join()
    os.close(master)
    if code != 0:
        raise SystemExit(f"bench-live: {' '.join(argv)} exited {code}:\n{drained[-2000:]!r}")
    if not quiet and b"samples/s  loss" not in drained:
        raise SystemExit("bench-live: the live run showed no progress line")
    summary = json.loads((run_dir / "summary.json").read_text())
    return float(summary["throughput"]["samples_per_s"])


def _drain(fd: int, into: bytearray) -> None:
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the terminal closed: the run is over
            return
        if not chunk:
            return
        into.extend(chunk)


if __name__ == "__main__":
    main()
