"""`ProcessGroup` and `Work`: the collectives of one group of ranks over one transport (see `gradcoll.group`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from ..algorithms import (
    Workspace,
    allgather,
    announce_close,
    attach_witnesses,
    barrier,
    broadcast,
    check_op,
    reduce_scatter,
    wake_collective,
)
from ..algorithms.prepared import Allreduce, prepare_allreduce
from ..algorithms.prepared import Group as PreparingGroup
from ..algorithms.ring import SEGMENT_BYTES
from ..errors import UsageError
from ..observe.diagnosis import ControlChannel, Diagnostics
from ..observe.trace import GroupStats, Recorder
from ..transport.base import Transport
from .buffers import as_buffer, is_device_array, pinned_staging, tensor_wire, writable_array
from .topology import Topology
from .work import Executor, Work

__all__ = ["ProcessGroup", "Work", "Membership"]

_KEEP = 256  # the prepared allreduces a group keeps (sizes, dtypes, ops, choices); more clears them


class ProcessGroup(Topology):
    """Collectives over ``transport``: ``allreduce``, ``broadcast``, ``allgather``, ... (see module doc).

    ``timeout`` (seconds, default the transport's) bounds every wait for a
    peer; ``segment_bytes`` is the ring's pipeline segment; ``kernel_backend``
    pins the reduction kernels (``"cython"``, ``"numba"``, ``"numpy"``; None
    lets [`gradcoll.kernels`][gradcoll.kernels] choose).

    ``stall_warning_s`` (default 10 s; None turns it off): a collective that
    has run this long logs, on logger ``"gradcoll"``, which ranks have arrived
    and which have not, and keeps waiting (``gradcoll.observe.diagnosis``).
    ``trace``: record a Chrome trace from the start and write it at
    [`close`][gradcoll.group.ProcessGroup.close] (each rank to its own file, see [`gradcoll.observe.trace.trace_path`][gradcoll.observe.trace.trace_path]).
    ``stats_window``: how many recent records [`stats`][gradcoll.group.ProcessGroup.stats] keeps. ``control``
    is a control channel (stall reports from peers) the group then owns and closes; ``membership`` is what
    [`init_process_group`][gradcoll.group.rendezvous.init_process_group] hands a group instead: a control
    channel it owns, and how the survivors regroup after a failure ([`shrink`][gradcoll.group.ProcessGroup.shrink]).
    ``hosts``: the host of every rank (``init_process_group`` learns it; see `gradcoll.group.topology`).
    """

    def __init__(self, transport: Transport, *, timeout: float | None = None,
                 segment_bytes: int | None = SEGMENT_BYTES, kernel_backend: str | None = None,
                 stall_warning_s: float | None = 10.0, trace: str | None = None, stats_window: int = 1024,
                 control: ControlChannel | None = None, membership: Membership | None = None,
                 hosts: Sequence[str] | None = None) -> None:
        self.transport = transport
        self.kernel_backend = kernel_backend
        self._pinned: dict[tuple[int, str], tuple[Any, Any]] = {}
        self._prepared: dict[Any, Allreduce] = {}  # the prepared allreduces, by shape and choices (``_prepare``)
        self.rank: int = transport.rank
        """This rank's number in the group, 0 .. size - 1."""
        self.size: int = transport.size
        """The number of ranks in the group (also available as ``world_size``)."""
        self.timeout = transport.timeout if timeout is None else timeout
        self.segment_bytes = SEGMENT_BYTES if segment_bytes is None else segment_bytes
        self._ws = Workspace()
        self._init_hosts(hosts)
        if membership is not None:
            if control is not None:
                raise UsageError("pass control= or membership= (which brings its control channel), not both")
            control = membership.control
        self._membership = membership
        rec = Recorder(self.rank, self.size, stats_window, self.hosts)
        self._exec = Executor(transport, rec)
        self._diag = Diagnostics(self._exec, rec, timeout=self.timeout, stall_warning_s=stall_warning_s, trace=trace,
                                 control=control, owns_control=membership is None)
        # The control channel outlives the links: the error path sends its records there too (_witness).
        attach_witnesses(transport, control)
        if control is not None:
            control.wake = lambda src, record: wake_collective(transport, src, record, self._running_seq())

    def _running_seq(self) -> int | None:
        """The seq of the collective this rank is inside, if any (read from the control channel's thread)."""
        return None if (running := self._diag.rec.current) is None else running[1]

    # -- state -------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """The number of ranks in the group (the same as ``size``; the name ``init_process_group`` takes)."""
        return self.size

    @property
    def seq(self) -> int:
        """Sequence number the next collective will get."""
        return self._exec.seq

    @property
    def poisoned(self) -> bool:
        """True once a collective failed; the group must then be rebuilt."""
        return self._exec.poison is not None

    def _timeout(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout

    # -- collectives -------------------------------------------------------
    def allreduce(self, buf: np.ndarray, op: str = "mean", algorithm: str = "auto", check_finite: bool = True,
                  async_op: bool = False, timeout: float | None = None, *, wire_dtype: str | None = None,
                  deterministic: bool = False) -> Any:
        """Reduce ``buf`` across all ranks in place (mean, sum, max or min); returns ``buf`` (or a Work).

        ``buf`` may be a NumPy array, a PyTorch CPU tensor, a DLPack or buffer
        object (viewed without a copy), or a CUDA device array: device buffers
        are staged through a reusable pinned host buffer, every rank's
        contribution is gathered, and the reduction runs on the device with the
        fused CUDA kernel (see docs/transports.md, GPU buffers).

        ``wire_dtype="bf16"|"fp16"`` sends float32 as half the bytes and
        accumulates in float32 (docs/algorithms/wire.md); float16 and bfloat16
        buffers always take that path for mean and sum. ``deterministic=True``
        returns the same bits under any algorithm, world layout or arrival
        order (docs/algorithms/deterministic.md).
        """
        if type(buf) is np.ndarray and buf.flags.c_contiguous and buf.flags.writeable:
            work = given = buf
        elif is_device_array(buf):
            if wire_dtype is not None or deterministic:
                raise UsageError("wire_dtype= and deterministic= take host buffers; device buffers are reduced "
                                 "in their own dtype")
            return self._device_allreduce(buf, op, check_finite, async_op, timeout)
        else:
            given = buf
            wire_dtype = tensor_wire(buf, op, wire_dtype)  # torch float16/bfloat16 tensors: accumulated in float32
            arr = buf if isinstance(buf, np.ndarray) else as_buffer(buf, writable=True, what="buf").array
            work, writeback = writable_array(arr, reduce=False)
        key = (work.size, work.dtype, op, algorithm, check_finite, wire_dtype, deterministic)
        prep = self._prepared.get(key)
        if prep is None:
            prep = self._prepare(key)
        limit = self.timeout if timeout is None else timeout
        if work is given:
            if not async_op:
                return self._exec.inline(prep.name, prep.run, (work, limit), work.nbytes)
            return self._exec.submit(prep.name, lambda seq: prep.run(seq, work, limit), True, nbytes=work.nbytes)

        def job(seq: int) -> Any:
            prep.run(seq, work, limit)
            writeback()
            return given

        return self._exec.submit(prep.name, job, async_op, nbytes=work.nbytes)

    def _prepare(self, key: tuple[Any, ...]) -> Allreduce:
        """The prepared allreduce of ``key`` (count, dtype, op, algorithm, check, wire, deterministic), kept; a call
        that cannot run raises UsageError here, before anything is sent."""
        count, dtype, op, algorithm, check, wire, deterministic = key
        group = PreparingGroup(self.transport, self.segment_bytes, self.kernel_backend, self._ws,
                               self.host_counts, lambda nbytes: self._two_level(nbytes, self.segment_bytes))
        prep = prepare_allreduce(group, count, dtype, op, algorithm, check, wire, deterministic)
        if len(self._prepared) >= _KEEP:
            self._prepared.clear()
        self._prepared[key] = prep
        return prep

    def _device_allreduce(self, buf: Any, op: str, check_finite: bool, async_op: bool, timeout: float | None) -> Any:
        """Allreduce of a device array ([`gradcoll.algorithms.device`][gradcoll.algorithms.device]) through pinned staging."""
        from ..algorithms.device import DEVICE_DTYPES, device_allreduce

        dev = as_buffer(buf, what="buf").array
        check_op(op)
        dtype = np.dtype(dev.dtype)
        if dtype not in DEVICE_DTYPES:
            raise UsageError(f"device buffers must be float32 or float64, got {dtype}")
        flat = dev.reshape(dev.size)
        local, rows = pinned_staging(self._pinned, dev.size, dtype, self.size)
        limit = self._timeout(timeout)

        def job(seq: int) -> Any:
            device_allreduce(self.transport, flat, local, rows, op=op, check_finite=check_finite, seq=seq,
                             timeout=limit)
            return buf

        return self._exec.submit("device allreduce", job, async_op, nbytes=int(dev.nbytes))

    def allreduce_many(self, arrays: Sequence[np.ndarray], op: str = "mean", algorithm: str = "auto",
                       check_finite: bool = True, async_op: bool = False, timeout: float | None = None) -> Any:
        """Allreduce several arrays with one collective per dtype (packed into a fusion buffer); returns the list."""
        arrays = list(arrays)
        for i, a in enumerate(arrays):
            writable_array(a, reduce=True, what=f"arrays[{i}]")
        check_op(op)
        groups: dict[np.dtype, list[np.ndarray]] = {}
        for a in arrays:
            groups.setdefault(a.dtype, []).append(a)
        plans = []
        for dt, members in groups.items():
            total = sum(a.size for a in members)
            key = (total, dt, op, algorithm, check_finite, None, False)
            plans.append((dt, members, total, self._prepared.get(key) or self._prepare(key)))
        limit = self._timeout(timeout)

        def job(seq: int) -> list[np.ndarray]:
            for k, (dt, members, total, prep) in enumerate(plans):
                fused = self._ws.get("fusion", total, dt)
                offsets = np.cumsum([0] + [a.size for a in members])
                for a, lo, hi in zip(members, offsets[:-1], offsets[1:], strict=True):
                    fused[lo:hi].reshape(a.shape)[...] = a
                prep.run(seq + k, fused, limit)
                for a, lo, hi in zip(members, offsets[:-1], offsets[1:], strict=True):
                    a[...] = fused[lo:hi].reshape(a.shape)
            return arrays

        return self._exec.submit("allreduce_many", job, async_op, nseq=max(1, len(plans)),
                            nbytes=sum(a.nbytes for a in arrays))

    def broadcast(self, buf: np.ndarray, root: int = 0, async_op: bool = False,
                  timeout: float | None = None) -> Any:
        """Copy ``root``'s ``buf`` into ``buf`` on every rank; returns ``buf`` (or a Work)."""
        work, writeback = writable_array(buf, reduce=False)
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self.size:
            raise UsageError(f"rank {self.rank}: broadcast root {root!r} out of range for world size {self.size}")
        limit = self._timeout(timeout)

        def job(seq: int) -> np.ndarray:
            broadcast(self.transport, work, root=int(root), seq=seq, timeout=limit)
            writeback()
            return buf

        return self._exec.submit("broadcast", job, async_op, nbytes=work.nbytes)

    def allgather(self, buf: np.ndarray, out: np.ndarray | None = None, async_op: bool = False,
                  timeout: float | None = None) -> Any:
        """Every rank's ``buf`` stacked in rank order: an array of shape ``(size, *buf.shape)``."""
        if not isinstance(buf, np.ndarray):
            raise UsageError(f"buf must be a numpy array, got {type(buf).__name__}")
        src = np.ascontiguousarray(buf)
        shape = (self.size,) + buf.shape
        if out is None:
            out = np.empty(shape, buf.dtype)
        elif not isinstance(out, np.ndarray) or out.shape != shape or out.dtype != buf.dtype:
            raise UsageError(f"rank {self.rank}: allgather out must be a {buf.dtype} array of shape {shape}")
        dst, writeback = writable_array(out, reduce=False, what="out")
        limit = self._timeout(timeout)

        def job(seq: int) -> np.ndarray:
            allgather(self.transport, src, dst, seq=seq, timeout=limit)
            writeback()
            return out

        return self._exec.submit("allgather", job, async_op, nbytes=src.nbytes)

    def reduce_scatter(self, buf: np.ndarray, op: str = "mean", check_finite: bool = True,
                       async_op: bool = False, timeout: float | None = None) -> Any:
        """Reduce ``buf`` across ranks; returns the view of ``buf`` (flattened) holding this rank's chunk.

        Chunk ``r`` of the near-equal split (the first ``len % size`` chunks one
        element longer) ends on rank ``r``; the rest of ``buf`` is scratch.
        """
        work, _ = writable_array(buf, reduce=True)
        if work is not buf:
            raise UsageError("reduce_scatter needs a C-contiguous buffer (it returns a view of it)")
        check_op(op)
        limit = self._timeout(timeout)

        def job(seq: int) -> np.ndarray:
            return reduce_scatter(self.transport, buf, op=op, check_finite=check_finite, seq=seq, timeout=limit,
                                  segment_bytes=self.segment_bytes, workspace=self._ws, backend=self.kernel_backend)

        return self._exec.submit("reduce_scatter", job, async_op, nbytes=buf.nbytes)

    def barrier(self, async_op: bool = False, timeout: float | None = None) -> Any:
        """Block until every rank has reached the barrier."""
        limit = self._timeout(timeout)
        return self._exec.submit("barrier", lambda seq: barrier(self.transport, seq=seq, timeout=limit), async_op)

    def alloc(self, shape: int | tuple[int, ...], dtype: Any = np.float32, timeout: float | None = None) -> np.ndarray:
        """Collective: a zero-filled array living in this rank's slot of a new shared window (no copy-in).

        Every rank calls it with the same ``shape`` and ``dtype``, in the same order among its collectives.
        ``allreduce`` of the array (or of a contiguous part at the same offset on every rank) reduces it where
        it lies; it stays valid until the group closes. Needs ranks that share memory (shm, inproc; mpi on one
        node). See docs/algorithms/direct.md.
        """
        from ..algorithms.direct import alloc

        limit = self._timeout(timeout)
        return self._exec.submit("alloc", lambda seq: alloc(self.transport, shape, dtype, limit), False)  # type: ignore[no-any-return]

    # -- diagnosis and membership -------------------------------------------
    def stats(self) -> GroupStats:
        """Counts, bytes and times per operation since the group was built, plus the recent records."""
        return self._diag.rec.stats()

    def start_trace(self) -> None:
        """Start recording a Chrome trace of this rank's collectives (see [`gradcoll.observe.trace`][gradcoll.observe.trace])."""
        self._diag.rec.start_trace()

    def stop_trace(self, path: str) -> str | None:
        """Stop recording and write this rank's trace; returns the file written (``.rankN`` inserted)."""
        return self._diag.rec.stop_trace(path)

    def shrink(self, timeout: float | None = None) -> "ProcessGroup":
        """After a failure: agree with the surviving ranks on the members left; return their new group.

        Every survivor must call it. This group is closed; the new one has the
        survivors renumbered in old rank order and sequence numbers from 0.
        Raises ShrinkFailed when no agreement is reached within ``timeout``
        (default the group's) or this rank was left out. See [`gradcoll.group.shrink`][gradcoll.group.shrink].
        """
        if self._membership is None:
            raise UsageError(f"rank {self.rank}: shrink() needs the control channel of a group built by "
                             "init_process_group (this one was built directly on a transport)")
        return self._membership.shrink(self, self._timeout(timeout))

    # -- lifetime ----------------------------------------------------------
    def close(self) -> None:
        """Fail queued work, close the transport (peers see TransportClosed), stop the worker. Idempotent."""
        if not self._exec.close():
            return
        # Peers still inside a collective name this rank as the one that closed, whatever their
        # links make of it (a reset, a half-sent frame), when they have the control channel.
        running = self._running_seq()
        announce_close(self.transport, running if running is not None else self.seq)
        self.transport.close()
        self._close_topology()
        self._diag.close()
        if self._membership is not None:
            self._membership.close()
        self._exec.join()

    def __enter__(self) -> "ProcessGroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = " closed" if self._exec.closed else " poisoned" if self._exec.poison else ""
        return f"<ProcessGroup rank={self.rank} size={self.size} {self.transport.name} seq={self.seq}{state}>"


class Membership(Protocol):
    """What [`init_process_group`][gradcoll.group.rendezvous.init_process_group] hands a group besides its transport:
    the control channel, and how the survivors of a failure regroup (``gradcoll.group.connect`` builds it)."""

    @property
    def control(self) -> ControlChannel | None:
        """The group's control channel (None once ``shrink`` has taken it)."""

    def shrink(self, group: ProcessGroup, timeout: float) -> ProcessGroup:
        """Close ``group``, agree with the survivors on the members left, return their new group."""

    def adopt(self, control: ControlChannel) -> Membership:
        """The membership of a subgroup whose control channel is ``control``: it shrinks as this one does."""

    def close(self) -> None:
        """Close the control channel (if ``shrink`` has not taken it). Idempotent."""
