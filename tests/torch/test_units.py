"""gradcoll.torch's parts in one process: the store adapter, dtype staging, errors, the launcher variables.

Skipped without PyTorch: ``pip install 'gradcoll[torch]'``.
"""

from __future__ import annotations

import time
from datetime import timedelta

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch not installed: pip install 'gradcoll[torch]' (torch==2.13.0 CPU)")

import torch.distributed as dist  # noqa: E402

import gradcoll.torch as gt  # noqa: E402
from gradcoll.errors import CollectiveTimeout, NonFiniteError, TransportBroken, UsageError  # noqa: E402
from gradcoll.group.rendezvous import _open_store, parse_init_method  # noqa: E402
from gradcoll.store.c10d import C10dStore  # noqa: E402
from gradcoll.torch._tensors import Staged, as_runtime_error  # noqa: E402
from gradcoll.torch.backend import _collective_timeout  # noqa: E402

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def master():
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10))
    yield store


def test_c10d_store_speaks_the_store_interface(master) -> None:
    s = C10dStore(dist.PrefixStore("job", master), timeout=5)
    s.set("a", b"\x00\xffbytes")
    assert s.get("a") == b"\x00\xffbytes"
    assert s.add("n", 2) == 2 and s.add("n", 3) == 5
    assert s.check(["a", "n"]) and not s.check(["a", "missing"])
    assert s.delete("a") and not s.check(["a"])
    s.wait(["n"], 1.0)
    assert master.get("job/n") == b"5"  # the keys live in torch's store, under torch's prefix
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeout, match="'never' was not set within 0.2s"):
        s.get("never", 0.2)
    assert time.monotonic() - t0 < 2


def test_c10d_store_errors_become_transport_broken() -> None:
    class Dead:
        timeout = timedelta(seconds=1)

        def check(self, keys):
            raise RuntimeError("connection reset by peer")

    with pytest.raises(TransportBroken, match="check 'k' failed in torch's store: connection reset"):
        C10dStore(Dead()).get("k")


def test_rendezvous_joins_torchruns_agent_store(master, monkeypatch) -> None:
    # torchrun's agent serves MASTER_ADDR:MASTER_PORT: rank 0 must join it, not bind the port again
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(master.port))
    store = _open_store(parse_init_method("env://"), rank=0, timeout=5)
    assert isinstance(store, C10dStore)
    store.set("hello", b"agent")
    assert master.get("hello") == b"agent"
    store.close()  # closes nothing of torch's
    assert master.check(["hello"])


def test_errors_are_runtime_errors_of_their_gradcoll_class() -> None:
    exc = as_runtime_error(CollectiveTimeout("rank 0: allreduce timed out", rank=0, missing=[2]), "dist.all_reduce")
    assert isinstance(exc, CollectiveTimeout) and isinstance(exc, RuntimeError) and isinstance(exc, TimeoutError)
    assert exc.missing == [2] and str(exc) == "rank 0: allreduce timed out (dist.all_reduce)"
    nf = as_runtime_error(NonFiniteError("rank 1: nan", contributor=1, index=3))
    assert type(nf) is gt.NonFiniteGradientError and isinstance(nf, FloatingPointError) and nf.contributor == 1
    assert gt.NonFiniteGradientError.__mro__.index(RuntimeError) > gt.NonFiniteGradientError.__mro__.index(NonFiniteError)
    other = ValueError("not ours")
    assert as_runtime_error(other) is other and type(other) is ValueError
    assert issubclass(gt.UnsupportedError, UsageError) and issubclass(gt.UnsupportedError, NotImplementedError)


def test_staging_by_dtype_and_op() -> None:
    t = torch.ones(4, dtype=torch.bfloat16)
    s = Staged(t, "mean")
    assert s.wire == "bf16" and s.array.dtype == np.uint16 and s.copy is None
    s.array[0] = 0x4000  # the view is the tensor's memory: bf16 2.0
    assert t[0].item() == 2.0
    s = Staged(t, "max")  # bf16 max/min: through a float32 copy
    assert s.array.dtype == np.float32 and s.copy is not None
    s.array[:] = 3.0
    s.finish()
    assert t.tolist() == [3.0] * 4
    f16 = Staged(torch.ones(2, dtype=torch.float16), "sum")
    assert f16.wire == "fp16" and Staged(torch.ones(2, dtype=torch.float16), "max").wire is None
    i = Staged(torch.tensor([1, 2], dtype=torch.int64), "sum")
    assert i.exact and i.array.dtype == np.float64
    i.array[:] = [2.0**53, 1.0]
    with pytest.raises(UsageError, match="exceeds 2\\*\\*53"):
        i.finish()
    with pytest.raises(gt.UnsupportedError, match="AVG of a torch.int64"):
        Staged(torch.ones(2, dtype=torch.int64), "mean")
    with pytest.raises(gt.UnsupportedError, match="torch.uint32; the gradcoll backend reduces float32, float64"):
        Staged(torch.ones(2, dtype=torch.uint32), "sum")
    with pytest.raises(UsageError, match="not contiguous"):
        Staged(torch.ones(4, 4).t(), "sum")


def test_mpi_launcher_variables_become_env_rendezvous() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    gt._mpi_environment(env)
    assert env["RANK"] == "3" and env["WORLD_SIZE"] == "4" and env["LOCAL_RANK"] == "1"
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == "29500"
    mine = {"RANK": "0", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"}
    gt._mpi_environment(mine)
    assert mine["RANK"] == "0" and mine["WORLD_SIZE"] == "2" and "MASTER_ADDR" not in mine  # never overwritten


def test_collective_timeout_leaves_room_for_the_error_report() -> None:
    for total in (2.0, 6.0, 30.0, 1800.0):
        t = _collective_timeout(total)
        assert 0 < t < total and t + min(5.0, max(1.0, t)) <= total + 1e-9


def test_backend_is_registered_once() -> None:
    gt.register()
    gt.register()
    assert "gradcoll" in dist.Backend.backend_list
    assert dist.Backend.backend_list.count("gradcoll") == 1


def test_one_rank_group_in_process() -> None:
    dist.init_process_group("gradcoll", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timedelta(seconds=20))
    try:
        t = torch.arange(4.0)
        work = dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True)
        assert work.wait(timedelta(seconds=10)) and work.is_completed() and work.is_success()
        assert work.exception() is None and work.result()[0] is t
        assert work.get_future().wait()[0].tolist() == [0.0, 1.0, 2.0, 3.0]
        with pytest.raises(UsageError, match="pg_options of the gradcoll backend must be gradcoll.torch.Options"):
            dist.new_group([0], backend="gradcoll", pg_options="fast please")
    finally:
        dist.destroy_process_group()
