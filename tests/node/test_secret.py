"""The node driver with the group's secret: NodeConfig.secret / GRADCOLL_SECRET reach the store and the links.

End to end on 127.0.0.1: node processes started from their environment
(``NodeConfig.from_env``, the secret in ``GRADCOLL_SECRET``) meet through
the store rank 0 hosts and reduce; a stranger started as rank 1 without the
secret, or with another one, is refused by the store before it can take a
seat, and the real ranks finish unharmed. Threads cover the builder and an
external store.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest

from gradcoll import _auth
from gradcoll.errors import CollectiveTimeout, GradcollError, ProtocolError
from gradcoll.node import NodeConfig, connect_local
from gradcoll.store import TCPStore
from gradcoll.testing import gather_ranks

pytestmark = pytest.mark.timeout(90)

NO_SECRET = "store: add 'gradcoll/calls/1' failed: this store requires the group's secret (pass secret= or set " \
            "GRADCOLL_SECRET); request refused"

_NODE = textwrap.dedent("""
    import json, sys
    import numpy as np
    from gradcoll.errors import GradcollError
    from gradcoll.node import NodeConfig

    cfg = NodeConfig.from_env()
    try:
        g = cfg.connect(timeout=30, kernel_backend="numpy")
        out = g.allreduce(np.full(4, cfg.rank + 1.0), op="sum")
        g.close()
        print(json.dumps({"sum": out.tolist()}))
    except GradcollError as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
""")


@pytest.fixture(autouse=True)
def _no_env_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_auth.ENV, raising=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _node(rank: int, addr: str, secret: str | None) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != _auth.ENV}
    env.update(RANK=str(rank), WORLD="3", PEERS=addr)
    if secret is not None:
        env[_auth.ENV] = secret
    return subprocess.Popen([sys.executable, "-c", _NODE], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _result(p: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


@pytest.mark.scenario("stranger started as node rank 1, no or another secret", raised="GradcollError, ProtocolError", per_variant=False)
@pytest.mark.parametrize("stranger", [None, "another secret"])
def test_node_processes_with_the_secret_reduce_and_a_stranger_as_rank_1_is_refused(stranger: str | None) -> None:
    addr = f"127.0.0.1:{_free_port()}"  # one address: a star, rank 0 hosts the store there
    legit = {r: _node(r, addr, "s3cret") for r in (0, 2)}
    try:
        intruder = _result(_node(1, addr, stranger))  # while ranks 0 and 2 wait for rank 1
        legit[1] = _node(1, addr, "s3cret")  # the real rank 1, once the stranger has been turned away
        results = {r: _result(p) for r, p in legit.items()}
    finally:
        for p in legit.values():
            p.kill()
            p.communicate()
    assert results == {r: {"sum": [6.0] * 4} for r in range(3)}
    if stranger is None:
        assert intruder == {"error": "GradcollError", "message": NO_SECRET}
    else:  # the store's proof does not verify with another secret: the stranger refuses the store first
        assert intruder == {"error": "ProtocolError",
                            "message": f"store: the store at {addr} does not know the group's secret: refusing it"}


def test_from_env_reads_the_secret_and_connect_falls_back_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"RANK": "0", "WORLD": "1", _auth.ENV: "s3cret"}
    assert NodeConfig.from_env(env).shared_secret == b"s3cret"
    assert NodeConfig.from_env({"RANK": "0", "WORLD": "1"}).shared_secret is None
    assert "s3cret" not in repr(NodeConfig(0, 1).secret("s3cret"))
    assert NodeConfig(0, 1).secret(b"k").secret(None).shared_secret is None
    with pytest.raises(ValueError, match="secret must not be empty"):
        NodeConfig(0, 1).secret("")
    with pytest.raises(ValueError, match="secret must be bytes or str"):
        NodeConfig(0, 1).secret(42)  # type: ignore[arg-type]
    monkeypatch.setenv(_auth.ENV, "from-env")
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=10, secret="from-env")
    try:  # no secret() given: connect takes GRADCOLL_SECRET, which the store asks for
        group = NodeConfig(0, 1).discover(f"127.0.0.1:{master.port}", external=True).connect(timeout=10)
        assert group.allreduce(np.full(2, 4.0), op="sum").tolist() == [4.0, 4.0]
        group.close()
    finally:
        master.close()


def test_an_external_store_refuses_a_node_without_the_secret_and_the_other_names_the_missing_rank() -> None:
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=10, secret="s3cret")
    addr = f"127.0.0.1:{master.port}"
    secrets = {0: "s3cret", 1: None}  # rank 1 alone has none: the group cannot form

    def rank(r: int) -> Any:
        cfg = NodeConfig(r, 2).discover(addr, external=True)
        return cfg.secret(secrets[r]).connect(timeout=3, kernel_backend="numpy")

    try:
        _, errors = gather_ranks(rank, 2, join_timeout=30)
    finally:
        master.close()
    assert type(errors[1]) is GradcollError, errors[1]
    assert str(errors[1]) == NO_SECRET.replace("'gradcoll/", "'gradcoll-node/default/gradcoll/")
    assert isinstance(errors[0], CollectiveTimeout) and errors[0].missing == [1], errors[0]
    assert "1 of 2 ranks joined (0); rank(s) 1 never arrived" in str(errors[0])


def test_connect_local_with_a_secret() -> None:
    groups = connect_local(2, secret="s3cret", timeout=10)
    try:
        out, errors = gather_ranks(lambda r: groups[r].allreduce(np.full(3, r + 1.0), op="sum"), 2)
        assert errors == [None, None] and all(o.tolist() == [3.0] * 3 for o in out)
    finally:
        for g in groups:
            g.close()


def test_a_wrong_secret_against_an_external_store_is_a_protocol_error_at_once() -> None:
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=10, secret="s3cret")
    try:
        with pytest.raises(ProtocolError, match="does not know the group's secret: refusing it"):
            NodeConfig(0, 2).discover(f"127.0.0.1:{master.port}", external=True).secret("wrong").connect(5)
        assert not master.check(["gradcoll-node/default/gradcoll/calls/0"])  # it never reached the store's keys
    finally:
        master.close()
