"""How ``--average-dtype bf16|int8|int4`` encodes a rank's displacement for the wire
(fdl.engine.averaging sends it, gathers every rank's and lands their decoded sum).

Each encoding takes the float32 values to send (the displacement plus the error fed back),
writes what goes on the wire, and leaves in the values exactly what the decoder will not add
back: the error the next average carries. ``bf16`` rounds each value (2 bytes); ``int8`` sends
blocks of :data:`WIRE_BLOCK` values as int8 codes of ``round(x / s)``, ``s = absmax / 127``,
with the block's float32 scale (1 + 4 / WIRE_BLOCK bytes a value); ``int4`` the same with
codes in ``[-7, 7]``, two a byte (0.5 + 4 / WIRE_BLOCK).
"""

from __future__ import annotations

from functools import partial

import torch

#: values per float32 scale with ``--average-dtype int8|int4`` (the scales cost 4 / WIRE_BLOCK
#: bytes a value; a smaller block follows an uneven displacement more closely)
WIRE_BLOCK = 1024


class Bf16Wire:
    """bf16 on the wire: each value rounded, 2 bytes a value."""

    def __init__(self, numel: int):
        self.padded_numel = numel
        self.nbytes = 2 * numel  # what goes on the wire

    def empty(self, *, device: torch.device, pinned: bool) -> torch.Tensor:
        return torch.zeros(self.padded_numel, dtype=torch.bfloat16, device=device,
                           pin_memory=pinned)

    def encode(self, values: torch.Tensor, sent: torch.Tensor) -> None:
        """sent := values rounded to bf16; values := what the rounding dropped."""
        sent.copy_(values)
        values.sub_(sent.to(values.dtype))

    def add_decoded(self, target: torch.Tensor, sent: torch.Tensor) -> None:
        target.add_(sent.to(target.dtype))


