"""The outer optimizer (``--outer-optimizer nesterov``): a step on each average's displacement
instead of taking the average as it is, DiLoCo/SlowMo style, for cadence and async.

Between two averages every replica trains on its own; the average ``A`` of the replicas is a
point the group moved to from the last consensus ``C``. Plain averaging takes ``C := A``. The
outer optimizer reads ``C - A`` as a gradient (the *pseudo-gradient*: minus the round's mean
displacement) and steps ``C`` with SGD and Nesterov momentum::

    v := momentum x v + (C - A)
    C := C - lr x ((C - A) + momentum x v)

so a direction the group keeps moving in gathers speed across rounds, as momentum does across
steps; with ``lr = 1`` and ``momentum = 0`` it is plain averaging. DiLoCo uses ``lr = 0.7``,
``momentum = 0.9`` over hundreds of inner steps; SlowMo's rounds are shorter. The new ``C``
replaces the average before anything reads it (loading it, async's ``average - snapshot``, an
epoch's evaluation under async), so the rest of the engine is unchanged.

It acts on the parameters only (the first values of the averaging buffer): floating buffers
(BatchNorm's running statistics) are averaged as they are. Every rank holds ``C`` and ``v`` and
runs the same float32 operations on the same bits where the buffer lives (host memory for the
``cpu`` backend, the GPU for ``nccl``), so the replicas stay identical. ``C`` is the replica
after a blocking average (as built, as resumed: :meth:`OuterOptimizer.rebase`); ``v`` is this
rank's part of a checkpoint. Its memory is two copies of the parameters beside the averaging
buffer, where that buffer lives. The step is torch's own SGD (``nesterov=True``) on a flat
tensor.
"""

from __future__ import annotations

from typing import Any

import torch

from fdl.errors import UsageError


class OuterOptimizer:
    """SGD with Nesterov momentum on the consensus, one step per average."""

    def __init__(self, numel: int, *, lr: float, momentum: float, device: torch.device,
                 dtype: torch.dtype, pinned: bool = False):
        self.lr, self.momentum = lr, momentum
        self.consensus = torch.zeros(numel, dtype=dtype, device=device, pin_memory=pinned)
        self.sgd = torch.optim.SGD([self.consensus], lr=lr, momentum=momentum,
                                   nesterov=momentum > 0)
        self.steps = 0

    @torch.no_grad()
    def rebase(self, replica: torch.Tensor) -> None:
        """``C :=`` the replica's parameters (identical on every rank), momentum kept."""
        self.consensus.copy_(replica)

    @torch.no_grad()
    def step(self, average: torch.Tensor) -> None:
        """``average`` (the parameters' part of the landed average) ``:=`` the new consensus.
        The pseudo-gradient is made in ``average``'s own memory (no third copy of the
        parameters)."""
        self.consensus.grad = average.sub_(self.consensus).neg_()  # C - A
        self.sgd.step()
        self.consensus.grad = None
        average.copy_(self.consensus)
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the momentum (on the host) and the step count."""
        buffer = self.sgd.state.get(self.consensus, {}).get("momentum_buffer")
        return {"momentum_buffer": None if buffer is None else buffer.to("cpu", copy=True),
                "steps": self.steps}

    def load_state_dict(self, state: Any, *, origin: str) -> None:
        """A checkpoint's state, checked first (a rank file may be torn or hostile)."""
        buffer = state.get("momentum_buffer") if isinstance(state, dict) else None
        steps = state.get("steps") if isinstance(state, dict) else None
        fits = buffer is None or (isinstance(buffer, torch.Tensor) and buffer.is_floating_point()
                                  and buffer.shape == self.consensus.shape
                                  and bool(torch.isfinite(buffer).all()))
        if not fits or not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
            raise UsageError(f"cannot resume from {origin}: its outer optimizer state does not "
                             f"fit this run's ({self.consensus.numel()} parameters)",
                             hint="resume with the same model, or start a new run")
        if buffer is not None:
            self.sgd.state[self.consensus]["momentum_buffer"] = buffer.to(
                self.consensus.device, self.consensus.dtype)
        self.steps = steps

    def memory_bytes(self) -> int:
        """The consensus and the momentum."""
        return 2 * self.consensus.numel() * self.consensus.element_size()
