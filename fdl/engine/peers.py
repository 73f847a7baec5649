"""The other ranks as people name them, and what a rank that fails tells them.

Every rank learns at :func:`fdl.engine.agreement.agree` which node each rank runs on
(:data:`PEERS`, from :func:`node_label`), so that whatever ends a run because of a peer names
it: a collective whose connection to the peer closed (:func:`lost_peer`), a peer gone silent
(fdl.engine.liveness), or a peer that failed and said why.

A rank that fails (an exception in the script or the engine) posts its **root cause** in the
group's store before it exits (:func:`tell_peers`): one line, under a key of its own and a
counter every rank reads in one round trip. Its process then ends and closes its connections,
so a peer in a collective fails at once and reads the cause (:func:`posted_cause`); a peer
waiting on the store for a round's message reads the counter between two slices of its wait
(fdl.engine.liveness) and stops within a slice. Either way the peer's one line names the rank,
its node and its error, on the other node's terminal, where the user is looking. The store is
node 0's launcher's: it outlives any worker, and every post or read is bounded
(:data:`POST_S`), so an unreachable store costs a failing rank two seconds, never a hang.
"""

from __future__ import annotations

import os
import re
import socket
import threading
from collections.abc import Callable, Mapping
from typing import Any

from fdl.errors import FdlError
from fdl.settings import NODE_ADDR_ENV

#: every rank's :func:`node_label`, by rank, once the group has agreed
PEERS: list[str] = []
#: every rank's node (``GROUP_RANK``), by rank, once the group has agreed
NODES: list[int] = []
#: the group's restart attempt, once agreed: the highest ``TORCHELASTIC_RESTART_COUNT`` of its
#: ranks. The nodes' counts differ: an agent restarts its workers uncounted when another node
#: rejoins (its own workers did not fail), so after node 1's crash node 0's workers start again
#: as attempt 0 and node 1's as attempt 1; keyed by their own counts, they would wait for
#: each other under different keys, and only node 1 would resume.
ATTEMPT: list[int] = []
#: the group's store, kept from ``fdl.init`` (:func:`keep_store`): when a failure is told, the
#: group itself may be gone (the Trainer leaves it as the script fails)
_STORE: list[Any] = []

CAUSE_KEY = "fdl/failed/"  # + attempt/: "count", and one key per rank that failed
STOPPED_WITH_IT = "its own log or terminal says the rest; this worker stopped with it"
MAX_CAUSE = 300  # characters of a posted cause
POST_S = 2.0  # the longest a post or a read of a cause may take (a store that is gone)
# gloo: "Connection closed by peer [ADDR]:PORT", "Read error [ADDR]:PORT: Connection reset by peer"
_BY_PEER = re.compile(r"[Cc]onnection (?:closed|reset) by peer")
_PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:%]+)\]:\d+")
# gloo: "Timed out waiting 3000ms for recv operation to complete"
_TIMED_OUT = re.compile(r"Timed out waiting (\d+)ms for (?:recv|send) operation")
_PRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


class PeerGone(FdlError):
    """A rank stopped ticking or failed while another waited for its message."""


def keep_store(store: Any) -> None:
    """Keep the group's ``store`` (None: no group) for :func:`tell_peers`."""
    _STORE[:] = [] if store is None else [store]


def kept_store() -> Any:
    return _STORE[0] if _STORE else None


def is_consequence(exc: BaseException) -> bool:
    """Whether ``exc`` is this rank stopping because of a peer (nothing to tell the others)."""
    return isinstance(exc, PeerGone) or stopped_by_peer(exc) is not None


def stopped_by_peer(exc: BaseException) -> str | None:
    """:func:`lost_peer` or :func:`timed_out`: the line for an error a peer caused, or None."""
    return lost_peer(exc) or timed_out(exc)


def node_label() -> str:
    """Which node a rank is on, as people name it: the node rank, the host name and, with
    several nodes, the node's address (``FDL_NODE_ADDR``, from fdl.launch.network)."""
    address = os.environ.get(NODE_ADDR_ENV)
    return f"node {node_index()}, {socket.gethostname()}" + (f", {address}" if address else "")


def own_attempt(env: Mapping[str, str] | None = None) -> int:
    """This process's ``TORCHELASTIC_RESTART_COUNT`` (``env``'s; 0 without one)."""
    env = os.environ if env is None else env
    return int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def group_attempt() -> int:
    """The attempt every rank of the group keys its store messages by and resumes on
    (:data:`ATTEMPT`); this process's own count before the group agreed, or alone."""
    return ATTEMPT[0] if ATTEMPT else own_attempt()


def node_index() -> int:
    """This rank's node (``GROUP_RANK``; 0 alone)."""
    return int(os.environ.get("GROUP_RANK", "0") or 0)