class BlockWire:
    """int8 or int4 on the wire: blocks of :data:`WIRE_BLOCK` values, each sent as integer codes
    in ``[-levels, levels]`` (127 for int8, 7 for int4, two codes a byte) and one float32
    scale, in one uint8 buffer ``[codes, padded to whole blocks | scales]`` (one gather; the
    padding's codes are 0)."""

    def __init__(self, numel: int, *, bits: int):
        self.levels, self.per_byte = 2 ** (bits - 1) - 1, 8 // bits
        self.num_blocks = -(-numel // WIRE_BLOCK)
        self.padded_numel = self.num_blocks * WIRE_BLOCK
        self.code_bytes = self.padded_numel // self.per_byte
        self.nbytes = self.code_bytes + 4 * self.num_blocks  # what goes on the wire

    def empty(self, *, device: torch.device, pinned: bool) -> torch.Tensor:
        return torch.zeros(self.nbytes, dtype=torch.uint8, device=device, pin_memory=pinned)

    def scales(self, sent: torch.Tensor) -> torch.Tensor:
        """The scales (num_blocks, 1): a view of sent."""
        return sent[self.code_bytes:].view(torch.float32).view(self.num_blocks, 1)

    def codes(self, sent: torch.Tensor) -> torch.Tensor:
        """The codes (num_blocks, WIRE_BLOCK), int8: a view of sent's (int8), or unpacked from
        its nibbles (int4: the low nibble first, each stored as code + 8)."""
        packed = sent[:self.code_bytes]
        if self.per_byte == 1:
            return packed.view(torch.int8).view(self.num_blocks, WIRE_BLOCK)
        nibbles = torch.stack([packed & 15, packed >> 4], dim=1).to(torch.int8) - 8
        return nibbles.view(self.num_blocks, WIRE_BLOCK)

    def encode(self, values: torch.Tensor, sent: torch.Tensor) -> None:
        """sent := values' codes and scales; values := what the codes dropped (padded_numel
        values, the padding zero). A block holding inf or NaN gets an inf or NaN scale, so it
        decodes to NaN: a blown-up replica is never sent as finite codes."""
        blocks = values.view(self.num_blocks, WIRE_BLOCK)
        scales = self.scales(sent)
        torch.div(blocks.abs().amax(dim=1, keepdim=True), self.levels, out=scales)
        # 0 / 0 (a block of zeros, scale 0) and x / inf or NaN: code 0, the scale says the rest
        quantized = (blocks / scales).round_().clamp_(-self.levels, self.levels) \
            .nan_to_num_(0.0)
        packed = sent[:self.code_bytes]
        if self.per_byte == 1:
            packed.view(torch.int8).copy_(quantized.view(-1))
        else:
            pairs = (quantized.view(-1, 2) + 8).to(torch.uint8)
            torch.bitwise_or(pairs[:, 0], pairs[:, 1] << 4, out=packed)
        blocks.sub_(quantized.mul_(scales))  # exactly what add_decoded adds

    def add_decoded(self, target: torch.Tensor, sent: torch.Tensor) -> None:
        decoded = self.codes(sent).to(target.dtype) * self.scales(sent)
        target.add_(decoded.view(-1)[:target.numel()])


def value_bytes(average_dtype: str) -> float:
    """What an average sends per parameter with ``--average-dtype`` (the codes and their share
    of a block's scale: an encoding's bytes for one whole block; the simulator's and
    bench-lan's link model)."""
    if average_dtype == "fp32":
        return 4.0
    return WIRE_ENCODINGS[average_dtype](WIRE_BLOCK).nbytes / WIRE_BLOCK


#: --average-dtype's encodings on the wire (fp32 sends the flat buffer itself)
WIRE_ENCODINGS = {"bf16": Bf16Wire, "int8": partial(BlockWire, bits=8),
                  "int4": partial(BlockWire, bits=4)}


class EncodedWire:
    """One replica's averages sent encoded (fdl.engine.averaging's module docstring): the
    reference R (the last average, float32, the same bits on every rank), the buffer sent, the
    error fed back (padded to the encoding's whole blocks) and every rank's gathered buffer,
    decoded and summed here in float32 (gloo would round a bf16 sum to bf16 at every add: an
    error no rank could carry)."""

    def __init__(self, name: str, numel: int, *, world_size: int, device: torch.device,
                 pinned: bool) -> None:
        self.encoding = WIRE_ENCODINGS[name](numel)
        self.numel = numel
        self.reference = torch.zeros(numel, dtype=torch.float32, device=device,
                                     pin_memory=pinned)
        self.sent = self.encoding.empty(device=device, pinned=pinned)
        self.error = torch.zeros(self.encoding.padded_numel, dtype=torch.float32, device=device)
        self.gathered = [torch.zeros_like(self.sent) for _ in range(world_size)]

    @property
    def nbytes(self) -> int:
        """What one average sends of the parameters."""
        return self.sent.numel() * self.sent.element_size()

    def tensors(self) -> list[torch.Tensor]:
        return [self.reference, self.sent, self.error, *self.gathered]

    def pack(self, body: torch.Tensor, *, weight: float) -> None:
        """``sent := encode(w (theta - R) + e)``, ``e :=`` what it dropped; ``body`` holds
        theta and is left holding ``w (theta - R)``. Not ``w theta - w R``: a replica that did
        not move sends exactly zero, and no rounding of ``w theta`` (beyond the error fed
        back) reaches the average."""
        body.sub_(self.reference).mul_(weight)
        self.error[:self.numel].add_(body)
        self.encoding.encode(self.error, self.sent)

    def land(self, body: torch.Tensor) -> None:
        """``body := R +`` every rank's decoded displacement, summed in float32 in rank order
        (the same bits on every rank): the average; ``R :=`` it."""
        body.copy_(self.reference)
        for displacement in self.gathered:
            self.encoding.add_decoded(body, displacement)
        self.reference.copy_(body)
