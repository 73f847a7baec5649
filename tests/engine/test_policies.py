"""fdl.engine.policies: what each policy does at a round boundary, for every kind of round.

The round loop asks ``policy.blocking(plan, checkpoint_due=..., ends_run=...)`` at every
boundary: a wrong answer either makes async wait for averages it could overlap (an epoch's end
among them) or leaves the ranks with different models where one model is needed at once (the
final model, a checkpoint)."""

from __future__ import annotations

import itertools

import pytest

from fdl.engine.plan import RankSlice, RoundPlan
from fdl.engine.policies import ASYNC, CADENCE, SYNC, policy_named
from fdl.settings import POLICIES


def plan(*, calibration: bool = False, last_in_epoch: bool = False) -> RoundPlan:
    slices = (RankSlice(0, 4, 0, 128), RankSlice(1, 2, 128, 192))
    return RoundPlan(round_index=3, epoch=0, anchor=2, counts=(4, 2), slices=slices,
                     last_in_epoch=last_in_epoch, calibration=calibration)


# calibration, an epoch's last round, a checkpoint due, the run's last round (an epoch's last)
ROUND_KINDS = [kind for kind in itertools.product([False, True], repeat=4)
               if kind[1] or not kind[3]]


@pytest.mark.parametrize(("calibration", "last", "due", "ends"), ROUND_KINDS)
@pytest.mark.parametrize("policy", [SYNC, CADENCE], ids=["sync", "cadence"])
def test_sync_and_cadence_always_wait_for_the_average(policy, calibration, last, due, ends):
    assert policy.blocking(plan(calibration=calibration, last_in_epoch=last),
                           checkpoint_due=due, ends_run=ends) is True


@pytest.mark.parametrize(("calibration", "last", "due", "ends"), ROUND_KINDS)
def test_async_blocks_only_where_one_model_is_needed_at_once(calibration, last, due, ends):
    """The calibration round (its cost tunes the anchor), the run's last round (the final
    model) and a round after which a checkpoint is due; an ordinary round and an epoch's end
    go on while their average runs (the epoch ends when it lands)."""
    assert ASYNC.blocking(plan(calibration=calibration, last_in_epoch=last),
                          checkpoint_due=due, ends_run=ends) is (calibration or due or ends)


def test_sync_averages_only_at_epoch_ends_and_the_others_every_round():
    assert SYNC.averages_at(plan()) is False
    assert SYNC.averages_at(plan(calibration=True)) is False
    assert SYNC.averages_at(plan(last_in_epoch=True)) is True
    for policy in (CADENCE, ASYNC):
        assert policy.averages_at(plan()) is True
        assert policy.averages_at(plan(last_in_epoch=True)) is True


def test_only_sync_syncs_gradients_and_only_local_step_policies_average_parameters():
    assert (SYNC.syncs_gradients, CADENCE.syncs_gradients, ASYNC.syncs_gradients) == (
        True, False, False)
    assert (SYNC.averages_params, CADENCE.averages_params, ASYNC.averages_params) == (
        False, True, True)
    assert (SYNC.local_steps, CADENCE.local_steps, ASYNC.local_steps) == (False, True, True)
    assert (SYNC.background, CADENCE.background, ASYNC.background) == (False, False, True)


def test_every_setting_name_has_its_policy_and_nothing_else_does():
    assert [policy_named(name).name for name in POLICIES] == list(POLICIES)
    assert {policy_named(name) for name in POLICIES} == {SYNC, CADENCE, ASYNC}
    with pytest.raises(ValueError, match="unknown policy 'turbo'; expected one of sync"):
        policy_named("turbo")
    assert policy_named(ASYNC) is ASYNC

