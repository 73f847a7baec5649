"""The trainer's correctness fixes, with real 2-process gloo runs where it matters:

* each rank draws its own dropout stream from identical initial parameters;
* ``backend="auto"`` is decided for the whole group, not per worker;
* sync's epoch tail (a round that leaves one rank without samples) trains as plain DDP does;
* async takes time-based checkpoints within an epoch, at a blocking average, and resumes there.
"""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
from helpers import clean_env, run_fdl, started

from fdl.engine.collectives import agreed_backend
from fdl.engine.data import epoch_permutation
from fdl.engine.loop import rank_seed
from fdl.engine.plan import (
    CALIBRATION_POOL,
    PlanConfig,
    RoundStats,
    advance,
    initial_state,
    next_round,
)
from fdl.rundir.checkpoints import latest_checkpoint
from fdl.rundir.timeline import read_events

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
from common import build_model, build_optimizer, make_data, train_step  # noqa: E402

# the plan's shares and timed checkpoints follow the workers' measured speed:
# these tests run with no other test beside them (tests/conftest.py)
pytestmark = pytest.mark.alone


def fdl_run(tmp_path: Path, script: str, *args: str, flags: tuple[str, ...] = (),
            env: dict[str, str] | None = None) -> tuple[Path, Path]:
    """``fdl run`` with 2 CPU workers; returns (the script's OUT directory, the run dir)."""
    out, run_dir = tmp_path / "out", tmp_path / "run"
    out.mkdir(exist_ok=True)
    proc = run_fdl("run", "--nproc-per-node", "2", "--run-dir", str(run_dir), "--quiet-ranks",
                   *flags, str(SCRIPTS / script), str(out), *args, cwd=tmp_path, env=env,
                   timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, run_dir


# --- per-rank random streams -----------------------------------------------------------------


def test_rank_zero_keeps_the_seed_and_every_rank_gets_its_own():
    assert rank_seed(7, 0) == 7  # a solo run draws what it always drew
    seeds = [rank_seed(7, rank) for rank in range(64)]
    assert len(set(seeds)) == 64
    assert rank_seed(8, 0) not in seeds[1:] and rank_seed(7, 1) != rank_seed(8, 1)


def test_ranks_start_identical_and_draw_different_dropout_masks(tmp_path):
    out, _ = fdl_run(tmp_path, "dropout_streams.py")
    ranks = [torch.load(out / f"rank{r}.pt") for r in (0, 1)]
    initial = [seen["initial"] for seen in ranks]
    assert initial[0].keys() == initial[1].keys()
    assert all(torch.equal(initial[0][k], initial[1][k]) for k in initial[0])
    masks = [seen["mask"] for seen in ranks]
    assert masks[0].shape == masks[1].shape == (32, 64)
    assert 0.3 < masks[0].float().mean() < 0.7  # it is a dropout mask (p = 0.5)
    assert not torch.equal(masks[0], masks[1])


# --- one backend for the group --------------------------------------------------------------


def test_an_explicit_backend_is_taken_as_asked_without_a_collective():
    def no_collective(mine: bool) -> bool:
        raise AssertionError("an explicit backend needs no agreement")

    for backend in ("cpu", "nccl"):
        for can_nccl in (False, True):
            assert agreed_backend(backend, can_nccl=can_nccl,
                                  all_can_nccl=no_collective) == backend


def test_auto_is_nccl_only_when_the_whole_group_can_use_it():
    asked: list[bool] = []

    def group_of(others: bool):
        def all_can_nccl(mine: bool) -> bool:
            asked.append(mine)
            return mine and others
        return all_can_nccl

    assert agreed_backend("auto", can_nccl=True, all_can_nccl=group_of(True)) == "nccl"
    assert agreed_backend("auto", can_nccl=True, all_can_nccl=group_of(False)) == "cpu"
    assert agreed_backend("auto", can_nccl=False, all_can_nccl=group_of(True)) == "cpu"
    assert asked == [True, True, False]  # each rank tells the group what it can do


def test_a_real_group_mixing_a_cpu_and_a_gpu_worker_agrees_on_cpu(tmp_path):
    """Rank 1 claims it could use NCCL, rank 0 that it could not: both must pick the CPU
    backend (deciding per worker gave gloo on one side and NCCL on the other: a hang)."""
    claims = {0: ["0", "1", "1"], 1: ["1", "1", "0"]}
    init_file = tmp_path / "rendezvous"
    with ExitStack() as running:  # a rank that hangs (or a failed assert) is killed on the way out
        procs = [running.enter_context(started(
            [sys.executable, str(SCRIPTS / "backend_agreement.py"), str(init_file), str(rank),
             str(tmp_path), *claims[rank]],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env()))
            for rank in (0, 1)]
        for proc in procs:
            output, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0, output[-3000:]
    answers = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert answers == [["cpu", "nccl", "cpu"]] * 2


# --- sync's tail equals plain DDP -------------------------------------------------------------


def ddp_reference(data, *, seed: int, epochs: int, batch_size: int) -> dict[str, torch.Tensor]:
    """Plain SGD in one process, on fdl's stream (epoch_permutation, next_round's slices):
    each step's gradient is the mean, over the ranks that have samples, of each rank's
    mean-loss gradient: what DDP computes with ``divide_by_initial_world_size=False``."""
    torch.manual_seed(seed)
    model = build_model()
    optimizer = build_optimizer(model.parameters())
    state = initial_state(PlanConfig(world_size=2, batch_size=batch_size,
                                     dataset_size=len(data), epochs=epochs, policy="sync"))
    tails = 0
    while not state.finished:
        plan = next_round(state)
        order = epoch_permutation(seed=seed, epoch=plan.epoch, size=len(data))
        batches = [data[order[s.start:s.stop]] for s in plan.slices if s.num_samples]
        tails += len(batches) < len(plan.slices)
        optimizer.zero_grad(set_to_none=True)
        (sum(train_step(model, batch) for batch in batches) / len(batches)).backward()
        optimizer.step()
        state = advance(state, plan, RoundStats.unknown(2))
    assert tails == epochs  # each epoch ended with a round that left a rank without samples
    return model.state_dict()


def test_syncs_tail_round_trains_as_plain_ddp_does(tmp_path):
    num_samples = 2 * 4 * 16 + 3  # the last round: 3 samples for rank 0, none for rank 1
    out, _ = fdl_run(tmp_path, "tail_train.py", str(num_samples))
    ours = torch.load(out / "rank0.pt")
    reference = ddp_reference(make_data(num_samples, seed=1), seed=7, epochs=2, batch_size=4)
    assert ours.keys() == reference.keys()
    for name in ours:
        assert torch.allclose(ours[name], reference[name], atol=1e-6, rtol=0), name
    torch.manual_seed(7)
    initial = build_model().state_dict()
    assert any(not torch.allclose(initial[n], ours[n], atol=1e-3) for n in ours)  # it trained


# --- async: time-based checkpoints within an epoch ---------------------------------------------

NUM_SAMPLES = 32768
ASYNC_FLAGS = ("--policy", "async", "--epochs", "1", "--checkpoint-every", "0.05s")
SMALL_ANCHOR = {"FDL_OVERHEAD_TARGET": "100"}  # the anchor stays at its minimum: many rounds


def events(run_dir: Path, rank: int, kind: str) -> list[dict]:
    return [e for e in read_events(run_dir, rank)
            if e["kind"] == kind]


def since_last_start(run_dir: Path, rank: int) -> list[dict]:
    """Rank ``rank``'s events of its last attempt."""
    all_events = read_events(run_dir, rank)
    last = max(i for i, e in enumerate(all_events) if e["kind"] == "start")
    return all_events[last + 1:]


def test_async_checkpoints_within_an_epoch_at_a_blocking_average_and_resumes_there(tmp_path):
    out, run_dir = fdl_run(tmp_path, "recovery_train.py", str(NUM_SAMPLES), flags=ASYNC_FLAGS,
                           env=SMALL_ANCHOR)
    checkpoints = events(run_dir, 0, "checkpoint")
    # within the epoch, after rounds whose boundary would not block by itself (round 0
    # calibrates and blocks anyway)
    inside = [c for c in checkpoints if 0 < c["position"] < NUM_SAMPLES and c["round"] > 2]
    assert inside, checkpoints
    syncs = {e["round"]: e for e in events(run_dir, 0, "sync")}
    for checkpoint in inside:  # taken after the average of the round before the one it names
        assert syncs[checkpoint["round"] - 1]["blocking"] is True, checkpoint
    assert any(not e["blocking"] for e in syncs.values())  # async: the others overlapped

    newest, _ = latest_checkpoint(run_dir)
    engine = newest.engine_state()
    assert engine["epoch"] == 0 and 0 < engine["position"] < NUM_SAMPLES
    assert newest.name in {c["name"] for c in inside}
    again = run_fdl("run", "--resume", str(run_dir), cwd=tmp_path, env=SMALL_ANCHOR,
                    timeout=240)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    for rank in (0, 1):
        starts = events(run_dir, rank, "start")
        assert [s["resumed_from"] for s in starts] == [None, newest.name]
    # the resumed attempt trains exactly the samples the checkpoint had left
    resumed = [e for rank in (0, 1) for e in since_last_start(run_dir, rank)
               if e["kind"] == "round"]
    assert sum(e["samples"] for e in resumed) == NUM_SAMPLES - engine["position"]
    result = json.loads((out / "rank0.json").read_text())
    assert [(r["epoch"], r["samples"]) for r in result["history"]] == [(1, NUM_SAMPLES)]
    assert result["summary"]["resumed_from"] == newest.name


# --- the calibration pool and the epoch's last round ------------------------------------------


def test_every_sample_once_per_epoch_with_the_calibration_pool_and_balanced_epoch_ends(tmp_path):
    """A real cadence run with a slow rank (8x), whose calibration round has a pool: every
    sample is trained on exactly once per epoch across the ranks (the pool's count reaches every
    rank's plan), and what each rank booked is what it trained on."""
    num_samples = 603  # not a multiple of the batch: the epoch's last round has a partial batch
    out, run_dir = fdl_run(tmp_path, "sample_ledger.py", str(num_samples),
                           flags=("--policy", "cadence", "--simulate-slowdown", "1,8"))
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    counts = torch.bincount(torch.tensor(seen[0] + seen[1]), minlength=num_samples)
    assert counts.tolist() == [2] * num_samples  # 2 epochs
    rounds = [[e for e in read_events(run_dir, r)
               if e["kind"] == "round"] for r in (0, 1)]
    first = [ranks[0] for ranks in rounds]
    # each rank ran its own 2 calibration batches; whoever was done first (usually the fast
    # rank, but a late start can make it the other) took pool batches meanwhile
    assert all(r["steps"] >= 2 for r in first)
    for r in (0, 1):  # what each rank booked is what it trained on
        assert sum(e["samples"] for e in rounds[r]) == len(seen[r])


def _pool_store():
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=60),
                     wait_for_workers=False)
    # one client per rank, as in a run: a client blocked in get() must not share its socket
    return store, TCPStore("127.0.0.1", store.port, None, False, timeout=timedelta(seconds=60))


