"""Startup mistakes are clear errors within seconds: world-size disagreements, a port in use, a stranger
on the rendezvous port, no launcher; and a waiting rank says who has joined."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import gradcoll
from gradcoll.cli.launch import free_port
from gradcoll.errors import CollectiveTimeout, ProtocolError, UsageError
from gradcoll.group import rendezvous
from gradcoll.store import HashStore, TCPStore
from gradcoll.testing import gather_ranks

pytestmark = pytest.mark.timeout(60)

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK",
                  "PMI_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "GRADCOLL_STARTUP_TIMEOUT")


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in _LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)


def test_launched_world_size_argument_that_disagrees_with_the_launcher_fails_at_once(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import gradcoll
        gradcoll.init_process_group("tcp", world_size=3)
    """))
    env = {**os.environ, "GRADCOLL_STARTUP_TIMEOUT": "300"}  # an answer before the test's 60 s is not a timeout
    r = subprocess.run([sys.executable, "-m", "gradcoll", "launch", "-n", "2", str(script)], capture_output=True,
                       text=True, timeout=50, env=env)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "UsageError: world size mismatch" in out, out
    assert "world_size=3" in out and "WORLD_SIZE=2" in out, out


def test_ranks_given_different_world_sizes_all_raise_naming_both() -> None:
    store = HashStore(timeout=30)
    sizes = {0: 2, 1: 3}

    def rank(r: int) -> None:
        gradcoll.init_process_group("inproc", rank=r, world_size=sizes[r], store=store, startup_timeout=30)

    _, errors = gather_ranks(rank, 2, join_timeout=40)
    assert len(errors) == 2
    for e in errors:
        assert isinstance(e, UsageError), e
        assert "world size mismatch" in str(e)
        assert "given 2 (argument world_size=2)" in str(e) and "given 3 (argument world_size=3)" in str(e)


def test_a_waiting_rank_logs_who_has_joined_then_names_who_never_came(monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(rendezvous, "PROGRESS_S", 0.2)
    caplog.set_level(logging.WARNING, logger="gradcoll")
    with pytest.raises(CollectiveTimeout) as info:
        gradcoll.init_process_group("inproc", rank=1, world_size=3, store=HashStore(timeout=5), startup_timeout=1.0)
    msg = str(info.value)
    assert "startup timed out after 1s: 1 of 3 ranks joined (1); rank(s) 0, 2 never arrived" in msg, msg
    assert info.value.missing == [0, 2]
    waits = [r.getMessage() for r in caplog.records if "waiting for rank(s)" in r.getMessage()]
    assert waits and "rank 1: waiting for rank(s) 0, 2 to join (1 of 3 here: 1)" in waits[0], waits


def test_the_default_startup_timeout_fits_startup(monkeypatch: pytest.MonkeyPatch) -> None:
    assert rendezvous._startup_timeout(None, 300.0) == rendezvous.DEFAULT_STARTUP_TIMEOUT == 60.0
    assert rendezvous._startup_timeout(None, 10.0) == 10.0  # never longer than the collectives' timeout
    monkeypatch.setenv("GRADCOLL_STARTUP_TIMEOUT", "120")
    assert rendezvous._startup_timeout(None, 300.0) == 120.0
    monkeypatch.setenv("GRADCOLL_STARTUP_TIMEOUT", "soon")
    with pytest.raises(UsageError, match="GRADCOLL_STARTUP_TIMEOUT"):
        rendezvous._startup_timeout(None, 300.0)


def test_port_in_use_names_the_address_and_the_remedy() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(UsageError) as info:
            gradcoll.init_process_group("inproc", f"tcp://127.0.0.1:{port}", rank=0, world_size=2,
                                        startup_timeout=5)
    msg = str(info.value)
    assert f"127.0.0.1:{port}" in msg and "already in use" in msg, msg
    assert "MASTER_PORT" in msg and "gradcoll launch" in msg, msg


@pytest.fixture(params=["http", "close", "silent"])
def stranger(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """A program on the rendezvous port that is not a gradcoll store."""
    monkeypatch.setattr("gradcoll.store.tcp.GREETING_TIMEOUT", 0.5)
    srv = socket.create_server(("127.0.0.1", 0))
    conns: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conns.append(conn)
            if request.param == "http":
                conn.recv(64)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            elif request.param == "close":
                conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    srv.close()
    for c in conns:
        c.close()


def test_a_rank_that_reaches_a_stranger_says_so_at_once(stranger: int) -> None:
    with pytest.raises(ProtocolError, match="is not a gradcoll store") as info:
        gradcoll.init_process_group("inproc", f"tcp://127.0.0.1:{stranger}", rank=1, world_size=2,
                                    startup_timeout=30)
    assert f"127.0.0.1:{stranger}" in str(info.value)


def test_a_real_store_answers_the_greeting() -> None:
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=5)
    try:
        client = TCPStore("127.0.0.1", master.port, timeout=5)
        client.set("k", b"v")
        assert master.get("k") == b"v"
        client.close()
    finally:
        master.close()


def test_without_a_launcher_the_error_says_how_to_start_ranks() -> None:
    with pytest.raises(UsageError) as info:
        gradcoll.init_process_group("inproc")
    msg = str(info.value)
    for needle in ("gradcoll launch -n N script.py", "RANK", "WORLD_SIZE", "MASTER_ADDR", "rank= and world_size="):
        assert needle in msg, msg


def test_store_timeouts_are_rounded() -> None:
    with pytest.raises(CollectiveTimeout, match=r"was not set within 0\.2s$"):
        HashStore().get("never", timeout=0.2)


def test_world_size_is_the_size() -> None:
    with gradcoll.init_process_group("inproc", rank=0, world_size=1, store=HashStore(5)) as g:
        assert (g.rank, g.size, g.world_size) == (0, 1, 1)


def test_free_port_is_bindable() -> None:
    with socket.create_server(("127.0.0.1", free_port())):
        pass
