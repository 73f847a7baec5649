"""Where the nodes of ``fdl run`` meet: the rendezvous, decided from the flags before anything
starts (:func:`plan_rendezvous`), with torchrun's rules as its users expect them:

* single node (default, or ``--standalone``): c10d on ``127.0.0.1`` with a free port chosen by
  the OS — never a fixed 29500 — listening on loopback only;
* ``--master-addr/--master-port``: torchrun's static rendezvous at that address (listening on
  that address only);
* several nodes: the same command on each node with ``--nnodes N`` (or ``MIN:MAX``) and
  ``--rdzv-endpoint HOST:PORT`` (c10d by default; ``--rdzv-backend static`` needs
  ``--node-rank``), under the run id ``--rdzv-id`` or, when none is given, :data:`DEFAULT_RUN_ID`
  on every node alike (as torchrun's ``none``: an id drawn per node would put each node in a
  rendezvous of its own); ``--master-addr`` (and ``--master-port``) with ``--node-rank`` and no
  endpoint is torchrun's static rendezvous; ``--local-addr`` is the address this node gives
  the others (default: fdl.launch.network decides it from the routes);
* inside a Slurm allocation the node count, node rank, endpoint and run id come from SLURM_*.

Endpoints are ``HOST:PORT`` (``[v6addr]:PORT`` for IPv6) as torch reads them; a malformed one,
a node rank outside the nodes or flags that contradict each other are usage errors. Before
anything starts, the launcher resolves the host (:func:`lookup_host`: a name that does not resolve
would otherwise be retried until the rendezvous times out) and, for one node, binds the port
itself, to that address alone (:func:`bind_listener`).
"""

from __future__ import annotations

import errno
import ipaddress
import re
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fdl.errors import UsageError
from fdl.launch.slurm import RDZV_PORT, SlurmJob, slurm_job
from fdl.ranges import NODES, shortened

if TYPE_CHECKING:
    from fdl.launch.request import RunRequest

LOOKUP_TIMEOUT_S = 15
DEFAULT_RUN_ID = "fdl"  # several nodes without --rdzv-id: the same on every node


@dataclass(frozen=True)
class Rendezvous:
    backend: str  # "c10d" | "static"
    endpoint: str
    run_id: str
    min_nodes: int
    max_nodes: int
    node_rank: int | None  # static rendezvous only; c10d assigns node ranks itself
    local_addr: str | None
    source: str  # "single node" | "flags" | "slurm"

    @property
    def binds_locally(self) -> bool:
        """One node without an endpoint: the launcher itself binds the store's port, to
        ``local_addr`` only (127.0.0.1, or --master-addr), never on every interface."""
        return self.max_nodes == 1 and self.local_addr is not None


def plan_rendezvous(request: RunRequest, *, env: Mapping[str, str], run_id: str) -> Rendezvous:
    """The rendezvous of ``request`` (flags, else Slurm, else one node); usage errors for
    flags that contradict each other or cannot work. Pure: reads only ``env``."""
    _check_standalone(request)
    slurm = None if request.get("standalone") else slurm_job(env)
    nnodes = request.get("nnodes") or (str(slurm.nnodes) if slurm else "1")
    min_nodes, max_nodes = _parse_nnodes(nnodes)
    static_flags = request.get("master_addr") is not None and \
        request.get("rdzv_endpoint") is None and slurm is None and max_nodes > 1
    backend = request.get("rdzv_backend") or ("static" if static_flags else "c10d")
    if backend not in ("c10d", "static"):
        raise UsageError(f"unknown --rdzv-backend {backend!r}", hint="use c10d or static")
    master_port = request.get("master_port")
    if master_port is not None and not 0 < master_port < 2**16:
        raise UsageError(f"--master-port must be a port number 1-65535, got {master_port}",
                         hint="or leave it out for a local rendezvous on a free port")
    if max_nodes == 1 and not request.get("rdzv_endpoint"):
        if request.get("local_addr") is not None:
            raise UsageError("--local-addr is for several nodes (--nnodes N with N > 1)",
                             hint="one node's rendezvous and workers stay on loopback")
        run_id = request.get("rdzv_id") or (slurm.job_id if slurm else run_id)
        return _single_node(request, backend=backend, run_id=run_id)
    run_id = request.get("rdzv_id") or (slurm.job_id if slurm else DEFAULT_RUN_ID)
    local_addr = request.get("local_addr")
    if local_addr is not None and not (_ip(local_addr) or _HOSTNAME.fullmatch(local_addr)):
        raise UsageError(f"--local-addr must be an address or host name, got {local_addr!r}",
                         hint="e.g. --local-addr 192.168.1.20 (this node's address toward the "
                              "others)")
    endpoint = _endpoint(request, slurm=slurm, backend=backend)
    node_rank = request.get("node_rank")
    node_rank = node_rank if node_rank is not None else (
        slurm.node_rank if slurm else None)
    if backend == "static":
        _check_static(node_rank, nnodes=nnodes, min_nodes=min_nodes, max_nodes=max_nodes)
    elif node_rank is not None and not 0 <= node_rank < max_nodes:
        raise _node_rank_error(node_rank, max_nodes)
    return Rendezvous(backend, endpoint, run_id, min_nodes, max_nodes,
                      node_rank if backend == "static" else None, local_addr,
                      "slurm" if slurm and not request.get("rdzv_endpoint") else "flags")


