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
    # "snapshots": --quiet, but rank 0 still writes progress.json (FDL_PROGRESS passed through
    # the environment): the workers' share of the cost, without the launcher's redraws.
    rates: dict[str, list[float]] = {"live": [], "quiet": [], "snapshots": []}
    for repeat in range(args.repeat):  # interleaved: a slow spell of the host hits all
        for mode in rates:
            run_dir = args.out / f"{mode}-{repeat}"
            rates[mode].append(run_on_terminal(run_dir, model, quiet=mode != "live",
                                               snapshots=mode == "snapshots"))
            print(f"  {repeat + 1}/{args.repeat} {mode:<5} {rates[mode][-1]:8.0f} samples/s",
                  file=sys.stderr)
    live, quiet, snaps = (statistics.median(rates[m]) for m in ("live", "quiet", "snapshots"))
    result = {**rates, "median_live": live, "median_quiet": quiet, "median_snapshots": snaps,
              "ratio": live / quiet, "ratio_snapshots": snaps / quiet}
    cpu = {mode: statistics.median(LAUNCHER_CPU[f"{mode}-{r}"] for r in range(args.repeat))
           for mode in rates}
    result["launcher_cpu_s"] = cpu
    (args.out / "bench-live.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"the launcher's own CPU seconds per run (median): {cpu['live']:.2f} with the "
          f"display, {cpu['quiet']:.2f} with --quiet, {cpu['snapshots']:.2f} with --quiet and "
          "snapshots (the same launcher work: the spread is noise)")
    write_ms, redraw_ms = component_costs()
    per_s = 4 * (write_ms + redraw_ms)
    result["component_ms"] = {"snapshot_write": write_ms, "redraw": redraw_ms}
    (args.out / "bench-live.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"its parts, timed in this process: a snapshot write {write_ms:.3f} ms (rank 0), a "
          f"redraw {redraw_ms:.3f} ms (launcher), 4 of each a second = {per_s:.2f} ms of CPU "
          f"per second, {per_s / 10:.3f}% of one core")
    print(f"live display, {args.repeat} interleaved runs each, cadence 1,2.5 on 2 CPU workers, "
          f"median samples/s: {live:.0f} with it, {quiet:.0f} with --quiet, {snaps:.0f} with "
          f"--quiet and rank 0's snapshots; live / quiet = {live / quiet:.3f}, snapshots / "
          f"quiet = {snaps / quiet:.3f}")


def component_costs(count: int = 2000) -> tuple[float, float]:
    """CPU milliseconds of one snapshot write (fdl.rundir.progress) and of one redraw of the two
    status lines on a terminal console (fdl.launch.live), averaged over ``count``."""
    import io
    import tempfile

    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    from fdl.launch.live import format_status
    from fdl.rundir.progress import ProgressFile

    with tempfile.TemporaryDirectory() as tmp:
        writer = ProgressFile(Path(tmp) / "progress.json", 0.25, 3, 16384, 2)
        start = time.process_time()
        for index in range(count):
            writer.write(samples=index, epoch=0, shares=[0.7, 0.3], anchor=20, sync_s=0.1,
                         busy_s=2.0)
        write_ms = (time.process_time() - start) / count * 1000
        snapshot = json.loads(writer.path.read_text())
    console = Console(file=io.StringIO(), force_terminal=True, width=100)
    with Live(Text(""), console=console, auto_refresh=False, transient=True) as live:
        start = time.process_time()
        for index in range(count):
            snapshot["samples"] = index
            live.update(Text(format_status(snapshot, width=99), no_wrap=True), refresh=True)
        redraw_ms = (time.process_time() - start) / count * 1000
    return write_ms, redraw_ms


def run_on_terminal(run_dir: Path, model: list[str], *, quiet: bool, snapshots: bool) -> float:
    """One fdl run with stdout and stderr on a pseudo-terminal (drained as a terminal would)."""
    argv = [shutil.which("fdl") or "fdl", "run", "--run-dir", str(run_dir), "--policy", "cadence",
            "--nproc-per-node", "2", "--simulate-slowdown", "1,2.5",
            *(["--quiet"] if quiet else []), str(EXAMPLE), *model]
    master, slave = os.openpty()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "100", "TERM": "xterm"}
    env.pop("FDL_PROGRESS", None)
    if snapshots:
        env["FDL_PROGRESS"] = "0.25"
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    drained = bytearray()
    drain = threading.Thread(target=_drain, args=(master, drained), daemon=True)
    drain.start()
    cpu = [0.0]
    watch = threading.Thread(target=_launcher_cpu, args=(proc, cpu), daemon=True)
    watch.start()
    code = proc.wait()
    drain.join()
    watch.join()
    os.close(master)
    if code != 0:
        raise SystemExit(f"bench-live: {' '.join(argv)} exited {code}:\n{drained[-2000:]!r}")
    if not quiet and b"samples/s  loss" not in drained:
        raise SystemExit("bench-live: the live run showed no progress line")
    summary = json.loads((run_dir / "summary.json").read_text())
    LAUNCHER_CPU[run_dir.name] = cpu[0]
    return float(summary["throughput"]["samples_per_s"])


LAUNCHER_CPU: dict[str, float] = {}  # run directory name -> the launcher's own CPU seconds


def _launcher_cpu(proc: subprocess.Popen, into: list[float]) -> None:
    """The launcher process's own CPU time (not its workers'), last seen before it exited."""
    import psutil

    try:
        launcher = psutil.Process(proc.pid)
        while proc.poll() is None:
            times = launcher.cpu_times()
            into[0] = times.user + times.system
            time.sleep(0.05)
    except psutil.Error:
        return


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
