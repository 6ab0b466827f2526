"""``gradcoll._util``: the bottom layer's deadline and exact socket reads."""

from __future__ import annotations

import socket

import pytest

from gradcoll._util import Deadline, recv_exact, recv_upto


def test_deadline_counts_down_and_never_goes_negative() -> None:
    d = Deadline(60.0)
    left = d.remaining()
    assert left is not None and 59.0 < left <= 60.0 and not d.expired()
    past = Deadline(-1.0)  # already passed: remaining() stays at 0
    assert past.remaining() == 0.0 and past.expired()
    forever = Deadline(None)
    assert forever.remaining() is None and not forever.expired()


def test_recv_exact_reads_across_short_reads_and_names_what_was_cut() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"abc")
        a.sendall(b"defg")
        assert recv_exact(b, 7, "greeting") == b"abcdefg"
        a.sendall(b"xy")
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(ConnectionError, match="closed during the greeting after 2 of 5 bytes"):
            recv_exact(b, 5, "greeting")


def test_recv_upto_returns_what_came_before_the_close() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"12")
        a.shutdown(socket.SHUT_WR)
        assert recv_upto(b, 10) == b"12"
        assert recv_upto(b, 10) == b""
