"""Host survey: CPU, memory, OS, the build tools on PATH and the network interfaces.

``probe_host()`` reads what ``fdl diagnose`` and ``fdl setup`` need to know about the machine
besides its GPUs: the CPU model and core counts (CPU workers get a share of the cores), RAM,
the OS and kernel, whether this is WSL or a container (both change how drivers and GPUs are
reached), the versions of nvcc, cmake, ninja, gcc, git and docker (a libtorch source build
needs the first four), and the network interfaces a multi-node rendezvous could bind to.

Nothing here raises for a missing file or tool: what cannot be read is reported as None
(``ToolVersion.version``/``path``, ``HostInfo.container``) or as a fallback value.

Example::

    >>> host = probe_host()
    >>> [(tool.name, tool.version) for tool in host.tools]
    [('nvcc', '12.8'), ('cmake', '3.25.1'), ('ninja', '1.11.1'), ('gcc', '12.2.0'), ...]
"""

from __future__ import annotations

import ipaddress
import platform
import re
import shutil
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil

TOOLS = ("nvcc", "cmake", "ninja", "gcc", "git", "docker")
# (substring of /proc/1/cgroup, runtime), most specific first: pods run on docker/containerd too.
_CONTAINER_HINTS = (
    ("kubepods", "kubernetes"), ("kubernetes", "kubernetes"), ("libpod", "podman"),
    ("podman", "podman"), ("docker", "docker"), ("lxc", "lxc"),
)
_VERSION = r"(\d+(?:\.\d+)+)"
_TOOL_PATTERNS = {
    "nvcc": rf"release {_VERSION}",
    "cmake": rf"cmake version {_VERSION}",
    "ninja": rf"^\s*{_VERSION}",
    "gcc": rf"^\S+ \(.*?\) {_VERSION}",
    "git": rf"git version {_VERSION}",
    "docker": rf"Docker version {_VERSION}",
}


@dataclass(frozen=True)
class ToolVersion:
    """A command-line tool: ``path`` is where it is (None = not on PATH), ``version`` None when
    it is missing or its ``--version`` output could not be read."""

    name: str
    version: str | None
    path: str | None


@dataclass(frozen=True)
class NetInterface:
    """One network interface with its addresses (IPv6 without the ``%scope`` suffix)."""

    name: str
    ipv4: tuple[str, ...]
    ipv6: tuple[str, ...]
    is_up: bool
    is_loopback: bool


@dataclass(frozen=True)
class HostInfo:
    """The machine ``probe_host`` surveyed. ``os_name`` is ``platform.system()`` ("Linux"),
    ``os_release`` the distribution ("Debian GNU/Linux 12 (bookworm)"), ``kernel`` the kernel
    release; ``container`` names the runtime ("docker", "podman", ...) or is None."""

    cpu_model: str
    physical_cores: int | None
    logical_cores: int
    ram_mib: int
    os_name: str
    os_release: str
    kernel: str
    machine: str
    python_version: str
    python_executable: str
    wsl: bool
    container: str | None
    tools: tuple[ToolVersion, ...]
    interfaces: tuple[NetInterface, ...]
    default_route_interface: str | None = None  # where traffic to the internet would leave

    @property
    def routable_interfaces(self) -> tuple[NetInterface, ...]:
        """Interfaces another machine could reach: up, not loopback, with an address that is
        not link-local (169.254.0.0/16, fe80::/10)."""
        return tuple(
            nic for nic in self.interfaces
            if nic.is_up and not nic.is_loopback
            and any(not _ip(address).is_link_local for address in nic.ipv4 + nic.ipv6)
        )


def probe_host(*, tool_timeout_s: float = 5.0) -> HostInfo:
    """Survey this machine; the tools' ``--version`` runs concurrently, each bounded by
    ``tool_timeout_s``. Never raises for missing files or tools."""
    return HostInfo(
        cpu_model=_cpu_model(),
        physical_cores=psutil.cpu_count(logical=False),
        logical_cores=psutil.cpu_count(logical=True) or 1,
        ram_mib=psutil.virtual_memory().total >> 20,
        os_name=platform.system(),
        os_release=_os_release(),
        kernel=platform.release(),
        machine=platform.machine(),
        python_version=platform.python_version(),
        python_executable=sys.executable,
        wsl=detect_wsl(),
        container=detect_container(),
        tools=probe_tools(timeout_s=tool_timeout_s),
        interfaces=probe_interfaces(),
        default_route_interface=default_route_interface(),
    )


def probe_tools(
    *, names: tuple[str, ...] = TOOLS, timeout_s: float = 5.0
) -> tuple[ToolVersion, ...]:
    """``ToolVersion`` for each of ``names``, in that order, probed concurrently."""
    with ThreadPoolExecutor(max_workers=max(1, len(names))) as pool:
        return tuple(pool.map(lambda name: _tool_version(name, timeout_s=timeout_s), names))


