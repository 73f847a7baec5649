"""Weighted averaging of replicas across ranks: the ``cpu`` and ``nccl`` backends.

**One collective per averaging event** carries everything, in one flat buffer::

    [ w_r x theta (parameters, then floating buffers) | integer rows | stats rows ]
      numel values                                     world_size rows each

A SUM all-reduce yields the weighted average ``sum_r w_r theta_r`` (the weights the plan
gives, summing to 1: uniform, see fdl.engine.plan.RoundPlan.weights) and, because rank r fills
only its own row of the two row blocks and leaves the others zero, every rank's integer buffers
and timing stats, identical on every rank — so every rank plans the next round alike. Integer
buffers (BatchNorm's ``num_batches_tracked``) take the maximum over ranks, computed locally from
those rows rather than by a MAX all-reduce of their own, which would add a blocking round trip
per integer buffer (19 per average for ResNet-20).

**Exact in the model's dtype.** The buffer is float64 when any averaged tensor is float64,
otherwise float32: a float64 model is averaged in float64, not truncated to float32 at every
average. Integer values travel exactly: in a float64 buffer directly (``|v| <= 2**53``), in a
float32 one split into two 24-bit halves (``|v| <= 2**48``). A larger value is refused with an
:class:`~fdl.errors.FdlError` naming the buffer — at construction, and at every ``pack`` when
the buffer is in host memory (on the GPU that check would stall the stream each average).

**bf16/fp16 keep their small updates.** Rounding ``theta + (average - snapshot)`` to bf16 drops
any delta under half an ulp of theta, so async averaging would silently stop moving a
low-precision model. Each bf16/fp16 tensor keeps a float32 residual (error feedback): the
replica's exact value is ``theta + residual``; that is what ``pack`` sends, and an update
computes ``exact = theta + delta + residual``, stores ``theta = exact`` rounded and keeps
``residual = exact - theta``. A blocking average stores the rounding of the average the same
way (identical on every rank). Whoever overwrites theta from outside (a checkpoint restore)
leaves a stale residual of at most half an ulp.

**bf16, int8 or int4 on the wire** (``--average-dtype bf16|int8|int4``, for a slow link): the
parameters travel as displacements from the last average, in bf16 (half the bytes), int8 (a
quarter) or int4 (an eighth), the integer codes with a float32 scale per ``WIRE_BLOCK`` values
(fdl.engine.wire). A gather sends ``(k - 1) x`` the buffer per rank, a float32 ring all-reduce
``2 (k - 1) / k x 4`` bytes a value: with 2 ranks bf16 sends half of it, int8 a quarter and
int4 an eighth; none are saved from 4 ranks (bf16), 8 (int8) or 16 (int4).
Every rank keeps that average, the *reference* R (float32, identical everywhere: the same
bits), and sends ``q_r = encode(w_r (theta_r - R) + e_r)``, keeping ``e_r`` (float32), what the
encoding dropped, for its next average (error feedback: nothing is lost, it arrives one average
late). bf16 rounds each value; int8 scales each block by ``s = absmax / 127`` (int4: / 7)
and sends ``round(x / s)`` (a block of zeros: scale 0, codes 0), its codes and scales packed in
one uint8 buffer. The ``q_r`` are gathered, not all-reduced: a bf16 SUM rounds to bf16 at every
add, an error no rank could carry (and int8 codes with different scales do not add). Their
decoded float32 sum (in rank order: the same bits everywhere) plus R is the average (the weights
sum to 1), landed in the float32 buffer, so what follows (loading it, async's delta, the
divergence guard) is unchanged, and R becomes it. A non-finite displacement (a replica blew up)
lands non-finite: bf16 carries inf and NaN, int8/int4 make the block's scale inf or NaN, so the
landed block is NaN and the divergence guard sees it. A displacement is small beside the
parameters, so bf16's 8 bits of mantissa, or int8's 127 steps of a block's largest value, cost
little of it (int4's 7 steps more: what they drop is fed back, not lost); the parameters
themselves in bf16 would lose the small updates. The integer and stats rows go in a float32
collective of their own, beside. The reference is the model as built (after rank 0's broadcast)
and is taken again from the model where it was overwritten whole (a resume:
:meth:`Averager.rebase`).

**The outer optimizer** (``--outer-optimizer nesterov``, fdl.engine.outer) steps the
parameters' part of a landed average (:meth:`Averager.step_outer`) after the divergence guard
measured it and before anything loads it: what a blocking average loads, what async's
``average - snapshot`` applies and what its epoch's end evaluates is then the stepped consensus.

* ``cpu``: the flat buffer lives in host memory (page-locked for a CUDA replica: the copies go
  by DMA, and none of fdl's averaging memory is on the card) and is reduced over a gloo group.
  Copies into and out of it are blocking: a non-blocking one would let a device-to-host copy be
  read before it completes, or a host-to-device copy still be pending when the next snapshot is
  taken. Two ranks (a box's two devices, or two nodes) reduce a blocking average by exchanging
  the buffers instead: each sends its own and adds the other's (in messages of at most
  ``EXCHANGE_FLOATS`` values, two received ahead, their receives posted before the sends).
  ``a + b == b + a`` in IEEE arithmetic, so both hold the same bits, as after the all-reduce,
  and the same bytes cross the link, where the exchange waits less than gloo's all-reduce of the
  same buffer, and less often long (docs/elche.md, "Measurements behind the engine's choices").
* ``nccl``: the flat buffer lives on the GPU and is reduced by NCCL.

``group`` (a ``ProcessGroup``, default the default group) carries every collective; ``rank``
and ``world_size`` are then this process's rank in it and its size. After a blocking average
every replica holds exactly the reduced bits (``checksum`` proves it).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from fdl.engine.int_rows import IntegerRows
from fdl.engine.outer import OuterOptimizer
from fdl.engine.wire import WIRE_ENCODINGS, EncodedWire

#: dtypes whose updates keep a float32 residual (their ulp swallows small deltas)
LOW_PRECISION = (torch.bfloat16, torch.float16)
#: the most values in one message of the two-rank exchange (4 MiB of float32): the size of each
#: of its two receive buffers, whatever the model's
EXCHANGE_FLOATS = 1 << 20


def tensor_count(model: nn.Module) -> tuple[int, int]:
    """How many parameter tensors and floating-point buffers ``model`` holds."""
    return (sum(1 for _ in model.parameters()),
            sum(1 for b in model.buffers() if b.is_floating_point()))


class Averager:
    """The flat buffers of one model replica and the collective over them."""

    def __init__(self, model: nn.Module, *, rank: int, world_size: int, backend: str,
                 device: torch.device, num_stats: int, params: bool = True,
                 snapshot: bool = True, group: dist.ProcessGroup | None = None,
                 wire: str = "fp32", outer: tuple[float, float] | None = None):
        """``params=False`` averages buffers only (``sync``: DDP keeps parameters identical,
        and re-averaging identical values could change their last bits). ``snapshot=False``
        (every policy but async, which applies ``average - snapshot`` a round late) keeps no
        copy of the packed replica: its buffer's memory is not allocated. ``wire="bf16"``,
        ``"int8"`` or ``"int4"`` sends the parameters as encoded displacements (the module
        docstring); ``outer`` (its learning rate and momentum) steps the parameters' average
        with the outer optimizer (fdl.engine.outer). With either, the replicas must be
        identical when it is built."""
        self.rank, self.world_size, self.num_stats, self.group = rank, world_size, num_stats, group
        self.tensors = ([p.data for p in model.parameters()] if params else []) + [
            b for b in model.buffers() if b.is_floating_point()]
        self.numel = sum(t.numel() for t in self.tensors)
        self.counted = tensor_count(model)  # what the replica held when training started
        self.param_numel = sum(p.numel() for p in model.parameters()) if params else 0
        self.via_host = backend != "nccl"
        buffer_device = device if backend == "nccl" else torch.device("cpu")
        dtype = torch.float64 if any(t.dtype == torch.float64 for t in self.tensors) \
            else torch.float32
        self.ints = IntegerRows.of(model, dtype=dtype)
        self.stats_offset = self.numel + world_size * self.ints.row_size
        # a CUDA replica averaged over the host: page-locked buffers, so the copies in and out
        # go straight by DMA (and fdl's buffers stay off a card that is short of memory)
        pinned = self.via_host and device.type == "cuda"
        self.flat = torch.zeros(self.stats_offset + world_size * num_stats, dtype=dtype,
                                device=buffer_device, pin_memory=pinned)
        self.snapshot = torch.zeros(self.numel, dtype=dtype, device=buffer_device,
                                    pin_memory=pinned) if snapshot else None
        self.residuals = [torch.zeros_like(t, dtype=torch.float32)
                          if t.dtype in LOW_PRECISION else None for t in self.tensors]
        assert wire == "fp32" or wire in WIRE_ENCODINGS, wire
        self.wire = EncodedWire(wire, self.numel, world_size=world_size, device=buffer_device,
                                pinned=pinned) \
            if wire in WIRE_ENCODINGS and params and self.numel and dtype == torch.float32 \
            else None
        # two ranks over the host: a blocking average is an exchange (the module docstring)
        self.received = [torch.empty(min(EXCHANGE_FLOATS, self.flat.numel()), dtype=dtype)
                         for _ in range(2)] \
            if self.via_host and world_size == 2 and self.wire is None else []
        self.outer = OuterOptimizer(self.param_numel, lr=outer[0], momentum=outer[1],
                                    device=buffer_device, dtype=dtype, pinned=pinned) \
            if outer is not None and self.param_numel else None
        self.rebase()
        self.bytes = self.flat.numel() * self.flat.element_size() if self.wire is None else (
            self.wire.nbytes + (self.flat.numel() - self.numel) * self.flat.element_size())
        self.ints.check(self.ints.values(torch.device("cpu")), dtype=dtype)

    def check_unchanged(self, model: nn.Module) -> None:
        """UsageError when ``model`` holds parameters or buffers it did not hold when this
        averager was built (a module added after training started): they would never be
        averaged, and each rank's copy would drift apart, silently."""
        from fdl.errors import UsageError

        now = tensor_count(model)
        if now != self.counted:
            raise UsageError(
                f"the model changed during training: it holds {now[0]} parameter and {now[1]} "
                f"buffer tensors, {self.counted[0]} and {self.counted[1]} when run.batches "
                f"started; fdl averages what the model held then, so the rest would drift "
                f"apart on each rank", hint="build the whole model (every module it will use) "
                                            "before run.batches(...)")

    @torch.no_grad()
    def rebase(self) -> None:
        """The replica as it is (identical on every rank: as built, or as a checkpoint loaded
        it) is the last average: the wire's reference (nothing owed), the outer
        optimizer's consensus (its momentum kept)."""
        if self.wire is not None:
            self._copy_replica(self.wire.reference)
            self.wire.error.zero_()
        if self.outer is not None:
            self._copy_replica(self.outer.consensus)

    @torch.no_grad()
    def step_outer(self) -> None:
        """The outer optimizer's step on the landed average's parameters (nothing without
        one): call after the divergence guard measured the plain average, before anything
        loads it. The wire's reference follows the consensus."""
        if self.outer is None:
            return
        body = self.flat[:self.param_numel]
        self.outer.step(body)
        if self.wire is not None:
            self.wire.reference[:self.param_numel].copy_(body)

    def _copy_replica(self, target: torch.Tensor) -> None:
        """The replica's exact values (``theta + residual`` for bf16/fp16) into ``target``'s
        first values, tensor after tensor until ``target`` is full (blocking copies: complete
        before ``target`` is read)."""
        offset = 0
        for tensor, residual in zip(self.tensors, self.residuals, strict=True):
            count = tensor.numel()
            if offset + count > target.numel():
                break
            exact = tensor if residual is None else tensor.float() + residual
            target[offset:offset + count].copy_(exact.reshape(-1))
            offset += count

    @torch.no_grad()
    def pack(self, *, weight: float, stats: Sequence[float], keep_snapshot: bool) -> None:
        """Fill the buffer with ``weight x theta`` (on the wire: its encoded displacement),
        this rank's integer row and stats row."""
        self._copy_replica(self.flat)
        if keep_snapshot and self.snapshot is not None:
            self.snapshot.copy_(self.flat[:self.numel])
        if self.wire is None:
            self.flat[:self.numel].mul_(weight)
        else:
            self.wire.pack(self.flat[:self.numel], weight=weight)
        self.flat[self.numel:].zero_()
        self.ints.pack(self.flat[self.numel:self.stats_offset], rank=self.rank)
        row = self.stats_offset + self.rank * self.num_stats
        self.flat[row:row + self.num_stats] = torch.tensor(list(stats), dtype=self.flat.dtype)

    def all_reduce(self, *, async_op: bool) -> dist.Work | _WireAverage | None:
        """The average's collective: a SUM over ``group`` (encoded on the wire: two, a gather
        of the encoded displacements and the SUM of the float32 rows, landed as the average
        when waited for)."""
        if self.wire is None:
            if self.received and not async_op:
                self._exchange()
                return None
            return dist.all_reduce(self.flat, op=dist.ReduceOp.SUM, group=self.group,
                                   async_op=async_op)
        works = [dist.all_gather(self.wire.gathered, self.wire.sent, group=self.group,
                                 async_op=True)]
        if self.flat.numel() > self.numel:
            works.append(dist.all_reduce(self.flat[self.numel:], op=dist.ReduceOp.SUM,
                                         group=self.group, async_op=True))
        pending = _WireAverage(self, works)
        if async_op:
            return pending
        pending.wait()
        return None

    @torch.no_grad()
    def _exchange(self) -> None:
        """The SUM of two ranks' buffers, blocking: the other's first two messages awaited in
        the two buffers, then every message of this rank's sent at once, each received message
        added where it was sent from once that send completed, its buffer then awaiting the
        message after next. The receives go first: posted after the sends, each rank's large
        send goes out while the other's waits, and on a capped link the exchange then costs far
        more than gloo's all-reduce (docs/elche.md, "Measurements behind the engine's
        choices")."""
        peer = 1 - self.rank
        if self.group is not None:
            peer = dist.get_global_rank(self.group, peer)
        size, total = self.received[0].numel(), self.flat.numel()
        lows = range(0, total, size)

        def receive(index: int) -> tuple[torch.Tensor, dist.Work]:
            part = self.received[index % 2][:min(size, total - index * size)]
            return part, dist.irecv(part, src=peer, group=self.group)

        pending = [receive(index) for index in range(min(2, len(lows)))]
        sends = [dist.isend(self.flat[low:low + size], dst=peer, group=self.group)
                 for low in lows]
        for index, low in enumerate(lows):
            part, work = pending[index % 2]
            work.wait()
            sends[index].wait()
            self.flat[low:low + part.numel()].add_(part)
            if index + 2 < len(lows):
                pending[index % 2] = receive(index + 2)

    def stats(self) -> list[list[float]]:
        """Every rank's stats row, after the reduction completed."""
        block = self.flat[self.stats_offset:].view(self.world_size, self.num_stats)
        return block.cpu().tolist()

    @torch.no_grad()
    def load_average(self) -> None:
        """theta := the reduced average (blocking copies), and integer buffers := their max
        over ranks, taken locally from the reduced integer rows."""
        offset = 0
        for tensor, residual in zip(self.tensors, self.residuals, strict=True):
            count = tensor.numel()
            average = self.flat[offset:offset + count].view_as(tensor)
            if residual is None:
                tensor.copy_(average)
            else:
                _store_rounded(tensor, residual, average.to(tensor.device, torch.float32))
            offset += count
        self.ints.load_max(self.flat[self.numel:self.stats_offset], world_size=self.world_size)

    @contextlib.contextmanager
    def average_loaded(self) -> Iterator[None]:
        """The landed average in the replica for the body (async's epoch end evaluates the
        consensus), and afterwards the replica as it was, bit for bit (its tensors, bf16/fp16
        residuals and integer buffers, kept in host memory meanwhile: once an epoch, off a
        card that may be short of memory)."""
        with torch.no_grad():
            kept = [t.to("cpu", copy=True) for t in (*self.tensors, *self.ints.tensors)]
            residuals = [r.to("cpu", copy=True) if r is not None else None
                         for r in self.residuals]
            self.load_average()
        try:
            yield
        finally:
            with torch.no_grad():
                for tensor, value in zip((*self.tensors, *self.ints.tensors), kept,
                                         strict=True):
                    tensor.copy_(value)
                for residual, value in zip(self.residuals, residuals, strict=True):
                    if residual is not None:
                        residual.copy_(value)

    @torch.no_grad()
    def apply_delta(self) -> None:
        """Async: theta += average - snapshot, keeping the local progress made meanwhile (and,
        for bf16/fp16, the part of the delta that rounding would drop)."""
        assert self.snapshot is not None, "apply_delta needs the Averager's snapshot"
        delta = self.flat[:self.numel] - self.snapshot
        offset = 0
        for tensor, residual in zip(self.tensors, self.residuals, strict=True):
            count = tensor.numel()
            part = delta[offset:offset + count].view_as(tensor)
            if residual is None:
                tensor.add_(part.to(tensor.device, tensor.dtype))
            else:
                exact = tensor.float() + (part.to(tensor.device, torch.float32) + residual)
                _store_rounded(tensor, residual, exact)
            offset += count

    @torch.no_grad()
    def distance_from_average(self) -> float:
        """||replica - average|| / ||average||: how far this replica had drifted when it was
        packed (the divergence guard's measure): from the snapshot, or without one from the
        replica's tensors, which a blocking average has not overwritten yet. Call after the
        reduction completed (and, without a snapshot, before :meth:`load_average`)."""
        average = self.flat[:self.numel]
        norm = float(torch.linalg.vector_norm(average))
        if norm == 0:
            return 0.0
        # A NaN or infinite average (a replica blew up) reads as NaN: divergence, not calm.
        if self.snapshot is not None:
            return float(torch.dist(self.snapshot, average)) / norm
        # one norm kernel per tensor, summed where the tensors live and read once per device:
        # a float() per tensor would wait for the device at every tensor (a CUDA replica's
        # dozens of parameters), and subtracting then squaring would write two full-size
        # temporaries
        squares: dict[torch.device, torch.Tensor] = {}
        offset = 0
        for tensor, residual in zip(self.tensors, self.residuals, strict=True):
            count = tensor.numel()
            exact = tensor if residual is None else tensor.float() + residual
            part = average[offset:offset + count].to(tensor.device)
            square = torch.dist(exact.reshape(-1).to(part.dtype), part).square()
            squares[part.device] = squares.get(part.device, 0) + square
            offset += count
        return sum(float(total) for total in squares.values()) ** 0.5 / norm

    def memory_bytes(self) -> tuple[int, int]:
        """fdl's own memory for this replica, (on the model's device, in host memory): the
        flat buffer, the snapshot, the bf16/fp16 residuals, the wire's reference, encoded
        buffer, error fed back and every rank's gathered buffer, the two-rank exchange's
        receive buffers, and the outer optimizer's consensus and momentum."""
        on_device = on_host = 0
        wire = self.wire.tensors() if self.wire is not None else []
        for tensor in (self.flat, self.snapshot, *self.residuals, *wire, *self.received):
            if tensor is None:
                continue
            size = tensor.numel() * tensor.element_size()
            if tensor.device.type == "cpu":
                on_host += size
            else:
                on_device += size
        if self.outer is not None:
            if self.flat.device.type == "cpu":
                on_host += self.outer.memory_bytes()
            else:
                on_device += self.outer.memory_bytes()
        return on_device, on_host


class _WireAverage:
    """Encoded on the wire: the collectives of one average in flight; :meth:`wait` waits for
    them and lands the average (a ``dist.Work`` to its callers)."""

    def __init__(self, averager: Averager, works: list[dist.Work]):
        self.averager, self.works = averager, works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        averager = self.averager
        assert averager.wire is not None
        averager.wire.land(averager.flat[:averager.numel])
        return True


def _store_rounded(tensor: torch.Tensor, residual: torch.Tensor, exact: torch.Tensor) -> None:
    """tensor := exact rounded to its dtype; residual := what the rounding dropped."""
    tensor.copy_(exact)
    residual.copy_(exact - tensor.float())


def checksum(model: nn.Module) -> str:
    """sha256 over every parameter and buffer's bytes: equal strings = bitwise equal replicas."""
    digest = hashlib.sha256()
    for tensor in [*model.parameters(), *model.buffers()]:
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]
