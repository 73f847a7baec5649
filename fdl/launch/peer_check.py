"""``fdl diagnose --peer HOST[:PORT]``: can this node reach a rendezvous endpoint, and if not,
what blocks it.

Asked on each node before a multi-node run, it answers what a node that never joins leaves
unsaid: whether the endpoint's name resolves here and to which family (one family for the whole
job), which address and interface this node would use toward it (the kernel's route, as
``fdl run`` decides: :mod:`fdl.launch.network`), and what a TCP connection to the port meets —
something listening (node 0's rendezvous store, once its ``fdl run`` started), a refusal
(nothing listens there yet, or a firewall rejects it), silence (a firewall drops it, or the
host is off) or no route. On the endpoint's own node it says so, and whether the port is still
free for the store. The only traffic is that one connection attempt, to the address the user
named.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import asdict, dataclass

from fdl.errors import UsageError
from fdl.launch.network import hostname_on_loopback, owns_address, port_free, route_source
from fdl.launch.rendezvous import join_endpoint, lookup_host, parse_endpoint
from fdl.system.host import interface_of

DEFAULT_PORT = 29400  # torchrun's and fdl's rendezvous port
CONNECT_S = 3.0


@dataclass(frozen=True)
class PeerCheck:
    """What ``fdl diagnose --peer`` found. ``outcome``: ``reachable``, ``this node``, ``port
    held`` (this node, and something holds the port: node 0 could not host the rendezvous
    there), ``refused``, ``no answer``, ``no route`` or ``unresolved``."""

    endpoint: str
    outcome: str
    message: str
    hint: str | None = None
    address: str | None = None
    family: str | None = None
    local_addr: str | None = None
    interface: str | None = None
    hostname_on_loopback: bool = False

    @property
    def ok(self) -> bool:
        return self.outcome in ("reachable", "this node")

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "ok": self.ok}


def check_peer(endpoint: str, *, timeout_s: float = CONNECT_S) -> PeerCheck:
    """Check ``endpoint`` (``HOST[:PORT]``, port 29400 by default) from this node. A usage
    error only for text that is no endpoint."""
    host, port = parse_endpoint(endpoint, flag="--peer", default_port=DEFAULT_PORT)
    shown = join_endpoint(host, port)
    loopback_name = hostname_on_loopback()
    try:
        family, sockaddr = lookup_host(host, port)
    except UsageError as exc:
        return PeerCheck(shown, "unresolved", exc.message,
                         "use the endpoint's address (ip addr on that machine lists it), or "
                         "add its name to /etc/hosts on this one",
                         hostname_on_loopback=loopback_name)
    address, kind = sockaddr[0], "ipv6" if family == socket.AF_INET6 else "ipv4"
    found = {"address": address, "family": kind, "hostname_on_loopback": loopback_name}
    if owns_address(family, address):
        free = port_free(family, address, port)
        return PeerCheck(
            shown, "this node" if free else "port held",
            f"{shown} is this node ({kind}): run node 0 here, it hosts the rendezvous; "
            + ("the port is free" if free else "something already listens on the port "
               "(another launcher hosts a rendezvous here, or another program holds it)"),
            None if free else "stop what holds the port or pick another (--rdzv-endpoint "
                              "HOST:PORT, the same on every node)",
            local_addr=address, interface=interface_of(address), **found)
    try:
        local = route_source(family, address, port)
    except UsageError as exc:
        return PeerCheck(shown, "no route", exc.message, exc.hint, **found)
    found.update(local_addr=local, interface=interface_of(local))
    outcome, message, hint = _connect(family, sockaddr, shown, timeout_s=timeout_s)
    return PeerCheck(shown, outcome, message, hint, **found)


def _connect(family: int, sockaddr: tuple, shown: str, *,
             timeout_s: float) -> tuple[str, str, str | None]:
    """One TCP connection attempt, and what it met."""
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(sockaddr)
    except ConnectionRefusedError:
        return ("refused", f"{shown} refused the connection: the host answers, nothing listens "
                "on the port",
                "start fdl run on the endpoint's node first (it hosts the rendezvous there), "
                "or open the port in that machine's firewall if it rejects it")
    except TimeoutError:
        return ("no answer", f"no answer from {shown} within {timeout_s:g} s: a firewall drops "
                "the connection, or the host is off or elsewhere",
                "open TCP on the port (and the workers' ports, which gloo picks at random) in "
                "the endpoint's firewall, or check its address")
    except OSError as exc:
        if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EADDRNOTAVAIL):
            return ("no route", f"{shown} is unreachable from this node "
                    f"({exc.strerror or exc})",
                    "check that both machines are on the same network (ip route get ADDRESS)")
        return ("no answer", f"connecting to {shown} failed ({exc.strerror or exc})",
                "check the address and the endpoint's firewall")
    return ("reachable", f"{shown} accepts connections (node 0's rendezvous, if its fdl run "
            "started)", None)
