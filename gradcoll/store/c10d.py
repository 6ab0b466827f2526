"""A torch.distributed store seen through gradcoll's [`Store`][gradcoll.store.Store] interface.

Two places meet in a store torch already holds instead of opening one of
their own: the ``gradcoll`` backend of ``torch.distributed``
(``gradcoll.torch``), which is handed a store by ``init_process_group`` and
``new_group``, and gradcoll's own ``init_process_group`` under torchrun,
whose agent already serves ``MASTER_ADDR:MASTER_PORT``
([`agent_store`][gradcoll.store.c10d.agent_store]). torch's stores speak
their own protocol, so gradcoll reaches them through torch's client.

torch's ``wait`` logs a warning from C++ every time it times out; gradcoll
waits in short rounds (the startup barrier wakes every second to look for
errors), so a blocking ``get`` here polls ``check`` instead, with a backoff
from half a millisecond to 20 ms, bounded by its timeout.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from .._util import Deadline
from ..errors import CollectiveTimeout, TransportBroken, UsageError, seconds
from .base import Store

__all__ = ["C10dStore", "agent_store", "uses_agent_store", "torch_default_store"]

_POLL_FIRST, _POLL_MAX = 0.0005, 0.02


class C10dStore(Store):
    """gradcoll's store interface over a ``torch.distributed.Store`` (TCPStore, FileStore, PrefixStore...).

    ``timeout`` (seconds) is the default wait of ``get``; None takes the
    torch store's own timeout. Errors of the torch store become
    ``TransportBroken`` (naming the operation and key), a wait that runs
    out ``CollectiveTimeout``. Closing it closes nothing: the torch store
    belongs to whoever made it.
    """

    def __init__(self, store: Any, timeout: float | None = None) -> None:
        self.store = store
        self.timeout = float(store.timeout.total_seconds()) if timeout is None else float(timeout)

    def _call(self, what: str, key: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except RuntimeError as exc:  # DistStoreError, DistNetworkError: the store server is gone or broke
            raise TransportBroken(f"store: {what} {key!r} failed in torch's store: {exc}") from exc

    def set(self, key: str, value: bytes) -> None:
        self._call("set", key, self.store.set, key, value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        limit = self.timeout if timeout is None else timeout
        deadline, pause = Deadline(limit), _POLL_FIRST
        while not self.check([key]):
            left = deadline.remaining() or 0.0
            if left <= 0:
                raise CollectiveTimeout(f"store: key {key!r} was not set within {seconds(limit)}s", op="store.get")
            time.sleep(min(pause, left))  # a bounded poll of a remote store, not a synchronisation
            pause = min(pause * 2, _POLL_MAX)
        value = self._call("get", key, self.store.get, key)
        return bytes(value)

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", key, self.store.add, key, amount))

    def check(self, keys: Iterable[str]) -> bool:
        keys = list(keys)
        return bool(self._call("check", ",".join(keys), self.store.check, keys))

    def delete(self, key: str) -> bool:
        return bool(self._call("delete", key, self.store.delete_key, key))


def uses_agent_store(env: dict[str, str] | Any) -> bool:
    """True under torchrun when its agent serves ``MASTER_ADDR:MASTER_PORT`` (``TORCHELASTIC_USE_AGENT_STORE``)."""
    return str(env.get("TORCHELASTIC_USE_AGENT_STORE", "")) == "True"


def torch_default_store(timeout: float) -> C10dStore | None:
    """The store of this process's default ``torch.distributed`` group, or None when it has none.

    Only looked up when torch is imported already (gradcoll never imports it for this).
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return C10dStore(dist.distributed_c10d._get_default_store(), timeout)


def agent_store(host: str, port: int, timeout: float) -> C10dStore:
    """Join torchrun's agent store at ``host:port`` as a client (the agent, not rank 0, is its server)."""
    try:
        from torch.distributed import TCPStore  # type: ignore[attr-defined]
    except ImportError as exc:  # torchrun ships with torch: only a broken environment gets here
        raise UsageError(
            f"TORCHELASTIC_USE_AGENT_STORE=True says torchrun's agent serves the rendezvous store on {host}:{port}, "
            "but torch is not importable here to reach it; install torch (pip install 'gradcoll[torch]') or start "
            "the ranks with `gradcoll launch -n N script.py`"
        ) from exc
    try:
        client = TCPStore(host_name=host, port=port, is_master=False, timeout=timedelta(seconds=timeout))
    except RuntimeError as exc:
        raise CollectiveTimeout(f"cannot reach torchrun's agent store on {host}:{port} within {seconds(timeout)}s: "
                                f"{exc}", op="startup") from exc
    return C10dStore(client, timeout)
