"""The congestion control of tcp links: reno on one host, the system's elsewhere, GRADCOLL_TCP_CONGESTION on all."""

from __future__ import annotations

import socket

import pytest

from gradcoll.errors import UsageError
from gradcoll.store import HashStore
from gradcoll.testing import threaded_group
from gradcoll.transport import tcp, tcp_connect

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not hasattr(socket, "TCP_CONGESTION"), reason="TCP_CONGESTION is Linux's")]


def _kernel_takes(name: str) -> bool:
    with socket.socket() as s:
        try:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
        except OSError:
            return False
    return True


needs_reno = pytest.mark.skipif(not hasattr(socket, "TCP_CONGESTION") or not _kernel_takes("reno"),
                                reason="this kernel does not let a socket choose reno (TCP_CONGESTION)")


def _cc(sock: socket.socket) -> str:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(b"\0")[0].decode()


def _system_default() -> str:
    with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
        return f.read().strip()


def test_which_links_get_which_congestion_control(monkeypatch) -> None:
    monkeypatch.delenv("GRADCOLL_TCP_CONGESTION", raising=False)
    local = tcp_connect.LOCAL_CONGESTION
    assert tcp_connect.congestion("127.0.0.1") == local
    assert tcp_connect.congestion("127.0.0.2") == local
    assert tcp_connect.congestion("::1") == local
    assert tcp_connect.congestion("localhost") == local
    assert tcp_connect.congestion("10.0.0.2", "10.0.0.2") == local  # both ranks on the host of that address
    assert tcp_connect.congestion("10.0.0.2", "10.0.0.1") is None  # another host: the system's choice
    assert tcp_connect.congestion("node-7") is None
    monkeypatch.setenv("GRADCOLL_TCP_CONGESTION", "cubic")
    assert tcp_connect.congestion("10.0.0.2", "10.0.0.1") == "cubic"
    assert tcp_connect.congestion("127.0.0.1") == "cubic"


@needs_reno
def test_links_on_one_host_are_not_paced(monkeypatch) -> None:
    """Both ends of every link of a loopback group run reno, whatever the system's default (BBR paces)."""
    monkeypatch.delenv("GRADCOLL_TCP_CONGESTION", raising=False)
    group = threaded_group(tcp.create, 3, timeout=10)
    try:
        for t in group:
            for link in t._peers:
                assert _cc(link.sock) == tcp_connect.LOCAL_CONGESTION, t.rank
    finally:
        for t in group:
            t.close()


def test_the_environment_names_the_congestion_control_of_every_link(monkeypatch) -> None:
    name = _system_default()  # always one a process may choose
    monkeypatch.setenv("GRADCOLL_TCP_CONGESTION", name)
    group = threaded_group(tcp.create, 2, timeout=10)
    try:
        assert [_cc(link.sock) for t in group for link in t._peers] == [name, name]
    finally:
        for t in group:
            t.close()


def test_a_congestion_control_the_kernel_refuses_is_a_usage_error_naming_the_variable(monkeypatch) -> None:
    monkeypatch.setenv("GRADCOLL_TCP_CONGESTION", "no-such-control")
    with pytest.raises(UsageError, match="GRADCOLL_TCP_CONGESTION='no-such-control': the kernel refused it"):
        tcp.create(HashStore(), 0, 2, timeout=5)  # rank 0 listens for rank 1: refused before it waits


@needs_reno
def test_the_coordinators_connections_on_one_host_are_not_paced(monkeypatch) -> None:
    """The coordinator's listener (which its accepted connections take it from) and a worker's dial run reno."""
    from gradcoll.coordinator import DistributedConfig, GradientServer
    from gradcoll.coordinator._conn import dial_once

    monkeypatch.delenv("GRADCOLL_TCP_CONGESTION", raising=False)
    server = GradientServer.bind(DistributedConfig.coordinator("127.0.0.1:0", 1, timeout_s=5.0))
    try:
        assert _cc(server._listener) == tcp_connect.LOCAL_CONGESTION
        sock = dial_once(*server.local_addr(), 5.0)
        try:
            assert _cc(sock) == tcp_connect.LOCAL_CONGESTION
        finally:
            sock.close()
    finally:
        server.close()