def away_from_rank0() -> list[int]:
    """The ranks on another node than rank 0's (they cannot read rank 0's disk), once the
    group has agreed; none before, or alone."""
    return [rank for rank, node in enumerate(NODES) if node != NODES[0]]


def peer_name(rank: int) -> str:
    """``rank`` with its node, once the group has agreed."""
    return f"rank {rank} ({PEERS[rank]})" if rank < len(PEERS) else f"rank {rank}"


def lost_peer(exc: BaseException) -> str | None:
    """What a collective's error says of a peer that left (its process ended: a node killed,
    crashed or stopped), in one line naming it; None for any other error. gloo reports the
    peer's address ("Connection closed by peer [ADDR]:PORT", or "Read error [ADDR]:PORT:
    Connection reset by peer"); :data:`PEERS` turns it into ranks and a node."""
    text = str(exc)
    match = _PEER_ADDRESS.search(text)
    if match is None or not _BY_PEER.search(text):
        return None
    address = match.group(1)
    ranks = [rank for rank, label in enumerate(PEERS) if label.endswith(f", {address}")]
    who = (f"rank {ranks[0]} ({PEERS[ranks[0]]})" if len(ranks) == 1 else
           f"ranks {', '.join(map(str, ranks))} ({PEERS[ranks[0]].rsplit(',', 2)[0]}, {address})"
           if ranks else address)
    return (f"the run lost a peer: the connection to {who} closed during a collective (its "
            "worker or node stopped or crashed)")


def timed_out(exc: BaseException) -> str | None:
    """What a collective that waited out the group's timeout (fdl.engine.collectives.
    group_timeout) says, in one line; None for any other error. No peer is named: gloo does not
    say which one it waited for."""
    match = _TIMED_OUT.search(str(exc))
    if match is None:
        return None
    return (f"a collective waited {int(match.group(1)) / 1000:g} s for a peer that never "
            "answered (fdl run --collective-timeout): a rank stalled (its log shows where) or "
            "the link between nodes stopped carrying traffic")


def failed_line(rank: int, cause: str) -> str:
    """The line a peer stops with when ``rank`` posted ``cause``."""
    return f"the run lost a peer: {peer_name(rank)} failed: {cause}"


def cause_of(exc: BaseException) -> str:
    """An exception as one line to post: its type and the first line of its message."""
    message = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {message[0]}" if message else type(exc).__name__
    return text if len(text) <= MAX_CAUSE else text[:MAX_CAUSE - 3] + "..."


def tell_peers(store: Any, cause: str, *, rank: int) -> bool:
    """Post this rank's root cause in ``store`` for the others; False when the store did not
    take it within :data:`POST_S` (gone, or unreachable: the peers learn by other means)."""
    key = _key()

    def post() -> None:
        store.set(f"{key}{rank}", cause)
        store.add(f"{key}count", 1)  # after the cause: a reader that sees the count finds it

    return _bounded(post)


def posted_count(reader: Any) -> int:
    """How many ranks have posted a cause (this attempt), read through ``reader`` (the
    calling thread's store object): one round trip."""
    return int(reader.add(f"{_key()}count", 0))


def posted_cause(reader: Any, *, rank: int, world_size: int) -> tuple[int, str] | None:
    """The first other rank that posted a root cause, and the cause (None: none did)."""
    key = _key()
    if posted_count(reader) == 0:
        return None
    for other in range(world_size):
        if other != rank and reader.check([f"{key}{other}"]):
            text = reader.get(f"{key}{other}").decode("utf-8", "replace")[:MAX_CAUSE]
            return other, _PRINTABLE.sub("?", text)  # a cause is printed: no escape sequences
    return None


def cause_within(store: Any, *, rank: int, world_size: int) -> tuple[int, str] | None:
    """:func:`posted_cause`, bounded by :data:`POST_S` (a store that is gone)."""
    found: list[tuple[int, str] | None] = []
    _bounded(lambda: found.append(posted_cause(store, rank=rank, world_size=world_size)))
    return found[0] if found else None


def _key() -> str:
    return f"{CAUSE_KEY}{group_attempt()}/"


def _bounded(call: Callable[[], None]) -> bool:
    """``call`` on a thread of its own, waited for at most :data:`POST_S`; whether it
    returned. (A store call to a host that stopped answering blocks for the store's timeout,
    minutes.)"""
    done = threading.Event()

    def run() -> None:
        try:
            call()
            done.set()
        except Exception:  # the store is gone: nobody to tell, nothing to read
            pass

    threading.Thread(target=run, name="fdl-peers", daemon=True).start()
    return done.wait(POST_S)
