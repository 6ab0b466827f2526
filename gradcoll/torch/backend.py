"""The ``torch.distributed`` backend ``"gradcoll"``: ``dist.init_process_group("gradcoll")``.

[`register`][gradcoll.torch.backend.register] (run by ``import gradcoll.torch``)
registers a creator with ``torch.distributed.Backend.register_backend``;
torch calls it for the default group and for every ``dist.new_group(ranks)``
with that group's store (prefixed by the group's name), its rank and size
and the ``init_process_group`` timeout. The creator meets the group's other
ranks in that store (no second port), picks the transport (shared memory when
every rank is on one host, tcp otherwise; ``GRADCOLL_BACKEND`` or
[`Options`][gradcoll.torch.backend.Options] override it), builds a gradcoll
group, and returns a [`GradcollProcessGroup`][gradcoll.torch.backend.GradcollProcessGroup],
the Python subclass of ``torch.distributed.ProcessGroup`` that torch itself
supports for Python backends. Its collectives run on one thread per group
(``gradcoll.torch._work``); the tensors' memory is reduced in place.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import PrefixStore as PrefixStoreC10d  # type: ignore[attr-defined]

from ..errors import UsageError
from ..group import ProcessGroup, init_process_group
from ..store import PrefixStore
from ..store.c10d import C10dStore
from ._tensors import SUPPORTED, Staged, UnsupportedError, as_array
from ._work import Driver, TorchWork

__all__ = ["GradcollProcessGroup", "Options", "register", "BACKEND"]

#: The name torch knows the backend by.
BACKEND = "gradcoll"

_RED = dist.ReduceOp
_OPS = {_RED.SUM: "sum", _RED.AVG: "mean", _RED.MAX: "max", _RED.MIN: "min", _RED.PREMUL_SUM: "sum"}
_SUPPORTED_OPS = "SUM, AVG, MAX, MIN, PREMUL_SUM"
_SUPPORTED = ("all_reduce, broadcast, all_gather, all_gather_into_tensor, reduce_scatter, reduce_scatter_tensor, "
              "barrier")


@dataclass(frozen=True)
class Options:
    """``pg_options=`` of ``dist.init_process_group("gradcoll", ...)`` and ``dist.new_group(...)``.

    ``transport``: "shm", "tcp", "mpi" (default: ``GRADCOLL_BACKEND``, else
    shm when every rank of the group is on one host, tcp otherwise).
    ``host``: the address the tcp transport listens on (default 127.0.0.1 on
    one host; across hosts the address this host reaches the rendezvous
    store from). ``check_finite``: a NaN or Inf in any rank's input to a sum
    or mean raises on every rank (default True). ``kernel_backend``: pins the
    reduction kernels (as in gradcoll's ``init_process_group``).
    """

    transport: str | None = None
    host: str | None = None
    check_finite: bool = True
    kernel_backend: str | None = None


def _op(reduce_op: Any, what: str) -> tuple[str, float | None]:
    """gradcoll's op name for a torch ReduceOp, and the PREMUL_SUM factor."""
    kind = getattr(reduce_op, "op", reduce_op)
    if kind not in _OPS:
        raise UnsupportedError(f"{what}: reduce op {kind} is not supported by the gradcoll backend; "
                               f"supported: {_SUPPORTED_OPS}")
    if kind != _RED.PREMUL_SUM:
        return _OPS[kind], None
    factor = reduce_op.factor
    return "sum", float(factor.item() if isinstance(factor, torch.Tensor) else factor)


def _bytes(t: Any, what: str) -> np.ndarray:
    """A contiguous tensor's memory as flat bytes (broadcast and gather copy bits, whatever the dtype)."""
    if not isinstance(t, torch.Tensor) or not t.is_contiguous():
        raise UsageError(f"{what} must be a contiguous torch.Tensor")
    return as_array(t, what).reshape(-1).view(np.uint8)


class GradcollProcessGroup(dist.ProcessGroup):  # type: ignore[misc]
    """A ``torch.distributed.ProcessGroup`` whose collectives run on a gradcoll group (``.group``)."""

    def __init__(self, group: ProcessGroup, *, check_finite: bool = True, name: str = "",
                 global_ranks: list[int] | None = None) -> None:
        super().__init__(group.rank, group.size)  # type: ignore[call-arg]  # the constructor Python subclasses use
        self.group = group
        self.check_finite = check_finite
        self._driver = Driver(name or f"rank{group.rank}")
        ranks = list(global_ranks or [])
        self._note = f"torch.distributed subgroup of global ranks {ranks}" if ranks else ""
        # DDP looks up the backend of the CPU device type; the collectives are this object's own.
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM, None)

    def getBackendName(self) -> str:  # noqa: N802 - the name torch calls
        return BACKEND

    @property
    def transport(self) -> str:
        """The gradcoll transport the group runs on ("shm", "tcp", "mpi")."""
        return str(self.group.transport.name)

    def _run(self, name: str, fn: Callable[[], Any], shape: str = "") -> TorchWork:
        note = ", ".join(x for x in (f"torch.distributed.{name}{shape}", self._note) if x)
        return self._driver.submit(name, fn, note)

    @staticmethod
    def _timeout(opts: Any) -> float | None:
        t = getattr(opts, "timeout", None)
        return t.total_seconds() if isinstance(t, timedelta) and t.total_seconds() > 0 else None

    # -- collectives ---------------------------------------------------------
    def allreduce(self, tensors: list[Any], opts: Any = None) -> TorchWork:  # type: ignore[override]
        opts = dist.AllreduceOptions() if opts is None else opts
        op, factor = _op(opts.reduceOp, "all_reduce")
        staged = [Staged(t, op, f"all_reduce tensor {i}") for i, t in enumerate(tensors)]
        limit = self._timeout(opts)

        def job() -> list[Any]:
            for s in staged:
                if factor is not None:
                    s.scale(factor)
                self.group.allreduce(s.array, op=op, check_finite=self.check_finite and not s.exact,
                                     timeout=limit, wire_dtype=s.wire)
                s.finish()
            return tensors

        shape = f" of a {tensors[0].dtype} tensor of shape {tuple(tensors[0].shape)}" if tensors else ""
        return self._run("all_reduce", job, shape)

    def allreduce_coalesced(self, tensors: list[Any], opts: Any = None) -> TorchWork:  # type: ignore[override]
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[Any], opts: Any = None) -> TorchWork:  # type: ignore[override]
        root = 0 if opts is None else int(opts.rootRank)
        arrays = [_bytes(t, f"broadcast tensor {i}") for i, t in enumerate(tensors)]
        limit = self._timeout(opts)

        def job() -> list[Any]:
            for a in arrays:
                self.group.broadcast(a, root=root, timeout=limit)
            return tensors

        return self._run("broadcast", job)

    def allgather(self, output_tensors: list[list[Any]], input_tensors: list[Any],  # type: ignore[override]
                  opts: Any = None) -> TorchWork:
        pairs = []
        for i, (outs, t) in enumerate(zip(output_tensors, input_tensors, strict=True)):
            if len(outs) != self.size() or any(o.numel() != t.numel() or o.dtype != t.dtype for o in outs):
                raise UsageError(f"all_gather: output list {i} must hold {self.size()} tensors of {t.numel()} "
                                 f"{t.dtype} elements (the input's)")
            pairs.append((outs, _bytes(t.contiguous(), "all_gather input")))
        limit = self._timeout(opts)

        def job() -> list[list[Any]]:
            for outs, src in pairs:
                rows = self.group.allgather(src, timeout=limit)
                for o, row in zip(outs, rows, strict=True):
                    o.copy_(torch.from_numpy(row).view(o.dtype).view(o.shape))
            return output_tensors

        return self._run("all_gather", job)

    def all_gather_single(self, output: Any, input: Any, opts: Any = None) -> TorchWork:  # type: ignore[override]  # noqa: A002
        if output.numel() != input.numel() * self.size() or output.dtype != input.dtype:
            raise UsageError(f"all_gather_into_tensor: the output must hold {self.size()} x {input.numel()} "
                             f"{input.dtype} elements, got {output.numel()} {output.dtype}")
        src, dst = _bytes(input.contiguous(), "all_gather input"), _bytes(output, "all_gather output")
        limit = self._timeout(opts)

        def job() -> list[Any]:
            self.group.allgather(src, out=dst.reshape(self.size(), -1), timeout=limit)
            return [output]

        return self._run("all_gather_into_tensor", job)

    _allgather_base = all_gather_single  # type: ignore[assignment]

    def reduce_scatter(self, output_tensors: list[Any], input_tensors: list[list[Any]],  # type: ignore[override]
                       opts: Any = None) -> TorchWork:
        for out, ins in zip(output_tensors, input_tensors, strict=True):
            if len(ins) != self.size() or any(t.numel() != out.numel() for t in ins):
                raise UsageError(f"reduce_scatter: the input list must hold {self.size()} tensors of "
                                 f"{out.numel()} elements (the output's)")
        return self._reduce_scatter("reduce_scatter", list(zip(output_tensors, input_tensors, strict=True)), opts)

    def reduce_scatter_single(self, output: Any, input: Any, opts: Any = None) -> TorchWork:  # type: ignore[override]  # noqa: A002
        if input.numel() != output.numel() * self.size():
            raise UsageError(f"reduce_scatter_tensor: the input must hold {self.size()} x {output.numel()} "
                             f"elements, got {input.numel()}")
        return self._reduce_scatter("reduce_scatter_tensor", [(output, [input])], opts)

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def _reduce_scatter(self, name: str, jobs: list[tuple[Any, list[Any]]], opts: Any) -> TorchWork:
        """Reduce-scatter each output's inputs, concatenated: a copy (torch's inputs are left as they were)."""
        opts = dist.ReduceScatterOptions() if opts is None else opts
        op, factor = _op(opts.reduceOp, name)
        for out, _ in jobs:  # half types accumulate in float32: the input is copied anyway
            Staged(out, op, f"{name} output")
        limit = self._timeout(opts)

        def job() -> list[Any]:
            for out, ins in jobs:
                flat = torch.cat([t.reshape(-1) for t in ins])
                exact = flat.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool)
                wide = flat.to(torch.float64 if exact else torch.float32 if flat.element_size() == 2 else flat.dtype)
                if factor is not None:
                    wide.mul_(factor)
                mine = self.group.reduce_scatter(as_array(wide), op=op, timeout=limit,
                                                 check_finite=self.check_finite and not exact)
                out.copy_(torch.from_numpy(mine).view(out.shape))
            return [o for o, _ in jobs]

        return self._run(name, job)

    def barrier(self, opts: Any = None) -> TorchWork:  # type: ignore[override]
        limit = self._timeout(opts)
        return self._run("barrier", lambda: self.group.barrier(timeout=limit))

    # -- lifetime ------------------------------------------------------------
    def shutdown(self) -> None:
        """Finish queued collectives, then close the gradcoll group (``dist.destroy_process_group`` calls it)."""
        self._driver.close()
        self.group.close()

    def abort(self) -> None:
        """Close the gradcoll group at once: peers waiting on this rank fail instead of timing out."""
        self.group.close()
        self._driver.close()

    def __repr__(self) -> str:
        return f"<GradcollProcessGroup rank={self.rank()} size={self.size()} {self.transport}>"


