"""The gather step of a coordinator collect: wait for every worker's message, check each as it arrives.

Messages are taken from the workers' inboxes in whatever order they come
(the reader threads fill them concurrently), so one slow worker never holds
up the checks of the others, and the first bad message stops the wait at
once. Checks follow entrenar's order (message type, step, block or
component), then gradcoll's additions (the worker id field, component sizes
against the gradient length, and every worker against worker 0).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from .._util import Deadline
from ..errors import CollectiveMismatch, CollectiveTimeout, NonFiniteError, ProtocolError
from ._conn import POLL_S
from ._faults import jidoka_text, reworded
from ._peers import Peer, Slot
from .config import DistributedConfig
from .protocol import BlockGradientPayload

__all__ = ["gather", "check_message", "check_same_shape", "halt_error"]

Expect = tuple[type, "str | None", "int | None"]  # message class, index field ("block_idx"/"component"), index


def gather(cond: threading.Condition, cfg: DistributedConfig, where: str, step: int, expect: Expect,
           peers: list[Peer], slots: list[Slot | None], got: list[Any]) -> None:
    """Fill ``got[i]`` with worker i's checked message for ``step``; raise on the first failure or timeout."""
    deadline = Deadline(cfg.timeout_s)
    with cond:
        try:
            while True:
                for i, p in enumerate(peers):
                    if got[i] is None and p.inbox:
                        got[i] = m = p.inbox.popleft()
                        s, p.slot = slots[i], None
                        if s is not None and s.taken and getattr(m, "gradients", None) is not s.row:
                            # Another frame is landing in this worker's row: it sent twice.
                            raise ProtocolError(f"{where}: {p.label} sent a second {expect[0].__name__} for "
                                                f"step {step}")
                        check_message(where, step, expect, m, p)
                missing = [i for i in range(len(peers)) if got[i] is None]
                if not missing:
                    return
                _check_alive(where, cfg, peers, missing)
                if deadline.expired():
                    raise CollectiveTimeout(f"{where}: no gradient within {cfg.timeout_s}s from "
                                            + ", ".join(peers[i].label for i in missing), missing=missing, op=where)
                cond.wait(min(deadline.remaining() or POLL_S, POLL_S))
        finally:
            for p in peers:
                p.slot = None


def _check_alive(where: str, cfg: DistributedConfig, peers: list[Peer], missing: list[int]) -> None:
    now = time.monotonic()
    for i in missing:
        p = peers[i]
        if p.error is not None:
            raise reworded(p.error, f"{where}: {p.label} failed: {p.error}", i)
        silent = now - p.conn.last_rx
        if p.gradcoll and silent > cfg.heartbeat_timeout_s:  # entrenar workers send no heartbeats
            raise CollectiveTimeout(f"{where}: {p.label} is dead: no heartbeat for {silent * 1000:.0f} ms "
                                    f"(heartbeat_timeout_ms={cfg.heartbeat_timeout_ms})", missing=[i], op=where)


def check_message(where: str, step: int, expect: Expect, m: Any, p: Peer) -> None:
    """Raise CollectiveMismatch unless ``m`` is the message expected from worker ``p``."""
    cls: Any = expect[0]  # Any: the checks below read fields that every expected class has
    idx_field, idx = expect[1], expect[2]
    if not isinstance(m, cls):
        raise _mismatch(f"{where}: expected {cls.__name__} from worker {p.worker_id} (node {p.node_id}), "
                        f"got {type(m).__name__}", p)
    if m.step != step:
        raise _mismatch(f"{where}: {p.label}: step mismatch: expected {step}, got {m.step}", p)
    if idx_field is not None and getattr(m, idx_field) != idx:
        raise _mismatch(f"{where}: {p.label}: {idx_field} mismatch: expected {idx}, got {getattr(m, idx_field)}", p)
    if m.worker_id != p.worker_id:
        raise _mismatch(f"{where}: {p.label}: worker_id mismatch: it sent worker_id {m.worker_id}", p)
    if cls is BlockGradientPayload and sum(m.component_sizes) != m.gradients.size:
        raise _mismatch(f"{where}: {p.label}: component sizes {list(m.component_sizes)} sum to "
                        f"{sum(m.component_sizes)} but the gradient has {m.gradients.size} elements", p)


def check_same_shape(where: str, ref: Any, m: Any, p: Peer) -> None:
    """Every worker must send what worker 0 sent: the same length (and the same block layout)."""
    if m.gradients.size != ref.gradients.size:
        raise _mismatch(f"{where}: {p.label}: length mismatch: worker 0 sent {ref.gradients.size} gradients, "
                        f"worker {p.worker_id} sent {m.gradients.size}", p)
    if isinstance(m, BlockGradientPayload):
        if m.component_sizes != ref.component_sizes:
            raise _mismatch(f"{where}: {p.label}: component sizes mismatch: worker 0 sent "
                            f"{list(ref.component_sizes)}, worker {p.worker_id} sent {list(m.component_sizes)}", p)
        if m.num_blocks != ref.num_blocks:
            raise _mismatch(f"{where}: {p.label}: num_blocks mismatch: worker 0 sent {ref.num_blocks}, "
                            f"worker {p.worker_id} sent {m.num_blocks}", p)


def halt_error(where: str, step: int, e: NonFiniteError, peers: list[Peer]) -> NonFiniteError:
    """The Jidoka halt (F-DP-003) for the kernel's NonFiniteError: entrenar's text first, then the details."""
    w = e.contributor
    if w is None:
        text = (f"JIDOKA HALT: the mean of finite gradients overflowed at step {step} ({where}; element "
                f"{e.index}, value {e.value}; contract F-DP-003)")
    else:
        text = (f"{jidoka_text(w, step)} ({where}; node {peers[w].node_id}, element {e.index}, value {e.value}; "
                "contract F-DP-003)")
    return NonFiniteError(text, contributor=w, index=e.index, value=e.value, step=step)


def _mismatch(text: str, p: Peer) -> CollectiveMismatch:
    err = CollectiveMismatch(text)
    setattr(err, "peer", p.worker_id)  # noqa: B010 - the culprit, carried in the Abort
    return err
