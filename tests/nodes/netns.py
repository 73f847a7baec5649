"""Two machines on one host: network namespaces joined by a veth pair.

Each :class:`Node` is a namespace with its loopback up and one end of the pair under a name of
its own (``eth7`` on one, ``wlan3`` on the other: interface names differ between real
machines), addressed inside ranges reserved for tests (198.18.0.0/15, fd00::/8), with no route
out: nothing a test runs can reach any other address. The host's name resolves to 127.0.0.1
here, as on many machines, which is what makes a default gloo advertise loopback to its peers.

A link may be capped (``rate``: ``1gbit``, ``100mbit``) with a token bucket (``tc`` ``tbf``) on
both ends, as a home LAN or WiFi caps it; this kernel has no ``netem``, so no delay is added.
scripts/bench-lan builds its nodes here too.

Needs root and ``ip`` (iproute2). :func:`namespaces_unavailable` says why not, in one line;
``CI_REQUIRE_NETNS=1`` (set by .ci/run) turns that skip into a failure, so CI cannot pass with
the multi-node tests silently skipped. Everything is torn down afterwards, the processes left
inside the namespaces killed first.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass

from helpers import wait_until

IPV4 = ("198.18.0.1", "198.18.0.2")
IPV6 = ("fd00:fd1::1", "fd00:fd1::2")
INTERFACES = ("eth7", "wlan3")
REQUIRE = "CI_REQUIRE_NETNS"


@dataclass(frozen=True)
class Node:
    """One namespace: its name, the interface toward the other node and that interface's
    address."""

    namespace: str
    interface: str
    address: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this node's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]


def namespaces_unavailable() -> str | None:
    """Why this host cannot make namespaces (None: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2's ip"
    probe = f"fdlprobe{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


def need_namespaces() -> None:
    """Skip the test, saying why, where namespaces cannot be made; fail instead under
    ``CI_REQUIRE_NETNS=1``."""
    why = namespaces_unavailable()
    if why is None:
        return
    import pytest  # here: scripts/bench-lan imports this module without pytest's plugins

    if os.environ.get(REQUIRE) == "1":
        pytest.fail(f"{why}, and {REQUIRE}=1 requires the multi-node tests to run")
    pytest.skip(why)


@contextmanager
def two_nodes(*, ipv6: bool = False, rate: str | None = None) -> Iterator[tuple[Node, Node]]:
    """Two namespaces joined by a veth pair, IPv4 only or IPv6 only (then with no IPv4 address
    but loopback's), each direction capped at ``rate`` when given, torn down on the way out."""
    tag = uuid.uuid4().hex[:6]
    names = (f"fdln{tag}a", f"fdln{tag}b")
    addresses = IPV6 if ipv6 else IPV4
    prefix = 64 if ipv6 else 24
    try:
        for name in names:
            _ip("netns", "add", name)
            _ip("-n", name, "link", "set", "lo", "up")
        # made under temporary names (the host's own interfaces may hold the final ones)
        _ip("link", "add", f"fv{tag}a", "netns", names[0], "type", "veth", "peer", "name",
            f"fv{tag}b", "netns", names[1])
        nodes = []
        for name, end, interface, address in zip(names, (f"fv{tag}a", f"fv{tag}b"),
                                                  INTERFACES, addresses, strict=True):
            _ip("-n", name, "link", "set", end, "name", interface)
            extra = ["nodad"] if ipv6 else []  # usable at once, not after duplicate detection
            _ip("-n", name, "addr", "add", f"{address}/{prefix}", "dev", interface, *extra)
            _ip("-n", name, "link", "set", interface, "up")
            if rate is not None:
                _cap(name, interface, rate)
            nodes.append(Node(name, interface, address))
        for node in nodes:
            _wait_for_carrier(node)
        yield nodes[0], nodes[1]
    finally:
        for name in names:
            _kill_inside(name)
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def _cap(namespace: str, interface: str, rate: str) -> None:
    """A token bucket on the interface's egress: ``rate`` sustained, a burst of 10 ms of it (at
    least 64 KiB: tbf needs a burst above rate / HZ) and 50 ms of queue."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    number, unit = next((rate[:-len(u)], u) for u in units if rate.endswith(u))
    burst = max(64 * 1024, int(float(number) * units[unit] / 8 / 100))
    done = subprocess.run(["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev",
                           interface, "root", "tbf", "rate", rate, "burst", str(burst),
                           "latency", "50ms"], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"tc tbf {rate} on {interface}: {done.stderr.strip()}")


def _wait_for_carrier(node: Node) -> None:
    """Until the link has a carrier (both ends of a veth up): a moment after it comes up."""
    def carrier() -> bool:
        shown = subprocess.run(node.command(["ip", "link", "show", node.interface]),
                               capture_output=True, text=True).stdout
        return "NO-CARRIER" not in shown and "LOWER_UP" in shown

    wait_until(carrier, f"a carrier on {node.interface} in {node.namespace}")


def _kill_inside(namespace: str) -> None:
    found = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    for pid in found.stdout.split():
        with suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