def test_with_loader_workers_only_the_calibration_pool_is_fetched_in_process(tmp_path):
    """A DataLoader with a worker under cadence at 1,8: every sample once per epoch, and the
    training process fetches only the calibration pool's single batches itself; the epoch's
    tail pools come through the workers, a pass per take (a slow dataset's decoding would
    otherwise land on the training thread in every epoch's last round). The workers fetch a
    round's first batches while the boundary before it runs, where the rank foresaw its slice
    right (the rank whose slice comes first always does: its start is known)."""
    num_samples = 603
    out, run_dir = fdl_run(tmp_path, "sample_ledger.py", str(num_samples), "workers",
                           flags=("--policy", "cadence", "--simulate-slowdown", "1,8"))
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    counts = torch.bincount(torch.tensor(seen[0] + seen[1]), minlength=num_samples)
    assert counts.tolist() == [2] * num_samples
    in_process = [json.loads((out / f"in_process{r}.json").read_text()) for r in (0, 1)]
    plans = [e for e in read_events(run_dir, 0) if e["kind"] == "round"]
    calibration_pool = CALIBRATION_POOL * 2 * 4  # batches x calibration steps x batch size
    assert len(in_process[0]) + len(in_process[1]) <= calibration_pool
    assert len(plans) >= 3  # a calibration round and at least one epoch's last round each
    went_on = [e["round"] for r in (0, 1) for e in read_events(run_dir, r)
               if e["kind"] == "round" and e["fetched_ahead"]]
    assert went_on and 0 not in went_on  # nothing is foreseen before the first round


