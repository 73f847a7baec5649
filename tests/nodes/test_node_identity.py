"""A node's identity (fdl.launch.network.node_identity): the same from one launch to the next
on one machine and network stack, whatever its address, and another in a network namespace
beside it (a second node on one host, as tests/nodes builds them, or a container)."""

from __future__ import annotations

import subprocess
import sys

from helpers import clean_env
from netns import need_namespaces, two_nodes

PROBE = [sys.executable, "-c",
         "from fdl.launch.network import node_identity; print(node_identity())"]


def identity(argv: list[str]) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, env=clean_env(), timeout=120,
                          check=True)
    return proc.stdout.strip()


def test_a_node_is_named_alike_across_launches_and_apart_from_the_nodes_beside_it():
    need_namespaces()
    here = [identity(PROBE), identity(PROBE)]
    assert here[0] == here[1] and here[0] != "None"
    with two_nodes() as nodes:
        there = [identity(node.command(PROBE)) for node in nodes]
        again = identity(nodes[0].command(PROBE))
    assert len({here[0], *there}) == 3
    assert again == there[0]
