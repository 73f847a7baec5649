"""How this node reaches the others in a multi-node ``fdl run``, decided before anything starts.

Left to themselves, torch's rendezvous and gloo guess from the host's name, and on many hosts
(this project's own VMs, most laptops with an /etc/hosts entry) that name resolves to
127.0.0.1: the node that owns the rendezvous address does not see it as its own, so no node
hosts the rendezvous store and every node waits as a client until a timeout; and a worker
advertises loopback to its peers. So, for several nodes, fdl decides from the routes instead:

* **the endpoint's address**: resolved once (:func:`fdl.launch.rendezvous.lookup_host`); its
  family (IPv4 or IPv6) is the job's;
* **whether this node hosts the rendezvous**: the endpoint's address is one of this node's own
  (a socket can be bound to it; nothing is sent) and its port is free (taken: another launcher
  of this machine hosts it already). torch's c10d rendezvous takes that as its documented
  ``is_host`` setting. A loopback endpoint (several launchers on one machine, as tests and
  ``scripts/test-gpu`` run them) is left to torch, which recognises loopback as its own and,
  when the port is taken, joins as a client;
* **this node's address**: ``--local-addr`` when given, else the endpoint's address when this
  node hosts, else the source address the kernel would use to reach the endpoint (a UDP socket
  connected to it, which sends nothing). The rendezvous publishes it to the other nodes
  (torch's ``local_addr``), so rank 0's node is reached there and not at its host name;
* **the interface**: the one that holds that address, exported as ``GLOO_SOCKET_IFNAME`` and
  ``NCCL_SOCKET_IFNAME`` to every worker unless the user set them (a user's value wins).

:func:`probe_network` finds all of it (:class:`NodeNetwork`, whose ``env`` the worker
environment takes whole: fdl.launch.worker_env).

One node: its rendezvous and stores stay on loopback (:mod:`fdl.launch.rendezvous`), and gloo,
which would otherwise bind whatever the host's name resolves to (a LAN address on many hosts,
reachable from the network), is pinned to the loopback interface through
``GLOO_SOCKET_IFNAME`` unless the user set it (torchrun leaves it to the host's name).

An interface the user names (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``; gloo and NCCL take
a comma-separated list) must exist on this node, be up and, for several nodes, hold an address
of the job's family: otherwise gloo fails at the first collective with a C++ error, after
every node has started.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from fdl.errors import UsageError
from fdl.launch.rendezvous import LOOKUP_TIMEOUT_S, lookup_host, parse_endpoint, resolve_within
from fdl.settings import NODE_ADDR_ENV

if TYPE_CHECKING:
    from fdl.launch.rendezvous import Rendezvous

INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


class EndpointNotResolved(UsageError):
    """The rendezvous host does not resolve here: ``fdl run`` refuses, ``--dry-run`` shows it
    (a Slurm node list read off the cluster resolves only on it)."""


@dataclass(frozen=True)
class NodeNetwork:
    """What this node uses to reach the others."""

    family: str  # "ipv4" | "ipv6": the endpoint's, the job's
    endpoint_address: str
    hosts_rendezvous: bool | None  # None: a loopback endpoint (or one node), left to torch
    local_addr: str
    interface: str | None  # None: no interface of this node holds local_addr
    # what the workers get for it (fdl.launch.worker_env adds it); none the user set
    env: dict[str, str] = field(default_factory=dict)
    user_set: tuple[str, ...] = ()  # the interface variables the user had set
    several_nodes: bool = True
    # several nodes: this host's name resolves to loopback (torch left alone would advertise it)
    hostname_on_loopback: bool = False
    link_mbit: int | None = None  # the interface's rated speed (None: unknown), fdl report's

    def to_dict(self) -> dict[str, object]:
        return {"several_nodes": self.several_nodes, "family": self.family,
                "endpoint_address": self.endpoint_address,
                "hosts_rendezvous": self.hosts_rendezvous, "local_addr": self.local_addr,
                "interface": self.interface, "env": dict(self.env),
                "user_set": list(self.user_set),
                "hostname_on_loopback": self.hostname_on_loopback, "link_mbit": self.link_mbit}


def probe_network(rdzv: Rendezvous, env: Mapping[str, str]) -> NodeNetwork:
    """This node's network for ``rdzv``, probed: names resolved, sockets bound (nothing sent),
    the interfaces read. Usage errors: an endpoint that does not resolve
    (:class:`EndpointNotResolved`, which the planning shell keeps as the probe's result), a
    ``--local-addr`` that is not this node's, an interface the user set that cannot work."""
    if rdzv.max_nodes == 1:
        return _one_node(env, endpoint=rdzv.endpoint)
    host, port = parse_endpoint(rdzv.endpoint, flag="--rdzv-endpoint", default_port=0,
                                min_port=0)
    try:
        family, sockaddr = lookup_host(host, port)
    except UsageError as exc:
        raise EndpointNotResolved(exc.message, hint=exc.hint) from exc
    endpoint_address = sockaddr[0]
    user_set = tuple(name for name in INTERFACE_VARIABLES if env.get(name))
    for name in user_set:
        check_interfaces(name, env[name], family=family)
    hosts = hosts_rendezvous(family, endpoint_address, port)
    if rdzv.local_addr is not None:
        local_family, local_sockaddr = lookup_host(rdzv.local_addr, 0)
        local = local_sockaddr[0]
        if local_family != family:
            raise UsageError(f"--local-addr {rdzv.local_addr} is {_family(local_family)} but "
                             f"the rendezvous {rdzv.endpoint} is {_family(family)}",
                             hint="give an address of the endpoint's family: one job, one "
                                  "address family")
        if not owns_address(family, local):
            raise UsageError(f"--local-addr {rdzv.local_addr} is not an address of this node",
                             hint="give the address of this node's interface toward the others "
                                  "(ip addr lists them), or leave --local-addr out")
    else:
        local = endpoint_address if owns_address(family, endpoint_address) \
            else route_source(family, endpoint_address, port)
    # psutil: several nodes only, not every launch
    from fdl.system.host import interface_of, interface_speed_mbit

    interface = interface_of(local)
    exported = {name: interface for name in INTERFACE_VARIABLES
                if interface is not None and name not in user_set}
    exported[NODE_ADDR_ENV] = local  # the survivors of a lost node name it by this address
    return NodeNetwork(_family(family), endpoint_address, hosts, local, interface, exported,
                       user_set, hostname_on_loopback=hostname_on_loopback(),
                       link_mbit=interface_speed_mbit(interface) if interface else None)


def hostname_on_loopback() -> bool:
    """Whether this host's name resolves to a loopback address (then torch's defaults, left
    alone, advertise loopback to the other nodes; fdl decides from the routes instead)."""
    infos = resolve_within(socket.gethostname(), None, timeout_s=LOOKUP_TIMEOUT_S).get("infos")
    if not infos:  # no answer in time, or no address: nothing that resolves to loopback
        return False
    return any(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def _one_node(env: Mapping[str, str], *, endpoint: str) -> NodeNetwork:
    """One node: gloo on the loopback interface unless the user named one; the family and
    address are the endpoint's when it is an address (``--master-addr ::1``), else IPv4
    loopback's."""
    interface = loopback_interface()
    user_set = tuple(name for name in ("GLOO_SOCKET_IFNAME",) if env.get(name))
    for name in user_set:
        check_interfaces(name, env[name], family=None)
    exported = {"GLOO_SOCKET_IFNAME": interface} if interface and not user_set else {}
    host = parse_endpoint(endpoint, flag="--rdzv-endpoint", default_port=0, min_port=0)[0]
    try:
        address = ipaddress.ip_address(host.split("%")[0])
    except ValueError:  # a name: c10d on one node listens on loopback (fdl.launch.rendezvous)
        address = ipaddress.ip_address("127.0.0.1")
    return NodeNetwork(f"ipv{address.version}", str(address), None, str(address), interface,
                       exported, user_set, several_nodes=False)


def loopback_interface() -> str | None:
    """The loopback interface's name, from the kernel's interface flags (IFF_LOOPBACK) where
    /sys shows them: every ``fdl run`` asks, and importing psutil would lengthen its start-up
    (docs/run.md "Launch latency"); elsewhere, the interface holding 127.0.0.1."""
    iff_loopback = 0x8
    try:
        for _, name in socket.if_nameindex():
            flags = Path(f"/sys/class/net/{name}/flags").read_text()
            if int(flags, 16) & iff_loopback:
                return name
    except (OSError, ValueError):
        pass
    from fdl.system.host import interface_of

    return interface_of("127.0.0.1")


def check_interfaces(variable: str, value: str, *, family: int | None) -> None:
    """A usage error unless every interface ``value`` names exists here, is up and (with
    ``family``) holds an address of that family."""
    import psutil

    addresses, stats = psutil.net_if_addrs(), psutil.net_if_stats()
    for name in (part.strip() for part in value.split(",")):
        if name not in addresses:
            raise UsageError(f"{variable}={value}: this node has no interface {name!r} "
                             f"(it has {', '.join(sorted(addresses)) or 'none'})",
                             hint=f"set {variable} to this node's interface toward the others, "
                                  "or unset it and fdl picks the one that routes there")
        # administratively down (psutil's isup also wants a carrier, which a link may lack for
        # a moment after it comes up)
        if name in stats and "up" not in stats[name].flags.split(","):
            raise UsageError(f"{variable}={value}: interface {name!r} is down",
                             hint=f"bring it up, or set {variable} to an interface that is up")
        if family is not None and not any(_usable(entry, family) for entry in addresses[name]):
            raise UsageError(f"{variable}={value}: interface {name!r} has no {_family(family)} "
                             "address, the family of the rendezvous endpoint",
                             hint="one job, one address family: name an interface with an "
                                  f"{_family(family)} address, or give an endpoint of its family")


def _usable(entry, family: int) -> bool:
    """An address of ``family`` that reaches beyond the link (IPv6 link-local ones do not)."""
    if entry.family != family:
        return False
    return not ipaddress.ip_address(entry.address.split("%")[0]).is_link_local


def hosts_rendezvous(family: int, address: str, port: int) -> bool | None:
    """Whether this node hosts the rendezvous at ``address``:``port`` (None: a loopback
    address, which torch recognises itself)."""
    if ipaddress.ip_address(address.split("%")[0]).is_loopback:
        return None
    return owns_address(family, address) and port_free(family, address, port)


def port_free(family: int, address: str, port: int) -> bool:
    """Whether nothing listens on ``address``:``port`` of this node (binding it tells)."""
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore binds
            sock.bind((address, port))
    except OSError:
        return False
    return True


def owns_address(family: int, address: str) -> bool:
    """Whether ``address`` is one of this node's own: a socket binds to it (sends nothing)."""
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((address, 0))
    except OSError:
        return False
    return True


def route_source(family: int, address: str, port: int) -> str:
    """The address this node would send from to reach ``address`` (a UDP socket connected to
    it: the kernel picks the route and the source; nothing is sent). A usage error when no
    route leads there."""
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect((address, port or 9))
            return sock.getsockname()[0]
    except OSError as exc:
        raise UsageError(f"no route from this node to the rendezvous address {address} "
                         f"({exc.strerror or exc})",
                         hint="check that this node is on the same network as the endpoint's "
                              "node (ip route get ADDRESS)") from exc


def _family(family: int) -> str:
    return "ipv6" if family == socket.AF_INET6 else "ipv4"