def _unsupported(name: str) -> Callable[..., Any]:
    def call(self: GradcollProcessGroup, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedError(f"torch.distributed {name} is not supported by the gradcoll backend; supported: "
                               f"{_SUPPORTED} (reduce ops {_SUPPORTED_OPS}; dtypes {SUPPORTED}). Keep gloo for "
                               "the rest, and gradcoll.torch.comm_hook for DDP's gradients")
    call.__name__ = name
    return call


for _name in ("gather", "scatter", "reduce", "send", "recv", "recv_anysource", "alltoall", "alltoall_base",
              "all_to_all_single", "allgather_coalesced", "all_gather_single_coalesced",
              "allgather_into_tensor_coalesced", "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced",
              "monitored_barrier", "split_group", "merge_remote_group"):
    setattr(GradcollProcessGroup, _name, _unsupported(_name))


def _transport(store: PrefixStore, rank: int, size: int, options: Options, timeout: float) -> tuple[str, str]:
    """The transport and the tcp listen address: shm when every rank of the group is on this host."""
    me = socket.gethostname()
    store.set(f"host/{rank}", me.encode())
    hosts = {store.get(f"host/{r}", timeout).decode(errors="replace") for r in range(size)}
    one_host = hosts == {me}
    chosen = options.transport or os.environ.get("GRADCOLL_BACKEND") or ("shm" if one_host else "tcp")
    return chosen, options.host or ("127.0.0.1" if one_host else _local_address(store))


def _local_address(store: Any) -> str:
    """The address of this host that reaches the torch store's server (a UDP connect sends nothing)."""
    inner = getattr(getattr(store, "store", None), "store", None)
    while isinstance(inner, PrefixStoreC10d):
        inner = inner.underlying_store
    peer = getattr(inner, "host", None) or os.environ.get("MASTER_ADDR")
    if peer and peer not in ("127.0.0.1", "localhost"):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((peer, 9))
                return str(s.getsockname()[0])
            except OSError:
                pass
    return socket.gethostbyname(socket.gethostname())


#: The longest a failed collective's error path waits for the peers' reports (``gradcoll.algorithms._guard``).
_GRACE_S = 5.0


def _collective_timeout(timeout: float) -> float:
    """The gradcoll timeout under which a collective's error, grace included, is raised within ``timeout``."""
    grace = min(_GRACE_S, timeout / 2)  # the grace is min(5 s, the collective's timeout), at least 1 s
    return max(timeout - grace, min(timeout, 1.0))


def _create(opts: Any, pg_options: Any) -> GradcollProcessGroup:
    """The creator torch calls (``extended_api``): one group per ``init_process_group`` / ``new_group``."""
    options = Options() if pg_options is None else pg_options
    if not isinstance(options, Options):
        raise UsageError(f"pg_options of the gradcoll backend must be gradcoll.torch.Options, got {type(options)}")
    timeout = opts.timeout.total_seconds() if isinstance(opts.timeout, timedelta) else 1800.0
    rank, size = int(opts.group_rank), int(opts.group_size)
    store = C10dStore(opts.store, timeout)
    chosen, host = _transport(PrefixStore("gradcoll-torch", store), rank, size, options, min(timeout, 60.0))
    extra: dict[str, Any] = {"host": host} if chosen == "tcp" else {}
    group = init_process_group(chosen, store=store, rank=rank, world_size=size, timeout=_collective_timeout(timeout),
                               kernel_backend=options.kernel_backend, **extra)
    ranks = [int(r) for r in opts.global_ranks_in_group]
    return GradcollProcessGroup(group, check_finite=options.check_finite, name=str(opts.group_id),
                                global_ranks=ranks if ranks and ranks != list(range(size)) else None)


def register() -> None:
    """Register the ``"gradcoll"`` backend with torch.distributed (idempotent; ``import gradcoll.torch`` runs it)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
