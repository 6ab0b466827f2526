"""A rank started twice is a UsageError naming both processes; re-inits and restarts after a crash still work.

Real processes on 127.0.0.1 meet through a ``file://`` store (which lives
while a group starts) or through a TCPStore the test hosts (one that
outlives the startup, as torchrun's agent store does, passed as
``store=``). The test reads the store too and waits for what it needs (a
claim, a rank's "up") instead of sleeping. In-process cases plant a claim of another process (the test's
parent, which is alive; a recycled pid; another host) in a HashStore.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

import gradcoll
from gradcoll.errors import CollectiveTimeout, UsageError
from gradcoll.group import _claims, rendezvous
from gradcoll.store import FileStore, HashStore, PrefixStore, TCPStore
from gradcoll.testing import gather_ranks

pytestmark = pytest.mark.timeout(90)

HOST = socket.gethostname()

_RANK = textwrap.dedent("""
    import json, sys
    import numpy as np
    from gradcoll.errors import GradcollError
    from gradcoll.group.rendezvous import init_process_group
    from gradcoll.store import TCPStore

    where, rank, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    say = lambda **kw: print(json.dumps(kw), flush=True)
    for _ in range(rounds):
        try:
            if where.isdigit():  # the port of the test's TCPStore, which outlives every group
                store = TCPStore("127.0.0.1", int(where), timeout=30)
                g = init_process_group("tcp", rank=rank, world_size=2, timeout=30, startup_timeout=30, store=store)
                store.close()
            else:
                g = init_process_group("tcp", f"file://{where}", rank, 2, timeout=30, startup_timeout=30)
        except GradcollError as exc:
            say(error=type(exc).__name__, message=str(exc))
            sys.exit(0)
        say(up=rank)
        sys.stdin.readline()
        say(sum=float(g.allreduce(np.full(4, rank + 1.0), op="sum")[0]))
        sys.stdin.readline()
        g.close()
""")


class _Rank:
    """One rank process: its lines on stdout come through a queue (every wait bounded); ``go`` lets it on."""

    def __init__(self, path: Path | int, rank: int, rounds: int = 1) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("GRADCOLL_SECRET", "GRADCOLL_STARTUP_TIMEOUT")}
        self.p = subprocess.Popen([sys.executable, "-c", _RANK, str(path), str(rank), str(rounds)], env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.pid = self.p.pid
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.put(line)

    def line(self) -> dict[str, Any]:
        try:
            got: dict[str, Any] = json.loads(self.lines.get(timeout=45))
        except queue.Empty:
            raise AssertionError(f"pid {self.pid} said nothing within 45 s") from None
        return got

    def go(self) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write("\n")
        self.p.stdin.flush()

    def end(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.communicate(timeout=30)


def _twice(first: _Rank, second: _Rank) -> str:
    return (f"rank 1 joined twice: from host {HOST} pid {first.pid} and host {HOST} pid {second.pid}, both alive, "
            "against the same rendezvous store")


@pytest.mark.scenario("rank 1 started twice while its group starts", raised="UsageError")
def test_a_second_process_as_rank_1_fails_every_rank_of_a_group_still_starting(tmp_path: Path) -> None:
    path = tmp_path / "store"
    store = FileStore(str(path), timeout=30)
    ranks = [_Rank(path, 1)]
    try:
        store.get("gradcoll/claims/1/1", 30)  # the first rank 1 has claimed its seat and waits for rank 0
        ranks.append(_Rank(path, 1))
        dup = ranks[1].line()
        ranks.append(_Rank(path, 0))  # rank 0 comes late, after the veto
        got = [ranks[0].line(), dup, ranks[2].line()]
    finally:
        for r in ranks:
            r.end()
    want = _twice(ranks[0], ranks[1])
    assert [g["error"] for g in got] == ["UsageError"] * 3, got
    assert got[1]["message"].startswith(want), got[1]
    assert got[0]["message"].startswith(f"rank 1: {want}"), got[0]
    assert got[2]["message"].startswith(f"rank 0: {want}"), got[2]
    assert store.add("gradcoll/calls/1", 0) == 1  # the duplicate gave its generation back
    store.close()


@pytest.fixture
def master() -> Any:
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=30)
    yield store
    store.close()


@pytest.mark.scenario("rank 1 started twice after its group runs", raised="UsageError")
def test_a_second_process_as_rank_1_fails_alone_once_the_group_runs(master: TCPStore) -> None:
    path = master.port
    ranks = [_Rank(path, 0), _Rank(path, 1)]
    try:
        assert [r.line() for r in ranks] == [{"up": 0}, {"up": 1}]  # the group has started
        dup = _Rank(path, 1)
        ranks.append(dup)
        got = dup.line()
        for r in ranks[:2]:
            r.go()
        sums = [r.line() for r in ranks[:2]]
        for r in ranks[:2]:
            r.go()
    finally:
        for r in ranks:
            r.end()
    assert got["error"] == "UsageError" and got["message"].startswith(_twice(ranks[1], dup)), got
    assert got["message"].endswith(f"the group host {HOST} pid {ranks[1].pid} belongs to had finished its startup "
                                   "and goes on without this process"), got
    assert sums == [{"sum": 3.0}, {"sum": 3.0}]  # the running group is unharmed
    assert master.add("gradcoll/calls/1", 0) == 1  # the duplicate gave its generation back


def test_a_rank_restarted_after_a_crash_and_a_re_init_in_one_process_meet_again(master: TCPStore) -> None:
    path = master.port
    r0, r1 = _Rank(path, 0, rounds=2), _Rank(path, 1)
    ranks = [r0, r1]
    try:
        assert [r0.line(), r1.line()] == [{"up": 0}, {"up": 1}]
        r0.go()
        r1.go()
        assert [r0.line(), r1.line()] == [{"sum": 3.0}, {"sum": 3.0}]
        os.kill(r1.pid, signal.SIGKILL)  # rank 1 crashes with its group open
        os.waitid(os.P_PID, r1.pid, os.WEXITED | os.WNOWAIT)  # dead, and left a zombie: it still has its pid
        r0.go()  # rank 0 closes its group and starts a second one, in the same process
        r1b = _Rank(path, 1)
        ranks.append(r1b)
        assert [r0.line(), r1b.line()] == [{"up": 0}, {"up": 1}]
        r0.go()
        r1b.go()
        assert [r0.line(), r1b.line()] == [{"sum": 3.0}, {"sum": 3.0}]
        r0.go()
        r1b.go()
        # both started their second generation of the store, and the new rank 1 claimed it in the dead one's place
        assert [master.add(f"gradcoll/calls/{r}", 0) for r in (0, 1)] == [2, 2]
        assert _claims.Claim.decode(master.get("gradcoll/claims/1/2"), "k").pid == r1b.pid
    finally:
        for r in ranks:
            r.end()


def _plant(store: HashStore, rank: int, claim: _claims.Claim) -> None:
    """A claim of ``rank``'s first start, as another process would have written it."""
    base = PrefixStore("gradcoll", store)
    assert base.add(f"calls/{rank}", 1) == 1
    base.set(f"claims/{rank}/1", claim.encode())