def test_the_calibration_pool_serves_ranks_until_every_rank_is_done():
    """SharedPool over a real TCPStore on loopback: a rank done with its slice takes batch 0, 1, ...
    while another is still on its own; once every rank is done nobody takes more, and every
    rank's close() returns the same count (the last one to stop publishes it)."""
    import threading

    from fdl.engine.round_messages import SharedPool as _Pool

    store, other = _pool_store()
    fast, slow = _Pool(5, 2, other, "fdl/pool/test/0/"), _Pool(5, 2, store, "fdl/pool/test/0/")
    store.add(fast.key + "done", 1)  # the fast rank finished its slice: open() counts it
    assert [list(fast.take()) for _ in range(3)] == [[0], [1], [2]]
    store.add(slow.key + "done", 1)  # now the slow one has too
    assert not fast.take() and not slow.take()
    results: list[int | None] = []
    closer = threading.Thread(target=lambda: results.append(fast.close()))
    closer.start()  # waits for the last rank to stop
    assert slow.close() == 3
    closer.join(timeout=60)
    assert results == [3]
    drained = _Pool(2, 1, store, "fdl/pool/test/1/")
    store.add(drained.key + "done", 0)
    assert [list(drained.take()) for _ in range(3)] == [[0], [1], []]  # the pool runs out
    assert drained.close() == 2
    assert not _Pool().take() and _Pool().close() is None  # a round without a pool


