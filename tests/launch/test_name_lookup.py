"""A name lookup on fdl run's path ends in a bounded time, whatever the resolver does. The
resolver is the boundary mocked here (no DNS server to lose on this machine): getaddrinfo is
made to block until the test releases it, as a resolver whose server is gone would."""

from __future__ import annotations

import socket
import threading

import pytest

from fdl.errors import UsageError
from fdl.launch import network, rendezvous


@pytest.fixture
def silent_resolver(monkeypatch):
    release = threading.Event()
    real = socket.getaddrinfo

    def blocked(host, *args, **kwargs):
        if host in ("localhost", "127.0.0.1"):
            return real(host, *args, **kwargs)
        release.wait(60)  # then an answer, too late: loopback, as on this machine
        return real("localhost", *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", blocked)
    yield
    release.set()


def test_a_silent_resolver_gives_up_within_the_bound(silent_resolver):
    assert rendezvous.resolve_within("node0.lan", 29400, timeout_s=0.2) == {}
    with pytest.raises(UsageError, match=r"cannot resolve the rendezvous host 'node0.lan' "
                                         r"\(no answer in 0.2 s\)"):
        rendezvous.lookup_host("node0.lan", 29400, timeout_s=0.2)


def test_this_hosts_name_on_a_silent_resolver_is_no_loopback_warning(silent_resolver,
                                                                      monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "box.lan")
    monkeypatch.setattr(network, "LOOKUP_TIMEOUT_S", 0.2)
    assert network.hostname_on_loopback() is False


def test_a_name_that_resolves_is_found_and_one_that_does_not_says_why():
    found = rendezvous.resolve_within("localhost", 29400, timeout_s=30)
    assert found["infos"] and "error" not in found
    assert rendezvous.lookup_host("127.0.0.1", 29400)[1][:2] == ("127.0.0.1", 29400)
    with pytest.raises(UsageError, match="cannot resolve the rendezvous host"):
        rendezvous.lookup_host("no-such-host.invalid", 29400, timeout_s=30)
