"""Mixed precision per rank: which precision each rank trains in, and the autocast context and
gradient scaler that go with it.

The ``precision`` setting (fdl.settings) is one choice for every rank (``bf16``) or one per rank
(``bf16,fp32``): :func:`precision_for_rank` picks rank r's, and :func:`resolve_precision` turns
it into what that rank's device can do:

* ``auto``: ``bf16`` on a CUDA device of compute capability 8.0 or newer (Ampere, Ada, Hopper,
  Blackwell), where bf16 tensor cores make it both faster and as stable as fp32 training
  usually needs; ``fp32`` on older CUDA devices (Pascal, Volta, Turing: no bf16 hardware, and
  fp16 needs a loss scale the user should choose knowingly) and on the CPU.
* ``bf16`` on a CUDA device older than 8.0 is refused: torch would emulate it, slower than fp32.
* ``fp16`` on the CPU is refused: few CPUs compute fp16 faster than fp32, and fp16 would bring
  its loss scaling along for nothing; bf16 is the CPU's reduced precision.

Only the forward pass (and so the backward's activations) runs in bf16/fp16, under
:func:`autocast`; parameters, gradients, optimizer state and El Che's averages stay fp32, so
ranks training in different precisions average exactly as ranks in one precision do. An fp16
rank scales its loss with its own :func:`make_scaler` (``run.scaler``): fp16's narrow range
underflows small gradients otherwise.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch

from fdl.engine.device_rules import precision_on
from fdl.settings import choice_for_rank

# What autocast runs the forward pass in; fp32 runs without autocast.
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def precision_for_rank(spec: tuple[str, ...], rank: int, world_size: int) -> str:
    """Rank ``rank``'s choice in ``spec`` (the setting's value): a single choice is every
    rank's, a list has one per rank. A list of another length than ``world_size`` is a
    UsageError naming both."""
    return choice_for_rank("precision", spec, rank, world_size)


def resolve_precision(choice: str, device: torch.device, *,
                      capability: tuple[int, int] | None = None) -> str:
    """``fp32``, ``bf16`` or ``fp16`` for ``choice`` (``auto`` or one of those) on ``device``
    (see the module docstring for the rules). ``capability`` is the CUDA device's compute
    capability, read from the device when not given. A choice the device cannot train in is a
    UsageError saying what it can (fdl.engine.device_rules: fdl run checks the same before it
    starts anything)."""
    if device.type == "cuda" and capability is None:
        capability = torch.cuda.get_device_capability(device)
    return precision_on(choice, device_type=device.type, capability=capability, device=str(device))


def autocast(device: torch.device, precision: str) -> AbstractContextManager[object]:
    """The context a rank's forward pass runs in: torch's autocast to bf16/fp16 on ``device``,
    nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


def make_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """A gradient scaler for an fp16 rank (its own: the scale follows its own gradients), None
    for bf16 and fp32, whose range needs none."""
    if precision != "fp16":
        return None
    return torch.amp.GradScaler(device.type)