def _parent(**change: Any) -> _claims.Claim:
    me, ppid = _claims.Claim.here(), os.getppid()
    fields = {"host": me.host, "pidns": me.pidns, "pid": ppid, "started": _claims._stat(ppid)[1], "token": "f" * 16}
    return _claims.Claim(**{**fields, **change})


def test_a_live_process_of_this_host_holding_the_rank_vetoes_the_waiting_group() -> None:
    store = HashStore(timeout=30)
    _plant(store, 1, _parent())  # the parent process is alive: it "is" rank 1 of generation 1

    def rank(r: int) -> None:
        gradcoll.init_process_group("inproc", rank=r, world_size=2, store=store, startup_timeout=30)

    _, errors = gather_ranks(rank, 2, join_timeout=40)
    want = f"rank 1 joined twice: from host {HOST} pid {os.getppid()} and host {HOST} pid {os.getpid()}, both alive"
    assert isinstance(errors[1], UsageError) and str(errors[1]).startswith(want), errors[1]
    assert isinstance(errors[0], UsageError) and str(errors[0]).startswith(f"rank 0: {want}"), errors[0]


@pytest.mark.parametrize("claim", ["recycled pid", "same process"])
def test_no_duplicate_for_a_recycled_pid_or_a_re_init_of_this_process(claim: str) -> None:
    store = HashStore(timeout=30)
    planted = _parent(started="1") if claim == "recycled pid" else _claims.Claim.here()
    _plant(store, 1, planted)
    _plant(store, 0, _claims.Claim.here())  # rank 0's first start is behind it too, in this process

    def rank(r: int) -> int:
        g = gradcoll.init_process_group("inproc", rank=r, world_size=2, store=store, startup_timeout=30)
        g.close()
        return r

    assert gather_ranks(rank, 2, join_timeout=40) == ([0, 1], [None, None])


def test_a_claim_from_another_host_is_named_in_the_progress_log_and_the_timeout(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(rendezvous, "PROGRESS_S", 0.2)
    caplog.set_level(logging.WARNING, logger="gradcoll")
    store = HashStore(timeout=10)
    _plant(store, 1, _parent(host="elsewhere", pid=4242))
    with pytest.raises(CollectiveTimeout) as info:
        gradcoll.init_process_group("inproc", rank=1, world_size=2, store=store, startup_timeout=1.0)
    note = "rank 1 was also claimed by host elsewhere pid 4242: was it started twice?"
    assert "rank(s) 0 never arrived" in str(info.value) and str(info.value).endswith(note), info.value
    waits = [r.getMessage() for r in caplog.records if "waiting for rank(s) 0" in r.getMessage()]
    assert waits and waits[0].endswith(f"; {note}"), waits


def test_a_malformed_claim_is_a_protocol_error() -> None:
    store = HashStore(timeout=10)
    base = PrefixStore("gradcoll", store)
    base.add("calls/1", 1)
    base.set("claims/1/1", b"\xff not a claim")
    with pytest.raises(gradcoll.ProtocolError, match="store key 'claims/1/1' holds .* not a rank's claim"):
        gradcoll.init_process_group("inproc", rank=1, world_size=2, store=store, startup_timeout=2.0)
