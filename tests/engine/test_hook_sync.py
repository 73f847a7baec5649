"""A loop script's sync (fdl.engine.hook_sync) over a real 2-process gloo group, on the harness
of ``test_averaging.py``: the gradients are each rank's mean, as DDP's, bucket by bucket; a
bucket whose gradients are all there is reduced while backward still runs; the gradients are
views of the buckets; an unused parameter, a float64 layer, an accumulated step, a gradient
left as last step's view, and a rank without data (shadowing) all reduce alike on every rank.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_averaging import run_ranks, scenario
from torch import nn

from fdl.engine.hook_sync import HookSync

WORLD_SIZE = 2


class Net(nn.Module):
    """An unused layer registered first (so it sits in the last bucket reduced), then a float32
    body of about 2 MB and a float64 head: two buckets, the head's first (backward's order; a
    bucket of its own by its dtype), then one of float32 for the rest (under 25 MiB)."""

    def __init__(self):
        super().__init__()
        self.unused = nn.Linear(3, 3)
        self.first = nn.Linear(64, 700)
        self.body = nn.Linear(700, 700)
        self.head = nn.Linear(700, 4).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.body(torch.relu(self.first(x))))
        return self.head(hidden.double())


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(16, 64, generator=generator), torch.randint(0, 4, (16,),
                                                                   generator=generator)


def loss(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(data[0]), data[1])


def mean_grads(model: nn.Module, rank: int, steps: list[int]) -> list[torch.Tensor]:
    """The reference: this rank's gradients of ``steps`` summed, then the mean over the
    ranks by a plain all-reduce of each (an unused parameter's: zeros)."""
    model.zero_grad(set_to_none=True)
    for step in steps:
        loss(model, batch(rank, step)).backward()
    means = []
    for param in model.parameters():
        grad = param.grad.clone() if param.grad is not None else torch.zeros_like(param)
        dist.all_reduce(grad)
        means.append(grad / WORLD_SIZE)
    return means


def inside(tensor: torch.Tensor, flat: torch.Tensor) -> bool:
    start = flat.data_ptr()
    return start <= tensor.data_ptr() < start + flat.numel() * flat.element_size()


def grads(model: nn.Module) -> list[list[float]]:
    return [p.grad.reshape(-1).tolist() for p in model.parameters()]


def in_flight_early(rank: int) -> dict[str, Any]:
    """An accumulated step (2 batches, armed before the second) of a model with an unused
    parameter: what was in flight when backward reached the first layer's weight, its last
    gradient; the mean gradients and where they live."""
    torch.manual_seed(7)
    model = Net()
    reference = mean_grads(copy.deepcopy(model), rank, [0, 1])
    seen: list[int] = []

    def last_gradient(_: torch.Tensor) -> None:  # registered before HookSync's: runs first
        if sync._armed:
            seen.append(sum(b.work is not None for b in sync.buckets))

    model.first.weight.register_post_accumulate_grad_hook(last_gradient)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = HookSync(model, optimizer, device=torch.device("cpu"), via_host=True)
    loss(model, batch(rank, 0)).backward()
    sync.arm()
    loss(model, batch(rank, 1)).backward()
    after_backward = sync._reduced
    optimizer.step()  # the unused parameter's bucket is reduced here, before the step
    return {"buckets": len(sync.buckets), "in_flight": seen, "after_backward": after_backward,
            "grads": grads(model), "reference": [g.reshape(-1).tolist() for g in reference],
            "views": [any(inside(p.grad, b.flat) for b in sync.buckets)
                      for p in model.parameters()],
            "timed": sync.end_step() is not None}


class Used(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(64, 700)
        self.body = nn.Linear(700, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(torch.relu(self.first(x)))


def two_steps_zeroed_in_place(rank: int) -> dict[str, Any]:
    """Two steps with ``zero_grad(set_to_none=False)`` between: the second backward
    accumulates into last step's reduced views, which are the buckets themselves."""
    torch.manual_seed(7)
    model = Used()
    shadow = copy.deepcopy(model)
    shadow_optimizer = torch.optim.SGD(shadow.parameters(), lr=0.1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = HookSync(model, optimizer, device=torch.device("cpu"), via_host=True)
    results = []
    for step in (0, 1):
        reference = mean_grads(shadow, rank, [step])
        optimizer.zero_grad(set_to_none=False)
        sync.arm()
        loss(model, batch(rank, step)).backward()
        results.append({"reduced": sync._reduced, "grads": grads(model),
                        "reference": [g.reshape(-1).tolist() for g in reference]})
        optimizer.step()
        for param, mean in zip(shadow.parameters(), reference, strict=True):
            param.grad = mean
        shadow_optimizer.step()
    return {"steps": results}


def one_rank_without_data(rank: int) -> dict[str, Any]:
    """Rank 1 has no batch for the step and shadows it with zeros; rank 0's gradient is then
    its own, divided by the one rank with data."""
    torch.manual_seed(7)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    local = copy.deepcopy(model)
    loss(local, batch(rank, 0)).backward()
    sync = HookSync(model, optimizer, device=torch.device("cpu"), via_host=True)
    sync.ranks_with_data = 1
    if rank == 0:
        sync.arm()
        loss(model, batch(rank, 0)).backward()
        optimizer.step()
        return {"grads": grads(model),
                "reference": [(p.grad if p.grad is not None else torch.zeros_like(p))
                              .reshape(-1).tolist() for p in local.parameters()]}
    sync.shadow(ranks_with_data=1)
    return {}


SCENARIOS = {"in_flight_early": in_flight_early, "zeroed_in_place": two_steps_zeroed_in_place,
             "without_data": one_rank_without_data}


def close(ours: list[list[float]], theirs: list[list[float]]) -> None:
    assert len(ours) == len(theirs)
    for mine, reference in zip(ours, theirs, strict=True):
        assert torch.allclose(torch.tensor(mine, dtype=torch.float64),
                              torch.tensor(reference, dtype=torch.float64),
                              atol=1e-6, rtol=0)


def test_buckets_reduce_to_the_mean_and_start_while_backward_runs(tmp_path):
    ranks = run_ranks(tmp_path, __name__)
    for result in scenario(ranks, "in_flight_early"):
        assert result["buckets"] == 2  # the float64 head's; the float32 body's with the rest
        assert result["in_flight"] == [1]  # the head's all-reduce started before the end
        assert result["after_backward"] is False  # the unused parameter held its bucket
        close(result["grads"], result["reference"])
        assert result["views"] == [True] * 8  # each gradient is its part of its bucket
        assert result["timed"]
    first, second = scenario(ranks, "in_flight_early")
    assert first["grads"] == second["grads"]  # one mean on both ranks, to the bit
    for result in scenario(ranks, "zeroed_in_place"):
        for step in result["steps"]:
            assert step["reduced"] is True  # every gradient came: reduced inside backward
            close(step["grads"], step["reference"])
    zero, _ = scenario(ranks, "without_data")
    close(zero["grads"], zero["reference"])


def one_rank_step(tmp_path: Path, device: torch.device, backend: str) -> None:
    """A group of one on ``device``: the armed backward reduces inside backward (the mean of
    one rank is its gradient), each gradient is a view of a bucket on the device, and a
    second step needs no wait for the device on the host (CUDA: torch's sync debug mode
    raises on any synchronizing call; the first step made NCCL's communicator)."""
    dist.init_process_group(backend, init_method=f"file://{tmp_path}/rdzv", rank=0,
                            world_size=1)
    try:
        torch.manual_seed(7)
        model = Used().to(device)
        reference = copy.deepcopy(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        sync = HookSync(model, optimizer, device=device, via_host=backend == "gloo"
                        and device.type == "cuda", process_group=None)
        data = tuple(t.to(device) for t in batch(0, 0))
        for step in range(2):
            optimizer.zero_grad(set_to_none=True)
            reference.zero_grad(set_to_none=True)
            loss(reference, data).backward()
            sync.arm()
            watch = torch.cuda.set_sync_debug_mode \
                if device.type == "cuda" and backend == "nccl" and step else None
            if watch is not None:
                watch("error")
            try:
                loss(model, data).backward()
            finally:
                if watch is not None:
                    watch("default")
            assert sync._reduced
            for param, theirs in zip(model.parameters(), reference.parameters(), strict=True):
                assert param.grad.device == device
                if not sync.via_host:  # else the means are copied back to the device
                    assert any(inside(param.grad, b.flat) for b in sync.buckets)
                assert torch.allclose(param.grad, theirs.grad, atol=1e-6, rtol=0)
            optimizer.step()
            with torch.no_grad():
                for param, theirs in zip(model.parameters(), reference.parameters(),
                                         strict=True):
                    theirs.copy_(param)
        sync.close()
    finally:
        dist.destroy_process_group()


def test_one_rank_reduces_in_backward_into_views_of_its_buckets(tmp_path):
    one_rank_step(tmp_path, torch.device("cpu"), "gloo")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_rank_reduces_over_nccl_without_waiting_for_the_device(tmp_path):
    one_rank_step(tmp_path, torch.device("cuda", 0), "nccl")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_rank_reduces_over_gloo_through_host_buckets(tmp_path):
    """``--backend cpu`` on a GPU: the buckets are in host memory, each gradient copied there
    (and divided) before the gloo all-reduce, the means copied back to the device."""
    one_rank_step(tmp_path, torch.device("cuda", 0), "gloo")
