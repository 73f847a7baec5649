"""Host survey: tool versions, container/WSL detection and a real probe of this machine."""

from __future__ import annotations

import dataclasses
import os
import stat
import sys
from pathlib import Path

import pytest

from fdl.system.host import (
    TOOLS,
    NetInterface,
    detect_container,
    detect_wsl,
    parse_tool_version,
    probe_host,
    probe_tools,
)

NVCC = """\
nvcc: NVIDIA (R) Cuda compiler driver
Copyright (c) 2005-2025 NVIDIA Corporation
Built on Fri_Feb_21_20:23:50_PST_2025
Cuda compilation tools, release 12.8, V12.8.93
Build cuda_12.8.r12.8/compiler.35583870_0
"""
CMAKE = (
    "cmake version 3.25.1\n\nCMake suite maintained and supported by Kitware (kitware.com/cmake).\n"
)
GCC = """\
gcc (Debian 12.2.0-14+deb12u1) 12.2.0
Copyright (C) 2022 Free Software Foundation, Inc.
This is free software; see the source for copying conditions.  There is NO
warranty; not even for MERCHANTABILITY or FITNESS FOR A PARTICULAR PURPOSE.
"""
APPLE_GCC = """\
Apple clang version 15.0.0 (clang-1500.3.9.4)
Target: arm64-apple-darwin23.5.0
Thread model: posix
InstalledDir: /Library/Developer/CommandLineTools/usr/bin
"""


@pytest.mark.parametrize(
    ("name", "output", "version"),
    [
        ("nvcc", NVCC, "12.8"),
        ("nvcc", "Cuda compilation tools, release 13.0, V13.0.88\n", "13.0"),
        ("cmake", CMAKE, "3.25.1"),
        ("cmake", "cmake version 3.31.6\n", "3.31.6"),
        ("ninja", "1.11.1\n", "1.11.1"),
        ("ninja", "1.11.1.git.kitware.jobserver-1\n", "1.11.1"),
        ("gcc", GCC, "12.2.0"),
        ("gcc", "gcc (GCC) 11.4.1 20231218 (Red Hat 11.4.1-3)\n", "11.4.1"),
        ("gcc", "gcc (Ubuntu 11.4.0-1ubuntu1~22.04) 11.4.0\n", "11.4.0"),
        ("gcc", APPLE_GCC, "15.0.0"),
        ("git", "git version 2.39.5\n", "2.39.5"),
        ("git", "git version 2.39.3 (Apple Git-146)\n", "2.39.3"),
        ("git", "git version 2.45.1.windows.1\n", "2.45.1"),
        ("docker", "Docker version 28.2.2, build e6534b4\n", "28.2.2"),
        ("docker", "Docker version 24.0.7, build 24.0.7-0ubuntu2~22.04.1\n", "24.0.7"),
        ("docker", "podman version 4.9.3\n", "4.9.3"),
        ("mytool", "mytool 0.4.2 (built today)\n", "0.4.2"),
        ("cmake", "cmake: command broken\n", None),
        ("git", "", None),
    ],
)
def test_parse_tool_version(name: str, output: str, version: str | None) -> None:
    assert parse_tool_version(name, output) == version


def _executable(directory: Path, name: str, body: str) -> Path:
    path = directory / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_probe_tools_reports_found_missing_and_hung_tools(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cmake = _executable(tmp_path, "cmake", 'echo "cmake version 3.31.6"\n')
    ninja = _executable(tmp_path, "ninja", "exec sleep 5\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    tools = probe_tools(names=("cmake", "ninja", "gcc"), timeout_s=0.5)
    assert [(t.name, t.version, t.path) for t in tools] == [
        ("cmake", "3.31.6", str(cmake)),
        ("ninja", None, str(ninja)),  # found, but no version within the timeout
        ("gcc", None, None),  # not found
    ]


def test_detect_container_from_marker_files_and_cgroups(tmp_path: Path) -> None:
    assert detect_container(root=tmp_path) is None
    (tmp_path / "proc/1").mkdir(parents=True)
    (tmp_path / "proc/1/cgroup").write_text("0::/\n")
    assert detect_container(root=tmp_path) is None
    (tmp_path / "proc/1/cgroup").write_text("12:cpu:/kubepods/besteffort/pod1f2e/docker-3a4b\n")
    assert detect_container(root=tmp_path) == "kubernetes"
    (tmp_path / "proc/1/cgroup").write_text("1:name=systemd:/lxc/ubuntu-box\n")
    assert detect_container(root=tmp_path) == "lxc"
    (tmp_path / "run").mkdir()
    (tmp_path / "run/.containerenv").write_text("")
    assert detect_container(root=tmp_path) == "podman"
    (tmp_path / ".dockerenv").write_text("")
    assert detect_container(root=tmp_path) == "docker"


def test_detect_wsl_reads_proc_version(tmp_path: Path) -> None:
    assert detect_wsl(root=tmp_path) is False
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/version").write_text("Linux version 6.8.0-49-generic (buildd@lcy02-amd64)\n")
    assert detect_wsl(root=tmp_path) is False
    (tmp_path / "proc/version").write_text(
        "Linux version 5.15.167.4-microsoft-standard-WSL2 (root@f9c826d3017f) (gcc (GCC) 11.2.0)\n"
    )
    assert detect_wsl(root=tmp_path) is True


@pytest.fixture(scope="module")
def host():
    return probe_host()


def test_probe_host_on_this_machine_is_sane(host) -> None:
    assert host.logical_cores >= 1
    assert host.physical_cores is None or 1 <= host.physical_cores <= host.logical_cores
    assert host.ram_mib > 0
    assert host.cpu_model
    assert host.os_name and host.kernel and host.machine and host.os_release
    assert host.python_executable == sys.executable
    assert host.python_version == ".".join(map(str, sys.version_info[:3]))


def test_probe_host_lists_every_tool_with_consistent_fields(host) -> None:
    assert tuple(tool.name for tool in host.tools) == TOOLS
    for tool in host.tools:
        if tool.path is None:
            assert tool.version is None
        else:
            assert os.access(tool.path, os.X_OK)


def test_probe_host_finds_the_loopback_interface(host) -> None:
    loopback = [nic for nic in host.interfaces if nic.is_loopback]
    assert loopback
    assert any("127.0.0.1" in nic.ipv4 for nic in loopback)
    assert all(nic not in host.routable_interfaces for nic in loopback)
    assert all("%" not in address for nic in host.interfaces for address in nic.ipv6)


def test_routable_interfaces_skip_down_loopback_and_link_local_only(host) -> None:
    nics = (
        NetInterface("lo", ("127.0.0.1",), ("::1",), True, True),
        NetInterface("eth0", ("192.168.1.20",), ("fe80::1",), True, False),
        NetInterface("eth1", (), ("2001:db8::5",), True, False),
        NetInterface("docker0", ("172.17.0.1",), (), False, False),
        NetInterface("wlan0", ("169.254.7.7",), ("fe80::2",), True, False),
        NetInterface("tun0", (), (), True, False),
    )
    routable = dataclasses.replace(host, interfaces=nics).routable_interfaces
    assert [nic.name for nic in routable] == ["eth0", "eth1"]