def _tool_version(name: str, *, timeout_s: float) -> ToolVersion:
    path = shutil.which(name)
    if path is None:
        return ToolVersion(name, None, None)
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True,
                              errors="replace", timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ToolVersion(name, None, path)
    return ToolVersion(name, parse_tool_version(name, done.stdout + done.stderr), path)


def parse_tool_version(name: str, output: str) -> str | None:
    """The version in ``<name> --version`` output ("12.8" for nvcc's "release 12.8, V12.8.93"),
    or None. Unknown tools and unexpected output fall back to the first dotted number."""
    pattern = _TOOL_PATTERNS.get(name)
    match = re.search(pattern, output, re.MULTILINE) if pattern else None
    match = match or re.search(rf"\b{_VERSION}\b", output)
    return match.group(1) if match else None


def _cpu_model(*, cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    match = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    model = match.group(1).strip() if match else ""
    return model or platform.processor() or platform.machine() or "unknown"


def _os_release(*, root: Path = Path("/")) -> str:
    """The distribution's PRETTY_NAME on Linux; macOS/Windows versions elsewhere."""
    for candidate in ("etc/os-release", "usr/lib/os-release"):
        try:
            text = (root / candidate).read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        match = re.search(r"^PRETTY_NAME=\"?(.*?)\"?\s*$", text, re.MULTILINE)
        if match and match.group(1):
            return match.group(1)
    if platform.system() == "Darwin" and platform.mac_ver()[0]:
        return f"macOS {platform.mac_ver()[0]}"
    return f"{platform.system()} {platform.version()}".strip()


def detect_wsl(*, root: Path = Path("/")) -> bool:
    """True under Windows Subsystem for Linux (its kernel names Microsoft in /proc/version)."""
    try:
        return "microsoft" in (root / "proc/version").read_text(errors="replace").lower()
    except OSError:
        return False


def detect_container(*, root: Path = Path("/")) -> str | None:
    """The container runtime this process runs in ("docker", "podman", "kubernetes", "lxc"),
    from /.dockerenv, /run/.containerenv or PID 1's cgroups; None on a plain host."""
    if (root / ".dockerenv").exists():
        return "docker"
    if (root / "run/.containerenv").exists():
        return "podman"
    try:
        cgroups = (root / "proc/1/cgroup").read_text(errors="replace").lower()
    except OSError:
        return None
    return next((runtime for hint, runtime in _CONTAINER_HINTS if hint in cgroups), None)


def probe_interfaces() -> tuple[NetInterface, ...]:
    """Every network interface psutil sees, sorted by name."""
    stats = psutil.net_if_stats()
    interfaces = []
    for name, addresses in sorted(psutil.net_if_addrs().items()):
        ipv4 = tuple(a.address for a in addresses if a.family == socket.AF_INET)
        ipv6 = tuple(a.address.split("%", 1)[0] for a in addresses if a.family == socket.AF_INET6)
        loopback = any(_ip(address).is_loopback for address in ipv4 + ipv6)
        is_up = bool(stats[name].isup) if name in stats else False
        interfaces.append(NetInterface(name, ipv4, ipv6, is_up, loopback or name in ("lo", "lo0")))
    return tuple(interfaces)


def _ip(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The parsed address; text psutil reports that is no IP address counts as unspecified."""
    try:
        return ipaddress.ip_address(address)
    except ValueError:
        return ipaddress.ip_address("0.0.0.0")


#: documentation addresses (RFC 5737, RFC 3849): a route toward them is the default route
_DEFAULT_ROUTE_PROBES = ((socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "2001:db8::1"))


def default_route_interface() -> str | None:
    """The interface the default route leaves by (IPv4's, else IPv6's): the source address of a
    UDP socket connected toward a documentation address (the kernel picks the route; nothing
    is sent). None without a default route."""
    for family, address in _DEFAULT_ROUTE_PROBES:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as sock:
                sock.connect((address, 9))
                source = sock.getsockname()[0]
        except OSError:
            continue
        name = interface_of(source)
        if name is not None:
            return name
    return None


def interface_speed_mbit(name: str) -> int | None:
    """The rated speed of this host's interface ``name`` in Mbit/s, as its driver reports it
    (None: unknown, as for loopback and most WiFi drivers, or no such interface). A ceiling,
    not a measurement: the path to another node may be slower."""
    stats = psutil.net_if_stats().get(name)
    speed = getattr(stats, "speed", 0)
    return speed if isinstance(speed, int) and speed > 0 else None


def interface_of(address: str) -> str | None:
    """The name of this host's interface that holds ``address`` (None: none does)."""
    wanted = _ip(address.split("%")[0])
    for name, addresses in psutil.net_if_addrs().items():
        for entry in addresses:
            if entry.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                if _ip(entry.address.split("%")[0]) == wanted:
                    return name
            except ValueError:
                continue
    return None
