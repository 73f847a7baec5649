"""A model's integer buffers (BatchNorm's ``num_batches_tracked``) in an average: each rank
fills its own row of a block of the averaging buffer, the SUM all-reduce gives every rank every
row, and each buffer takes the maximum over the ranks, computed locally from the rows (no
collective of its own, which would be one blocking round trip per integer buffer).

The values travel exactly: in a float64 buffer directly (``|v| <= 2**53``), in a float32 one
split into two 24-bit halves (``|v| <= 2**48``). A larger value is an
:class:`~fdl.errors.FdlError` naming the buffer, checked where the values are in host memory
(on the GPU the check would stall the stream at every average).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fdl.errors import FdlError

#: the largest |integer| each buffer dtype carries exactly (float32: two 24-bit halves)
INTEGER_LIMITS = {torch.float32: 2**48, torch.float64: 2**53}
HALF_BITS = 24


@dataclass(eq=False)
class IntegerRows:
    """The integer buffers of one model and how they ride in a buffer of ``dtype``."""

    names: list[str]
    tensors: list[torch.Tensor]
    dtype: torch.dtype

    @classmethod
    def of(cls, model: nn.Module, *, dtype: torch.dtype) -> IntegerRows:
        named = [(name, b) for name, b in model.named_buffers() if not b.is_floating_point()]
        return cls([name for name, _ in named], [b for _, b in named], dtype)

    @property
    def numel(self) -> int:
        return sum(t.numel() for t in self.tensors)

    @property
    def parts(self) -> int:
        """Floats per value: 1 in float64, 2 (high and low halves) in float32."""
        return 1 if self.dtype == torch.float64 else 2

    @property
    def row_size(self) -> int:
        """One rank's row: its values, as :attr:`parts` floats each."""
        return self.parts * self.numel

    def values(self, device: torch.device) -> torch.Tensor:
        """Every integer buffer, flattened into one int64 tensor on ``device`` (blocking)."""
        if not self.tensors:
            return torch.zeros(0, dtype=torch.int64, device=device)
        return torch.cat([t.reshape(-1).to(device, torch.int64) for t in self.tensors])

    def check(self, values: torch.Tensor, *, dtype: torch.dtype) -> None:
        """Refuse integer values a buffer of ``dtype`` cannot carry exactly (host tensors)."""
        limit = INTEGER_LIMITS[dtype]
        offset = 0
        for name, tensor in zip(self.names, self.tensors, strict=True):
            part = values[offset:offset + tensor.numel()]
            offset += tensor.numel()
            if part.numel() and int(part.abs().max()) > limit:
                raise FdlError(
                    f"integer buffer {name!r} holds {int(part.abs().max())}, beyond what "
                    f"averaging in {str(dtype).removeprefix('torch.')} carries "
                    f"exactly (|value| <= 2**{limit.bit_length() - 1})",
                    hint="keep integer buffers smaller, or store the count as a float buffer")

    def pack(self, block: torch.Tensor, *, rank: int) -> None:
        """This rank's row into ``block`` (the buffer's integer block, zeroed)."""
        if not self.tensors:
            return
        values = self.values(block.device)
        if values.device.type == "cpu":
            self.check(values, dtype=self.dtype)
        row = rank * self.row_size
        block[row:row + self.row_size].copy_(_encode(values, parts=self.parts))

    def load_max(self, block: torch.Tensor, *, world_size: int) -> None:
        """Each buffer := its maximum over the ranks' rows of the reduced ``block``."""
        if not self.tensors:
            return
        maximum = _decode(block.view(world_size, self.parts, self.numel)).amax(dim=0)
        offset = 0
        for tensor in self.tensors:
            count = tensor.numel()
            tensor.copy_(maximum[offset:offset + count].view_as(tensor))
            offset += count


def _encode(values: torch.Tensor, *, parts: int) -> torch.Tensor:
    """int64 values as ``parts`` rows of exactly representable floats, flattened: the values
    themselves (float64), or high and low 24-bit halves (float32; floor division keeps the
    low half in [0, 2**24) and the high half signed)."""
    if parts == 1:
        return values.to(torch.float64)
    high = torch.div(values, 2**HALF_BITS, rounding_mode="floor")
    low = values - high * 2**HALF_BITS
    return torch.cat([high, low]).to(torch.float32)


def _decode(rows: torch.Tensor) -> torch.Tensor:
    """(world_size, parts, n) reduced rows -> (world_size, n) int64 values."""
    if rows.shape[1] == 1:
        return rows[:, 0].to(torch.int64)
    return rows[:, 0].to(torch.int64) * 2**HALF_BITS + rows[:, 1].to(torch.int64)