def test_the_epochs_tail_pool_is_drained_by_every_rank_a_chunk_at_a_time():
    """The epoch's last round's pool (``drains``): ranks take ``chunk`` batches per round trip
    until it is empty, done or not, every batch exactly once, the last chunk cut at the end;
    close() needs no other rank."""
    from fdl.engine.round_messages import SharedPool as _Pool

    store, other = _pool_store()
    fast = _Pool(7, 2, other, "fdl/pool/test/2/", drains=True, chunk=3)
    slow = _Pool(7, 2, store, "fdl/pool/test/2/", drains=True, chunk=1)
    taken = [list(fast.take()), list(slow.take()), list(fast.take()), list(slow.take()),
             list(fast.take()), list(slow.take())]
    assert taken == [[0, 1, 2], [3], [4, 5, 6], [], [], []]
    assert fast.close() == slow.close() == 7
    # guided: half the rank's speed share of what it saw left, at least its chunk
    fast = _Pool(20, 2, other, "fdl/pool/test/3/", drains=True, chunk=2, share=0.8)
    slow = _Pool(20, 2, store, "fdl/pool/test/3/", drains=True, chunk=1, share=0.2)
    taken = [list(fast.take()), list(slow.take()), list(fast.take()), list(fast.take()),
             list(slow.take()), list(fast.take()), list(slow.take())]
    assert taken == [list(range(0, 8)), [8, 9], list(range(10, 14)), [14, 15], [16],
                     [17, 18], [19]]
    assert not fast.take() and not slow.take()
