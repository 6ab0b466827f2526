"""The shm window's attach proves the group's secret: a forged window file is refused before anything is written.

Ranks are threads over real shm transports (segments in a temporary
directory, so the test can also see that nothing is left behind); the
window file is the real one rank 0 creates, or one a forger puts in its
place under the name rank 0 announces.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gradcoll import _auth, testing
from gradcoll.errors import ProtocolError
from gradcoll.testing import gather_ranks
from gradcoll.transport import shm, window_shm
from gradcoll.transport.window import WINDOW_TAG, init_header, plan

pytestmark = pytest.mark.timeout(60)

SLOT = 1 << 12


@pytest.fixture(autouse=True)
def _no_env_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_auth.ENV, raising=False)


def _group(size: int, directory: Path, secret: str | None = "k") -> list[Any]:
    return testing.threaded_group(shm.create, size, timeout=20, ring_bytes=1 << 16, shm_dir=str(directory),
                                  secret=secret)


def _close(ts: list[Any]) -> None:
    for t in ts:
        t.close()


def _windows(ts: list[Any], timeout: float = 5.0) -> tuple[list[Any], list[BaseException | None]]:
    return gather_ranks(lambda r: ts[r].window(SLOT, timeout), len(ts), join_timeout=30)


def test_windows_of_a_group_with_a_secret_work_and_hold_every_ranks_proof(tmp_path: Path) -> None:
    ts = _group(3, tmp_path)
    try:
        ws, errors = _windows(ts)
        assert errors == [None, None, None]
        for r, w in enumerate(ws):
            w.slot(r)[:8] = np.arange(8, dtype=np.uint8) + 10 * r
        for w in ws:  # one mapping: every rank reads what every other wrote
            for r in range(3):
                assert list(w.slot(r)[:8]) == [10 * r + i for i in range(8)]
        page = bytes(np.asarray(ws[0].u8[window_shm.PROOF_AT : window_shm.PROOF_AT + 32 * 3]))
        assert all(page[32 * r : 32 * r + 32] != bytes(32) for r in range(3))  # rank 0's proof and both peers'
        assert sorted(os.listdir(tmp_path)) == []  # segments and window unlinked once mapped
    finally:
        _close(ts)


@pytest.mark.scenario("forged shm window file under the announced name", raised="ProtocolError")
def test_a_forged_window_file_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """Rank 1 is told a window name over its (authenticated) link, but the file under it has no proof."""
    ts = _group(2, tmp_path)
    total = plan(2, SLOT)[0]
    name = f"{shm.PREFIX}{os.getpid()}-abcdefabcdef-w"
    path = tmp_path / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # the right name, owner, mode and size
    os.ftruncate(fd, total)
    forged = bytearray(total)
    init_header(forged, 2, SLOT)  # a valid layout: only the proof is missing
    os.write(fd, forged)
    os.close(fd)
    answer: dict[str, tuple[str, str]] = {}

    def rank(r: int) -> Any:
        if r == 1:
            return ts[1].window(SLOT, 5.0)
        ts[0].send(1, window_shm._message("OK", f"{socket.gethostname()} {name} {total}"), WINDOW_TAG, 5.0)
        answer["rank 1"] = window_shm._parse(window_shm._recv(ts[0], 1, window_shm.Deadline(5.0)))
        ts[0].send(1, window_shm._message("ER", "set-up abandoned"), WINDOW_TAG, 5.0)
        return None

    try:
        _, errors = gather_ranks(rank, 2, join_timeout=30)
        assert errors[0] is None, errors[0]
        err = errors[1]
        assert isinstance(err, ProtocolError), err
        assert (err.rank, err.peer) == (1, 0)
        assert f"rank 1: refused window {name}: it does not hold rank 0's proof of the group's secret" in str(err)
        assert answer["rank 1"][0] == "PR" and "does not hold rank 0's proof" in answer["rank 1"][1]
        assert path.read_bytes() == bytes(forged)  # no pid, no proof, no data: not one byte written into it
    finally:
        _close(ts)


@pytest.mark.scenario("shm window of a rank with another secret", raised="ProtocolError")
def test_a_rank_with_another_secret_refuses_rank_0s_window_and_rank_0_names_it(tmp_path: Path) -> None:
    ts = _group(3, tmp_path)
    ts[2].secret = b"another secret"
    try:
        _, errors = _windows(ts)
        assert all(isinstance(e, ProtocolError) for e in errors), errors
        assert (errors[2].rank, errors[2].peer) == (2, 0)  # type: ignore[union-attr]
        assert "does not hold rank 0's proof of the group's secret" in str(errors[2])
        assert errors[0].peer == 2 and str(errors[0]).startswith(  # type: ignore[union-attr]
            "rank 0: the window could not be set up: rank 2: refused window"), errors[0]
        assert str(errors[1]).startswith("rank 1: the window could not be set up: rank 2: refused window")
        assert os.listdir(tmp_path) == []
    finally:
        _close(ts)


def test_rank_0_refuses_a_rank_that_attached_without_proving_the_secret(tmp_path: Path) -> None:
    ts = _group(2, tmp_path)
    ts[1].secret = None  # attaches without checking or proving anything
    try:
        _, errors = _windows(ts)
        assert isinstance(errors[0], ProtocolError) and errors[0].peer == 1, errors[0]
        assert "rank 1: the process that attached to window" in str(errors[0])
        assert "as rank 1 did not prove the group's secret: refused" in str(errors[0])
        assert isinstance(errors[1], ProtocolError), errors[1]
        assert os.listdir(tmp_path) == []
    finally:
        _close(ts)


def test_without_a_secret_nothing_is_proved_and_windows_work(tmp_path: Path) -> None:
    ts = _group(2, tmp_path, secret=None)
    try:
        ws, errors = _windows(ts)
        assert errors == [None, None]
        page = bytes(np.asarray(ws[0].u8[window_shm.PROOF_AT : window_shm.PROOF_AT + 64]))
        assert page == bytes(64)
    finally:
        _close(ts)


def test_a_malformed_announcement_is_a_protocol_error_on_both_sides(tmp_path: Path) -> None:
    ts = _group(2, tmp_path, secret=None)
    answer: list[tuple[str, str]] = []

    def rank(r: int) -> Any:
        if r == 1:
            return ts[1].window(SLOT, 5.0)
        ts[0].send(1, window_shm._message("OK", "only-two words"), WINDOW_TAG, 5.0)
        answer.append(window_shm._parse(window_shm._recv(ts[0], 1, window_shm.Deadline(5.0))))
        ts[0].send(1, window_shm._message("ER", "set-up abandoned"), WINDOW_TAG, 5.0)
        return None

    try:
        _, errors = gather_ranks(rank, 2, join_timeout=30)
        assert errors[0] is None and isinstance(errors[1], ProtocolError), errors
        assert "rank 0 announced the window as 'only-two words', not 'host name bytes'" in str(errors[1])
        assert answer[0][0] == "PR"
    finally:
        _close(ts)


def test_the_direct_allreduce_of_a_group_with_a_secret_runs_on_a_proven_window(tmp_path: Path) -> None:
    from gradcoll.algorithms.direct import direct_allreduce

    ts = _group(3, tmp_path)
    data = [np.arange(1000, dtype=np.float32) * (r + 1) for r in range(3)]
    try:
        out, errors = gather_ranks(lambda r: direct_allreduce(ts[r], data[r].copy(), op="sum", seq=1), 3)
        assert errors == [None, None, None]
        for o in out:
            np.testing.assert_array_equal(o, np.arange(1000, dtype=np.float32) * 6)
    finally:
        _close(ts)
