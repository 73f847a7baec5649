"""Rank FAIL_RANK fails (exit code, exception or SIGKILL) while the others wait; on a restart
attempt (TORCHELASTIC_RESTART_COUNT > 0) every rank succeeds. Writes its pid to OUT_DIR."""

import os
import signal
import sys
import time

mode, fail_rank, out_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rank = int(os.environ["RANK"])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
with open(os.path.join(out_dir, f"pid-{rank}-{attempt}"), "w") as fh:
    fh.write(str(os.getpid()))
print(f"rank {rank} attempt {attempt} starting", flush=True)
if attempt > 0 and mode.endswith("-once"):
    print(f"rank {rank} attempt {attempt} ok")
    sys.exit(0)
if rank == fail_rank:
    time.sleep(0.5)
    print("about to fail: the root cause line", flush=True)
    if mode.startswith("exit"):
        sys.exit(7)
    if mode.startswith("raise"):
        raise RuntimeError("boom from the training loop")
    if mode.startswith("kill"):
        os.kill(os.getpid(), signal.SIGKILL)
time.sleep(120)  # the others would run on; the launcher must stop them
print(f"rank {rank} was never stopped", flush=True)  # what a test looks for
