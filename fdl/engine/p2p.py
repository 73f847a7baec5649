"""NCCL's peer-to-peer transport on the GPUs of one node: whether each pair can use it, and what
``NCCL_P2P_DISABLE`` a worker should run with.

Two GeForce cards in one box often lack working peer access (no NVLink, a PCIe topology or a
driver that does not allow it); NCCL then may hang or copy wrongly through P2P, and people set
``NCCL_P2P_DISABLE=1`` by folklore. fdl asks the driver (``torch.cuda.can_device_access_peer``,
both ways for each pair of the node's training GPUs) and turns NCCL's P2P off where a pair
lacks it; NCCL then goes through host memory (its SHM transport). A user's own
``NCCL_P2P_DISABLE`` (0 or 1) always wins: that is how to force either way.

Pure but for :func:`peer_pairs`' ``can_access``, which the caller supplies (torch's, in a
worker and in ``fdl diagnose``'s probe; a fake in tests)::

    >>> missing = missing_pairs(peer_pairs([0, 1], lambda i, j: False))
    >>> p2p_choice(missing, env={})
    P2PChoice(value='1', source='fdl', missing=((0, 1),), reason='no peer access between cuda:0 and cuda:1')
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Any

P2P_ENV = "NCCL_P2P_DISABLE"


def peer_pairs(devices: Sequence[int],
               can_access: Callable[[int, int], bool]) -> list[tuple[int, int, bool]]:
    """``(i, j, ok)`` for every unordered pair ``i < j`` of ``devices`` (CUDA indices as this
    process sees them): ``ok`` when each can access the other's memory. A query that raises
    counts as no access."""
    pairs = []
    for i, j in combinations(sorted(set(devices)), 2):
        pairs.append((i, j, _asks(can_access, i, j) and _asks(can_access, j, i)))
    return pairs


def _asks(can_access: Callable[[int, int], bool], i: int, j: int) -> bool:
    try:
        return bool(can_access(i, j))
    except Exception:  # a driver that cannot answer gives no peer access either
        return False


def missing_pairs(pairs: Iterable[tuple[int, int, bool]]) -> tuple[tuple[int, int], ...]:
    """The pairs of :func:`peer_pairs` without peer access."""
    return tuple((i, j) for i, j, ok in pairs if not ok)


@dataclass(frozen=True)
class P2PChoice:
    """What ``NCCL_P2P_DISABLE`` a worker runs with: ``value`` (None: left unset, NCCL's own
    choice), who chose it (``user``: it was in the environment; ``fdl``: from the peer check)
    and why, in words."""

    value: str | None
    source: str
    missing: tuple[tuple[int, int], ...]
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"env": self.value, "source": self.source,
                "missing": [list(pair) for pair in self.missing], "reason": self.reason}


def p2p_choice(missing: Sequence[tuple[int, int]], *, env: Mapping[str, str],
               checked: bool = True) -> P2PChoice:
    """``NCCL_P2P_DISABLE`` for this node's workers: the user's value when set; ``"1"`` when
    some pair lacks peer access; else unset. ``checked`` False: there was nothing to check
    (one GPU on the node, or no NCCL)."""
    if P2P_ENV in env:
        return P2PChoice(env[P2P_ENV], "user", tuple(missing),
                         f"{P2P_ENV}={env[P2P_ENV]} set by the user")
    if not checked:
        return P2PChoice(None, "fdl", (), "one GPU on this node: no peer-to-peer to check")
    if missing:
        return P2PChoice("1", "fdl", tuple(missing), "no peer access between " + ", ".join(
            f"cuda:{i} and cuda:{j}" for i, j in missing))
    return P2PChoice(None, "fdl", (), "peer access between every pair of this node's GPUs")


def node_devices(local_world_size: int, device_count: int) -> list[int]:
    """The CUDA indices the node's workers train on (local rank r on ``r % device_count``, as
    fdl.engine.collectives.pick_device has it)."""
    if device_count < 1:
        return []
    return sorted({r % device_count for r in range(max(1, local_world_size))})
