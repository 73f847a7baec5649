"""Rank FAIL_RANK fails (exit code, exception or SIGKILL) once every rank of its attempt has
started, while the others wait; on a restart attempt (TORCHELASTIC_RESTART_COUNT > 0) every rank
succeeds. Each rank writes its pid to OUT_DIR/pid-<rank>-<attempt> when it starts."""

import os
import signal
import sys
import time

mode, fail_rank, out_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
pid_file, staged = (os.path.join(out_dir, f"{prefix}pid-{rank}-{attempt}") for prefix in ("", "."))
with open(staged, "w") as fh:
    fh.write(str(os.getpid()))
os.replace(staged, pid_file)  # whole when it appears (tests read it); not a pid-* before
print(f"rank {rank} attempt {attempt} starting", flush=True)
if attempt > 0 and mode.endswith("-once"):
    print(f"rank {rank} attempt {attempt} ok")
    sys.exit(0)
if rank == fail_rank:
    # Fail only once every other rank runs, so that the launcher has ranks to stop (and their
    # pid files name them); the deadline is a guard against a launcher that never starts them.
    others = [os.path.join(out_dir, f"pid-{r}-{attempt}") for r in range(world_size)]
    deadline = time.monotonic() + 120
    while not all(map(os.path.exists, others)) and time.monotonic() < deadline:
        time.sleep(0.01)
    print("about to fail: the root cause line", flush=True)
    if mode.startswith("exit"):
        sys.exit(7)
    if mode.startswith("raise"):
        raise RuntimeError("boom from the training loop")
    if mode.startswith("kill"):
        os.kill(os.getpid(), signal.SIGKILL)
time.sleep(120)  # the others would run on; the launcher must stop them
print(f"rank {rank} was never stopped", flush=True)  # what a test looks for
