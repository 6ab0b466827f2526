"""Serving a pipeline: workers, fixed-function boards, and the coordinator's helpers.

The protocol, per worker rank ``r`` (rank 0 is the coordinator):

    r -> 0   caps            (send_caps / collect_caps, ranks 1..n-1 in order)
    0 -> r   stage spec      (ship_stage)
    r -> 0   ack / refusal   (a refusal raises StageRefused at rank 0)
    loop:    activation in from upstream, run the stage, result out downstream

In a mesh upstream is ``r - 1`` and downstream ``r + 1`` (the last rank
wraps to 0), so ``drive_pipeline`` sends to rank 1 and reads rank
``n - 1``. In a star both are rank 0, which relays each activation through
ranks 1..n-1 in turn. A rank whose stage fails sends an error report
downstream before raising; the others pass it on and rank 0 raises
``RemoteStageError`` with the failing rank's
message. A worker's loop ends cleanly when its control's step budget is
spent, its stop flag is raised, or its upstream closes the link.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import GradcollError, ProtocolError, TransportClosed, UsageError
from ..group.process_group import ProcessGroup
from . import wire
from .caps import NodeCaps, NodeRole, node_device, platform_tag, send_caps
from .config import Topology, topology_of
from .control import NodeControl
from .errors import RemoteStageError, StageRefused
from .fixed_function import FixedFunction, FixedFunctionDevice
from .stage import StageSpec, compile_stage
from .weights import Resolver, weight_cache

__all__ = ["NodeReport", "serve_worker", "serve_worker_n", "serve_fixed_function_n", "ship_stage", "drive_pipeline"]


@dataclass(frozen=True)
class NodeReport:
    """What a serving node did, returned rather than printed (a mobile shell has no stdout)."""

    rank: int
    device: str
    platform: str
    activations: int


def _route(group: ProcessGroup) -> tuple[int, int]:
    """(upstream, downstream) of this worker."""
    if topology_of(group) is Topology.STAR:
        return 0, 0
    return group.rank - 1, (group.rank + 1) % group.size


def _worker_rank(group: ProcessGroup, what: str) -> None:
    if group.rank == 0:
        raise UsageError(f"rank 0 is the coordinator and cannot {what}; use ship_stage / drive_pipeline there")


def _answer(group: ProcessGroup, error: str | None) -> None:
    wire.send_json(group, 0, {"type": "ack", "ok": error is None, "error": error or ""})


def _receive_stage(group: ProcessGroup, control: NodeControl) -> StageSpec | None:
    doc = wire.recv_json(group, 0, "stage", control=control)
    if doc is None:
        return None
    try:
        return StageSpec.from_dict(doc.get("spec"))
    except UsageError as exc:
        _answer(group, f"invalid stage spec: {exc}")
        raise ProtocolError(f"rank {group.rank}: rank 0 shipped an invalid stage spec: {exc}") from exc


def _serve_loop(group: ProcessGroup, control: NodeControl, run: Callable[[np.ndarray], np.ndarray]) -> int:
    """Move activations upstream -> ``run`` -> downstream while ``control`` allows; returns how many."""
    up, down = _route(group)
    done = 0
    while control.allows(done):
        try:
            msg = wire.recv_message(group, up, control=control)
        except TransportClosed:
            break  # upstream closed between messages: the pipeline is over
        if msg is None:
            break  # stop flag
        if msg.kind == wire.ERROR:
            wire.send_error(group, down, msg.body)  # pass an upstream failure on towards rank 0
            continue
        if msg.kind != wire.ARRAY:
            raise ProtocolError(f"rank {group.rank}: expected an activation from peer {up}, got a JSON message")
        try:
            y = run(msg.body)
        except Exception as exc:
            try:  # best effort: let rank 0 fail with our reason instead of a bare closed link
                wire.send_error(group, down, f"rank {group.rank}: {exc}")
            except GradcollError:
                pass
            raise
        wire.send_array(group, down, y)
        done += 1
    return done


def serve_worker_n(group: ProcessGroup, caps: NodeCaps, resolve: Resolver | None,
                   control: NodeControl) -> NodeReport:
    """Serve as a general worker: announce ``caps``, receive a stage, run activations while ``control`` allows.

    ``resolve`` turns weight URIs into arrays (None: ``file://`` .npy); each
    URI is resolved once. Returns the ``NodeReport``; the group stays
    open (the caller closes it).
    """
    _worker_rank(group, "serve a stage")
    if caps.role.is_fixed_function:
        raise UsageError(f"rank {group.rank} has a fixed-function role: use serve_fixed_function_n")
    send_caps(group, caps)
    spec = _receive_stage(group, control)
    if spec is None:
        return NodeReport(group.rank, caps.devices[0], caps.platform, 0)
    try:
        stage = compile_stage(spec, weight_cache(resolve))
    except Exception as exc:  # a caller's resolver may raise anything: rank 0 must still get an answer
        _answer(group, f"rank {group.rank} cannot load stage {spec.stage_id!r}: {exc}")
        raise
    _answer(group, None)
    # "auto" means this node's best device, which its caps already name; resolve anything else.
    device = caps.devices[0] if spec.device in ("auto", "") else node_device(spec.device)
    return NodeReport(group.rank, device, caps.platform, _serve_loop(group, control, stage))


def serve_worker(group: ProcessGroup, resolve: Resolver | None = None) -> NodeReport:
    """``serve_worker_n`` with this node's default caps and no step bound."""
    return serve_worker_n(group, NodeCaps.here(group.rank), resolve, NodeControl.unbounded())


def serve_fixed_function_n(group: ProcessGroup, ff: FixedFunction, board: FixedFunctionDevice,
                           control: NodeControl) -> NodeReport:
    """Serve as a fixed-function rank: announce the one stage ``board`` implements, then stream activations through it.

    Refuses, before sending anything, a board whose stage id differs from
    ``ff``; refuses a shipped stage with another id (both ids named), an
    input that is not ``ff.input_elems`` elements long (it is converted to
    ``ff.exchange_dtype``) and a board output that is not ``ff.output_elems`` long.
    """
    _worker_rank(group, "serve a fixed-function stage")
    board_id = board.stage_id()
    if board_id != ff.stage_id:
        raise StageRefused(f"rank {group.rank}: the board implements stage {board_id!r} "
                           f"but its descriptor says {ff.stage_id!r}")
    caps = NodeCaps(group.rank, NodeRole.fixed_function(ff), ("fixed_function",), platform_tag())
    send_caps(group, caps)
    spec = _receive_stage(group, control)
    if spec is None:
        return NodeReport(group.rank, "fixed_function", caps.platform, 0)
    try:
        ff.check_stage(spec)
    except StageRefused as exc:
        _answer(group, str(exc))
        raise
    _answer(group, None)

    def run(x: np.ndarray) -> np.ndarray:
        ff.check_input(x)
        y = np.asarray(board.execute(x.astype(ff.exchange_dtype, copy=False)))
        ff.check_output(y)
        return np.ascontiguousarray(y, dtype=ff.exchange_dtype).reshape(-1)

    return NodeReport(group.rank, "fixed_function", caps.platform, _serve_loop(group, control, run))


def ship_stage(group: ProcessGroup, rank: int, spec: StageSpec, timeout: float | None = None) -> None:
    """Coordinator: send ``spec`` to ``rank`` and wait for its answer (StageRefused if it refuses)."""
    if group.rank != 0:
        raise UsageError(f"rank {group.rank}: only rank 0 ships stages")
    if not isinstance(spec, StageSpec) or not 0 < rank < group.size:
        raise UsageError(f"ship_stage needs a StageSpec and a worker rank 1..{group.size - 1}, got {rank!r}")
    wire.send_json(group, rank, {"type": "stage", "spec": spec.to_dict()}, timeout)
    doc = wire.recv_json(group, rank, "ack", timeout=timeout)
    if doc is None or doc.get("ok") is not True:
        reason = doc.get("error") if doc else "no answer"
        raise StageRefused(f"rank {rank} refused stage {spec.stage_id!r}: {reason}")


def _result(group: ProcessGroup, peer: int, timeout: float | None) -> np.ndarray:
    msg = wire.recv_message(group, peer, timeout=timeout)
    assert msg is not None  # no control: only a timeout or an error ends the wait
    if msg.kind == wire.ERROR:
        raise RemoteStageError(f"pipeline failed: {msg.body}", rank=peer)
    if msg.kind != wire.ARRAY:
        raise ProtocolError(f"rank 0: expected an activation from peer {peer}, got a JSON message")
    out: np.ndarray = msg.body
    return out


def drive_pipeline(group: ProcessGroup, inputs: Iterable[Any], *, window: int = 1,
                   timeout: float | None = None) -> list[np.ndarray]:
    """Coordinator: push every input through ranks 1..n-1 and return the outputs in order.

    In a mesh up to ``window`` activations are in flight at once; a star
    relays one activation at a time. Inputs that are not float arrays become
    float32.
    """
    if group.rank != 0:
        raise UsageError(f"rank {group.rank}: only rank 0 drives the pipeline")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise UsageError(f"window must be an int >= 1, got {window!r}")
    xs = [_activation(x) for x in inputs]
    n, outs = group.size, []
    if n == 1:
        return [x.copy() for x in xs]
    if topology_of(group) is Topology.STAR:
        for x in xs:
            for r in range(1, n):
                wire.send_array(group, r, x, timeout)
                x = _result(group, r, timeout)
            outs.append(x)
        return outs
    inflight: collections.deque[list[Any]] = collections.deque()
    for x in xs:
        reqs, _keep = wire.isend_array(group, 1, x)
        inflight.append(reqs)
        if len(inflight) >= window:
            outs.append(_result(group, n - 1, timeout))
            for req in inflight.popleft():
                req.wait(timeout)
    while inflight:
        outs.append(_result(group, n - 1, timeout))
        for req in inflight.popleft():
            req.wait(timeout)
    return outs


def _activation(x: Any) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype not in (np.float16, np.float32, np.float64):
        a = a.astype(np.float32)
    return np.ascontiguousarray(a).reshape(-1)
