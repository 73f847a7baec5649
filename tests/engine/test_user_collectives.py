"""fdl.engine.user_collectives: a collective from the script's code where the ranks' calls cannot
pair up is one UsageError naming the function and the line, not a hang; fdl's own collectives
go through; torch's functions come back as they were. In one process, over a one-rank gloo group
(torch's HashStore): what the guard decides depends on the caller and the reason, not on the
group. tests/engine/test_loop.py runs it in real 2-worker runs."""

from __future__ import annotations

import importlib.util
import re
import sys
import sysconfig

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fdl.engine.evaluation import _summed_over_ranks, evaluate_model
from fdl.engine.user_collectives import WAITING, refused
from fdl.errors import UsageError


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_scripts_collective_is_refused_naming_it_and_its_line(group):
    values = torch.ones(3)
    with refused(lambda: "--policy cadence trains"):
        line = sys._getframe().f_lineno + 2
        with pytest.raises(UsageError) as refusal:
            dist.all_reduce(values)
    message = str(refusal.value)
    assert message.startswith(f"torch.distributed.all_reduce called at {__file__}:{line} "
                              "while --policy cadence trains")
    assert "run.log" in refusal.value.hint
    assert torch.equal(values, torch.ones(3))  # nothing was sent


def test_it_goes_through_when_no_reason_holds_and_after_the_guard_ends(group):
    originals = {name: getattr(dist, name) for name in WAITING if hasattr(dist, name)}
    values = torch.full((2,), 3.0)
    with refused(lambda: None):  # sync's steps, or one worker: every call pairs up
        assert dist.all_reduce is not originals["all_reduce"]
        dist.all_reduce(values)
        dist.barrier()
    assert torch.equal(values, torch.full((2,), 3.0))
    assert {name: getattr(dist, name) for name in originals} == originals
    dist.all_reduce(values)  # unguarded again


def test_fdls_own_collectives_go_through(group):
    with refused(lambda: "--policy async trains"):
        sums, counts = _summed_over_ranks({"loss": 2.0}, {"loss": 4}, device=torch.device("cpu"),
                                          world_size=1)
    assert (sums, counts) == ({"loss": 2.0}, {"loss": 4})


def test_an_evaluation_function_may_not_wait_for_other_ranks():
    """Each rank evaluates a shard of its own size under every policy: the evaluation's own
    function is refused a collective once there are two ranks (no group needed: it is refused
    before any is made)."""

    def metric(model, batch):
        dist.barrier()
        return {"accuracy": 1.0}

    data = [(torch.zeros(4), 0)] * 8
    with pytest.raises(UsageError, match=r"barrier called at .* while an evaluation runs"):
        evaluate_model(nn.Linear(4, 2), data, metric, batch_size=4, device=torch.device("cpu"),
                       rank=0, world_size=2)


def test_nested_guards_hold_until_the_last_ends_and_leave_a_later_patch_alone(group):
    original = dist.all_reduce
    with refused(lambda: None):
        with refused(lambda: "an evaluation runs"):
            guard = dist.all_reduce
        assert dist.all_reduce is guard  # the outer one still holds
        with pytest.raises(UsageError), refused(lambda: "an evaluation runs"):
            dist.all_reduce(torch.ones(1))
    assert dist.all_reduce is original

    def someone_elses(*args, **kwargs):
        return original(*args, **kwargs)

    with refused(lambda: None):
        dist.all_reduce = someone_elses
    try:
        assert dist.all_reduce is someone_elses  # not put back over another patch
    finally:
        dist.all_reduce = original


def _module_function(package: str, source: str, name: str, **namespace):
    """A function whose code runs as module ``package`` (its frames say so), from ``source``."""
    scope = {"__name__": package, **namespace}
    exec(compile(source, f"<{package}>", "exec"), scope)
    return scope[name]


def test_a_torch_helper_is_judged_by_whoever_called_it(group):
    """torch.distributed.nn's collectives call torch.distributed's on the caller's behalf: the
    script's call through one is refused naming the script's line; fdl's goes through."""
    helper = _module_function("torch.distributed.helper",
                              "def mean(t):\n    dist.all_reduce(t)\n    return t\n", "mean",
                              dist=dist)
    ours = _module_function("fdl.engine.somewhere", "def average(t):\n    return helper(t)\n",
                            "average", helper=helper)
    with refused(lambda: "--policy cadence trains"):
        assert torch.equal(ours(torch.ones(2)), torch.ones(2))
        line = sys._getframe().f_lineno + 2
        with pytest.raises(UsageError, match=f"all_reduce called at {__file__}:{line} "):
            helper(torch.ones(2))


def test_ddps_own_collectives_go_through_from_the_scripts_forward(group):
    """fdl's DDP joins in sync's unevenly cut round: torch's Join all-reduces from inside the
    script's forward. DDP's and Join's modules are fdl's doing (a script's own DDP is refused
    before any step), so their calls pass."""
    for module in ("torch.distributed.algorithms.join", "torch.nn.parallel.distributed"):
        joined = _module_function(module, "def notify(t):\n    dist.all_reduce(t)\n    return t\n",
                                  "notify", dist=dist)
        with refused(lambda: "this round of --policy sync is cut unevenly"):
            assert torch.equal(joined(torch.ones(2)), torch.ones(2))


def _module_at(tmp_path, monkeypatch, name: str, source: str, where=None):
    """A module ``name`` loaded from a file of ``source`` in ``tmp_path`` (its ``__file__`` then
    said to be ``where``, when given), in sys.modules for the test's time."""
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if where is not None:
        module.__file__ = where
    monkeypatch.setitem(sys.modules, name, module)
    return module


SCRIPT_MODULE = ("from torch.distributed import all_reduce\n\n"
                 "def mean(t):\n    all_reduce(t)\n    return t\n")


def test_a_function_the_scripts_modules_imported_by_name_is_guarded_too(group, tmp_path,
                                                                          monkeypatch):
    """``from torch.distributed import all_reduce`` before the run binds torch's function in
    the script's module: that name is a guard while the run steps, torch's again after; an
    installed package's name (site-packages) is left alone."""
    original = dist.all_reduce
    script = _module_at(tmp_path, monkeypatch, "fdl_test_script_helpers", SCRIPT_MODULE)
    installed = _module_at(tmp_path, monkeypatch, "fdl_test_installed", SCRIPT_MODULE,
                           where=f"{sysconfig.get_path('purelib')}/fdl_test_installed.py")
    with refused(lambda: "--policy cadence trains"):
        with pytest.raises(UsageError, match=r"torch\.distributed\.all_reduce called at "
                                             rf"{re.escape(str(tmp_path))}/"
                                             r"fdl_test_script_helpers\.py:4 while --policy"):
            script.mean(torch.ones(2))
        assert installed.all_reduce is original
    assert script.all_reduce is original
    assert torch.equal(script.mean(torch.ones(2)), torch.ones(2))


def test_a_name_the_script_rebound_meanwhile_is_left_as_it_is(group, tmp_path, monkeypatch):
    script = _module_at(tmp_path, monkeypatch, "fdl_test_script_rebinds", SCRIPT_MODULE)

    def own(t):
        return t

    with refused(lambda: None):
        script.all_reduce = own
    assert script.all_reduce is own
