"""fdl.engine.precision: each rank's precision, what ``auto`` becomes, autocast and the scaler.

The CUDA rules cannot meet a GPU here: the GPU is the mocked boundary, given to
``resolve_precision`` as its compute capability (``capability=``) beside a ``cuda`` device
object, which torch builds without a GPU. Autocast itself runs for real, on the CPU in bf16.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fdl.engine.precision import autocast, make_scaler, precision_for_rank, resolve_precision
from fdl.errors import UsageError

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)
PASCAL, VOLTA, TURING, AMPERE, HOPPER = (6, 1), (7, 0), (7, 5), (8, 0), (9, 0)


@pytest.mark.parametrize(("spec", "expected"), [
    (("bf16",), ["bf16", "bf16", "bf16"]),
    (("auto",), ["auto", "auto", "auto"]),
    (("bf16", "fp32", "fp16"), ["bf16", "fp32", "fp16"]),
])
def test_one_choice_is_every_ranks_and_a_list_one_per_rank(spec, expected):
    assert [precision_for_rank(spec, rank, 3) for rank in range(3)] == expected


def test_a_list_of_another_length_than_the_world_is_a_usage_error_naming_both():
    with pytest.raises(UsageError) as caught:
        precision_for_rank(("bf16", "fp32"), 0, 3)
    assert caught.value.message == "precision has 2 values (bf16,fp32) for 3 worker(s)"
    assert "--precision bf16,fp32 for 2 workers" in caught.value.hint
    assert caught.value.exit_code == 2


@pytest.mark.parametrize(("capability", "expected"), [
    (PASCAL, "fp32"), (VOLTA, "fp32"), (TURING, "fp32"), (AMPERE, "bf16"), (HOPPER, "bf16")])
def test_auto_is_bf16_from_compute_capability_8_0_and_fp32_below(capability, expected):
    assert resolve_precision("auto", CUDA, capability=capability) == expected


def test_auto_is_fp32_on_the_cpu():
    assert resolve_precision("auto", CPU) == "fp32"


@pytest.mark.parametrize("capability", [PASCAL, TURING, AMPERE, HOPPER])
@pytest.mark.parametrize("choice", ["fp32", "fp16"])
def test_fp32_and_fp16_are_kept_on_any_gpu(choice, capability):
    assert resolve_precision(choice, CUDA, capability=capability) == choice


def test_bf16_is_kept_from_8_0():
    assert resolve_precision("bf16", CUDA, capability=AMPERE) == "bf16"


def test_bf16_below_8_0_is_a_usage_error_suggesting_fp16_or_fp32():
    with pytest.raises(UsageError) as caught:
        resolve_precision("bf16", CUDA, capability=TURING)
    assert caught.value.message == ("precision bf16 needs a GPU of compute capability 8.0 or "
                                    "newer; cuda:0 has 7.5")
    assert "fp16" in caught.value.hint and "fp32" in caught.value.hint


def test_bf16_and_fp32_are_kept_on_the_cpu_and_fp16_is_refused():
    assert resolve_precision("bf16", CPU) == "bf16"
    assert resolve_precision("fp32", CPU) == "fp32"
    with pytest.raises(UsageError) as caught:
        resolve_precision("fp16", CPU)
    assert caught.value.message.startswith("precision fp16 is not supported on the CPU")
    assert caught.value.hint == "use bf16 or fp32 on the CPU"


def test_an_unknown_choice_is_a_usage_error():
    with pytest.raises(UsageError, match="unknown precision 'fp8'"):
        resolve_precision("fp8", CPU)


def test_bf16_autocast_runs_the_forward_in_bf16_and_leaves_parameters_fp32():
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    with autocast(CPU, "bf16"):
        inside = layer(x)
    outside = layer(x)
    assert inside.dtype == torch.bfloat16
    assert outside.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in layer.parameters())
    inside.float().sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in layer.parameters())
    assert torch.allclose(inside.float(), outside, atol=0.05)  # the same function, rounded


def test_fp32_autocast_changes_nothing():
    layer = nn.Linear(4, 3)
    with autocast(CPU, "fp32"):
        assert not torch.is_autocast_enabled("cpu")
        assert layer(torch.randn(2, 4)).dtype == torch.float32


def test_only_fp16_gets_a_gradient_scaler():
    scaler = make_scaler("fp16", CPU)
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled()
    assert make_scaler("bf16", CPU) is None
    assert make_scaler("fp32", CPU) is None