def _check_standalone(request: RunRequest) -> None:
    if not request.get("standalone"):
        return
    given = [flag for flag, value in (("--rdzv-endpoint", request.get("rdzv_endpoint")),
                                      ("--master-addr", request.get("master_addr")),
                                      ("--master-port", request.get("master_port")))
             if value is not None]
    if request.get("nnodes") is not None and _parse_nnodes(request.get("nnodes")) != (1, 1):
        given.insert(0, f"--nnodes {request.get('nnodes')}")
    if given:
        raise UsageError(f"--standalone runs one node on a local rendezvous; it cannot be "
                         f"combined with {', '.join(given)}",
                         hint="leave out --standalone, or the other flags")


def _single_node(request: RunRequest, *, backend: str, run_id: str) -> Rendezvous:
    """One node without an endpoint: torchrun's static rendezvous at --master-addr/port, else
    c10d on 127.0.0.1 with a port the OS picks. The launcher binds the store to that address
    only (:attr:`Rendezvous.binds_locally`)."""
    if request.get("node_rank") not in (None, 0):
        raise _node_rank_error(request.get("node_rank"), 1)
    if request.get("master_port") is not None:
        addr = request.get("master_addr") or "127.0.0.1"
        host, _ = parse_endpoint(addr, flag="--master-addr", default_port=request.get("master_port"))
        return Rendezvous("static", join_endpoint(host, request.get("master_port")), run_id, 1, 1, 0,
                          host, "flags")
    if request.get("master_addr") is not None:
        raise UsageError(f"--master-addr {request.get('master_addr')} needs --master-port PORT",
                         hint="give both for torchrun's static rendezvous, or neither for a "
                              "local rendezvous on a free port")
    if backend == "static":
        raise UsageError("--rdzv-backend static needs --master-port PORT on one node",
                         hint="or leave --rdzv-backend out for a local rendezvous on a free port")
    return Rendezvous("c10d", "127.0.0.1:0", run_id, 1, 1, None, "127.0.0.1", "single node")


def _endpoint(request: RunRequest, *, slurm: SlurmJob | None, backend: str) -> str:
    if request.get("rdzv_endpoint") is not None:
        text, flag = request.get("rdzv_endpoint"), "--rdzv-endpoint"
    elif slurm is not None:
        text, flag = slurm.endpoint, "SLURM_JOB_NODELIST"
    elif request.get("master_addr") is not None:
        text = join_endpoint(request.get("master_addr"), request.get("master_port") or RDZV_PORT)
        flag = "--master-addr"
    else:
        raise UsageError(f"--nnodes {request.get('nnodes')} needs --rdzv-endpoint HOST:PORT",
                         hint="run the same command on every node, e.g. "
                              "--nnodes 2 --rdzv-endpoint node0:29400")
    host, port = parse_endpoint(text, flag=flag,
                                default_port=None if backend == "static" else RDZV_PORT)
    return join_endpoint(host, port)


def _check_static(node_rank: int | None, *, nnodes: str, min_nodes: int, max_nodes: int) -> None:
    if min_nodes != max_nodes:
        raise UsageError(f"--rdzv-backend static needs a fixed node count, got --nnodes {nnodes}",
                         hint="give --nnodes N, or use the c10d backend for MIN:MAX")
    if node_rank is None:
        raise UsageError("--rdzv-backend static needs --node-rank",
                         hint=f"give each node its rank, 0 to {max_nodes - 1}")
    if not 0 <= node_rank < max_nodes:
        raise _node_rank_error(node_rank, max_nodes)


def _node_rank_error(node_rank: int, max_nodes: int) -> UsageError:
    return UsageError(f"--node-rank {node_rank} is not a node of --nnodes {max_nodes} "
                      f"(node ranks are 0 to {max_nodes - 1})",
                      hint="give each node its own rank, from 0 to nnodes - 1")


_HOSTNAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?")


def parse_endpoint(text: str, *, flag: str, default_port: int | None,
                   min_port: int = 1) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6addr]:PORT`` for IPv6) as torch reads it, checked: a host name or IP
    address and a port ``min_port``-65535 (``default_port`` when there is none; None: a port is
    needed)."""
    raw = text.strip()
    if raw.startswith("["):
        host, closed, rest = raw[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else (None if not rest else "")
        host = host if closed and ":" in host and _ip(host) else ""
    elif raw.count(":") > 1 and _ip(raw):
        host, port_text = raw, None
    else:
        host, _, port_text = raw.rpartition(":") if ":" in raw else (raw, "", None)
    port = default_port if port_text is None else (
        int(port_text) if port_text.isdigit() and port_text.isascii() else -1)
    if not (_ip(host) or _HOSTNAME.fullmatch(host)) or port is None or \
            not min_port <= port < 2**16:
        raise UsageError(f"{flag} must be HOST:PORT with a port 1-65535, got {text!r}",
                         hint=f"e.g. {flag} node0:29400 ([::1]:29400 for an IPv6 address)")
    unreachable = _unreachable(host)
    if unreachable:
        raise UsageError(f"{flag}: {host} is {unreachable}, not an address a node connects to",
                         hint=f"give the address or name of the node that holds the rendezvous "
                              f"(e.g. {flag} 192.168.1.10:{port})")
    return host, port


def _unreachable(host: str) -> str | None:
    """What makes an IP address one no node can connect to (None: a host name, or an address
    that may be reached): 0.0.0.0 and :: listen on every address, a broadcast or multicast
    address is no one host."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if address.is_unspecified:
        return "the any-address (listen on every interface)"
    if address.is_multicast:
        return "a multicast address"
    if address == ipaddress.IPv4Address("255.255.255.255"):
        return "the broadcast address"
    return None


def join_endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _parse_nnodes(text: str) -> tuple[int, int]:
    low, _, high = str(text).partition(":")
    try:
        bounds = (int(low), int(high or low))
    except ValueError:
        bounds = (0, 0)
    if bounds[0] < NODES.low or bounds[1] < bounds[0] or bounds[1] > NODES.high:
        raise UsageError(f"--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX <= "
                         f"{NODES.high}, got {shortened(text)}",
                         hint="e.g. --nnodes 2, or --nnodes 1:4 for an elastic job")
    return bounds


def resolve_within(host: str, port: int | None, *, timeout_s: float) -> dict[str, Any]:
    """``getaddrinfo(host, port)`` (stream sockets) given at most ``timeout_s``: a resolver that
    does not answer (a DNS server gone) would otherwise block for as long as it likes. The
    result holds ``infos``, or ``error`` (the exception), or neither when time ran out."""
    found: dict[str, Any] = {}

    def lookup() -> None:
        try:
            found["infos"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            found["error"] = exc

    worker = threading.Thread(target=lookup, name="fdl-lookup-host", daemon=True)
    worker.start()
    worker.join(timeout_s)
    return dict(found)


def lookup_host(host: str, port: int, *, timeout_s: float = LOOKUP_TIMEOUT_S) -> tuple[int, Any]:
    """``(family, sockaddr)`` of ``host``; a usage error, within ``timeout_s``, for a host that
    does not resolve (torch would otherwise retry it until the rendezvous times out)."""
    found = resolve_within(host, port, timeout_s=timeout_s)
    if not found.get("infos"):
        why = getattr(found.get("error"), "strerror", None) or (
            "no address" if "error" in found or "infos" in found
            else f"no answer in {timeout_s:g} s")
        raise UsageError(f"cannot resolve the rendezvous host {host!r} ({why})",
                         hint="check the host in --rdzv-endpoint / --master-addr (or the Slurm "
                              "node list), or give its IP address")
    family, _, _, _, sockaddr = found["infos"][0]
    return family, sockaddr


def bind_listener(address: tuple[int, Any], *, host: str) -> socket.socket:
    """A listening TCP socket bound to ``address`` (``(family, sockaddr)``) only."""
    family, sockaddr = address
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore does
        sock.bind(sockaddr)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise UsageError(f"--master-port {sockaddr[1]} is already in use on {host}",
                             hint="pick another port, or leave it out for a free one") from exc
        raise UsageError(f"cannot listen on {host} port {sockaddr[1]} ({exc.strerror or exc})",
                         hint="--master-addr must be an address of this host") from exc
    return sock
