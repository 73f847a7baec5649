"""How ``--average-dtype bf16|int8`` encodes a rank's displacement for the wire
(fdl.engine.averaging sends it, gathers every rank's and lands their decoded sum).

Each encoding takes the float32 values to send (the displacement plus the error fed back),
writes what goes on the wire, and leaves in the values exactly what the decoder will not add
back: the error the next average carries. ``bf16`` rounds each value (2 bytes); ``int8`` sends
blocks of :data:`WIRE_BLOCK` values as int8 codes of ``round(x / s)``, ``s = absmax / 127``,
with the block's float32 scale (1 + 4 / WIRE_BLOCK bytes a value).
"""

from __future__ import annotations

import torch

#: values per float32 scale with ``--average-dtype int8`` (the scales cost 4 / WIRE_BLOCK bytes a
#: value; a smaller block follows an uneven displacement more closely)
WIRE_BLOCK = 1024
INT8_MAX = 127


class Bf16Wire:
    """bf16 on the wire: each value rounded, 2 bytes a value."""

    def __init__(self, numel: int):
        self.padded_numel = numel

    def empty(self, *, device: torch.device, pinned: bool) -> torch.Tensor:
        return torch.zeros(self.padded_numel, dtype=torch.bfloat16, device=device,
                           pin_memory=pinned)

    def encode(self, values: torch.Tensor, sent: torch.Tensor) -> None:
        """sent := values rounded to bf16; values := what the rounding dropped."""
        sent.copy_(values)
        values.sub_(sent.to(values.dtype))

    def add_decoded(self, target: torch.Tensor, sent: torch.Tensor) -> None:
        target.add_(sent.to(target.dtype))


class Int8Wire:
    """int8 on the wire: blocks of :data:`WIRE_BLOCK` values, each sent as int8 codes and one
    float32 scale, in one uint8 buffer ``[codes, padded to whole blocks | scales]`` (one
    gather; the padding's codes are 0, at most ``WIRE_BLOCK - 1`` bytes)."""

    def __init__(self, numel: int):
        self.num_blocks = -(-numel // WIRE_BLOCK)
        self.padded_numel = self.num_blocks * WIRE_BLOCK

    def empty(self, *, device: torch.device, pinned: bool) -> torch.Tensor:
        return torch.zeros(self.padded_numel + 4 * self.num_blocks, dtype=torch.uint8,
                           device=device, pin_memory=pinned)

    def codes_and_scales(self, sent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes (num_blocks, WIRE_BLOCK) and the scales (num_blocks, 1): views of sent."""
        codes = sent[:self.padded_numel].view(torch.int8).view(self.num_blocks, WIRE_BLOCK)
        return codes, sent[self.padded_numel:].view(torch.float32).view(self.num_blocks, 1)

    def encode(self, values: torch.Tensor, sent: torch.Tensor) -> None:
        """sent := values' codes and scales; values := what the codes dropped (padded_numel
        values, the padding zero). A block holding inf or NaN gets an inf or NaN scale, so it
        decodes to NaN: a blown-up replica is never sent as finite codes."""
        blocks = values.view(self.num_blocks, WIRE_BLOCK)
        codes, scales = self.codes_and_scales(sent)
        torch.div(blocks.abs().amax(dim=1, keepdim=True), INT8_MAX, out=scales)
        # 0 / 0 (a block of zeros, scale 0) and x / inf or NaN: code 0, the scale says the rest
        quantized = (blocks / scales).round_().clamp_(-INT8_MAX, INT8_MAX).nan_to_num_(0.0)
        codes.copy_(quantized)
        blocks.sub_(quantized.mul_(scales))  # exactly what add_decoded adds

    def add_decoded(self, target: torch.Tensor, sent: torch.Tensor) -> None:
        codes, scales = self.codes_and_scales(sent)
        target.add_((codes.to(target.dtype) * scales).view(-1)[:target.numel()])


#: --average-dtype's encodings on the wire (fp32 sends the flat buffer itself)
WIRE_ENCODINGS = {"bf16": Bf16Wire, "int8": Int8Wire}
