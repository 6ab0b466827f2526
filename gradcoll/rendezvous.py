"""init_process_group: find the other ranks, connect a transport, return a ProcessGroup.

Rendezvous goes through a store that is used for bootstrap only: rank 0
hosts a [`TCPStore`][gradcoll.store.TCPStore] (``env://``, ``tcp://``) or every
rank opens the same [`FileStore`][gradcoll.store.FileStore] (``file://``); the
transport backend publishes whatever it needs there (addresses, segment
names); then all ranks meet once more in the store and close it (rank 0's
server waits for the others to disconnect first). Nothing global is
created: the returned group is the only handle.

``env://`` reads what launchers set:

* torchrun: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``;
* Open MPI's mpirun: ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``,
  ``OMPI_COMM_WORLD_LOCAL_RANK``;
* MPICH / Slurm PMI: ``PMI_RANK``, ``PMI_SIZE``; srun: ``SLURM_PROCID``,
  ``SLURM_NTASKS``, ``SLURM_LOCALID``.

The first variable set in that order wins; explicit ``rank`` / ``world_size``
arguments override the environment for every init method.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from .errors import BackendUnavailable, UsageError
from .group import ProcessGroup
from .store import FileStore, PrefixStore, Store, TCPStore

__all__ = ["init_process_group", "parse_init_method", "env_rank_size", "InitMethod", "DEFAULT_PORT"]

#: MASTER_PORT when the environment names none (torchrun's default).
DEFAULT_PORT = 29500

_RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
_SIZE_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")
_LOCAL_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")


@dataclass(frozen=True)
class InitMethod:
    """A parsed ``init_method``: ``scheme`` is "tcp" (host, port) or "file" (path)."""

    scheme: str
    host: str = ""
    port: int = 0
    path: str = ""


def _env_int(env: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for name in names:
        raw = env.get(name)
        if raw is not None and raw.strip() != "":
            try:
                return int(raw)
            except ValueError:
                raise UsageError(f"environment variable {name}={raw!r} is not an integer") from None
    return None


def env_rank_size(env: Mapping[str, str] | None = None) -> tuple[int | None, int | None, int | None]:
    """``(rank, world_size, local_rank)`` from launcher variables; None where unset."""
    env = os.environ if env is None else env
    return _env_int(env, _RANK_VARS), _env_int(env, _SIZE_VARS), _env_int(env, _LOCAL_VARS)


def parse_init_method(init_method: str, env: Mapping[str, str] | None = None) -> InitMethod:
    """Parse ``env://``, ``tcp://HOST:PORT`` or ``file://PATH``."""
    env = os.environ if env is None else env
    if not isinstance(init_method, str):
        raise UsageError(f"init_method must be a string, got {type(init_method).__name__}")
    if init_method == "env://":
        host = env.get("MASTER_ADDR") or "127.0.0.1"
        port = _env_int(env, ("MASTER_PORT",))
        return InitMethod("tcp", host, DEFAULT_PORT if port is None else _check_port(port, "MASTER_PORT"))
    if init_method.startswith("file://"):
        path = init_method[len("file://"):]
        if not path:
            raise UsageError("file:// init_method needs a path, e.g. file:///tmp/gradcoll-job-42")
        return InitMethod("file", path=path)
    if init_method.startswith("tcp://"):
        parts = urlsplit(init_method)
        try:
            hostname, port = parts.hostname, parts.port
        except ValueError as exc:
            raise UsageError(f"bad port in init_method {init_method!r}: {exc}") from None
        if not hostname or port is None or (parts.path not in ("", "/")) or parts.query:
            raise UsageError(f"init_method {init_method!r} must look like tcp://HOST:PORT")
        return InitMethod("tcp", hostname, _check_port(port, init_method))
    raise UsageError(f"unknown init_method {init_method!r}; use env://, tcp://HOST:PORT or file://PATH")


def _check_port(port: int, what: str) -> int:
    if not 1 <= port <= 65535:
        raise UsageError(f"port {port} from {what} is out of range 1..65535")
    return port


def _load_backend(backend: str) -> Any:
    if not isinstance(backend, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", backend):
        raise UsageError(f"backend must be a transport name such as 'tcp', 'shm', 'mpi', 'inproc'; got {backend!r}")
    name = f"gradcoll.transport.{backend}"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name == name:
            raise BackendUnavailable(f"transport backend {backend!r} is not available: no module {name}") from exc
        raise BackendUnavailable(f"transport backend {backend!r} needs {exc.name!r}, which is not installed") from exc
    if not callable(getattr(module, "create", None)):
        raise BackendUnavailable(f"{name} has no create(store, rank, size, ...) factory")
    return module


def _default_kernels() -> str | None:
    """'cython' when the compiled extension loads here, else None (automatic choice)."""
    from .kernels import available_backends

    return "cython" if "cython" in available_backends() else None


def init_process_group(
    backend: str | None = None,
    init_method: str = "env://",
    rank: int | None = None,
    world_size: int | None = None,
    timeout: float = 300.0,
    *,
    store: Store | None = None,
    kernel_backend: str | None = None,
    stall_warning_s: float | None = 10.0,
    trace: str | None = None,
    **transport_options: Any,
) -> ProcessGroup:
    """Join a group of ``world_size`` ranks over transport ``backend`` and return its ProcessGroup.

    ``init_method`` says where to meet (ignored when a ready ``store`` is
    passed, which the caller then owns and closes). Rank 0 hosts the
    TCPStore. ``transport_options`` go to ``gradcoll.transport.<backend>.create``;
    ``kernel_backend`` to the ProcessGroup.

    ``backend=None`` takes ``GRADCOLL_BACKEND`` (set by ``gradcoll launch``)
    or ``"tcp"``. ``kernel_backend=None`` picks the single-threaded compiled
    kernels when they are built: every rank is a process that already owns a
    core, and threaded kernels in several ranks on one host fight for the
    cores (measured 10-30x slower on 2 cores). Pass ``kernel_backend="numba"``
    when one rank owns several cores.
    ``stall_warning_s`` and ``trace`` go to the ProcessGroup (stall warnings,
    Chrome trace path). The group also gets a control channel (a UDP socket
    per rank on the tcp ``host`` option, default 127.0.0.1) for stall reports
    and ``shrink()``; see ``gradcoll.diagnosis``.
    Raises BackendUnavailable if that module is missing, UsageError for a
    missing rank/size or a bad init_method, CollectiveTimeout if the others
    do not show up within ``timeout`` seconds.
    """
    if backend is None:
        backend = os.environ.get("GRADCOLL_BACKEND") or "tcp"
    if kernel_backend is None:
        kernel_backend = _default_kernels()
    env_rank, env_size, _ = env_rank_size()
    rank = env_rank if rank is None else rank
    world_size = env_size if world_size is None else world_size
    if rank is None or world_size is None:
        raise UsageError("rank and world_size must be given or set by the launcher (RANK and WORLD_SIZE, ...)")
    if world_size < 1 or not 0 <= rank < world_size:
        raise UsageError(f"rank {rank} out of range for world size {world_size}")
    _load_backend(backend)
    owned = store is None
    if store is None:
        where = parse_init_method(init_method)
        if where.scheme == "file":
            store = FileStore(where.path, timeout=timeout)
        else:
            store = TCPStore(where.host, where.port, is_master=rank == 0, timeout=timeout)
    try:
        return _connect(PrefixStore(f"gradcoll/{backend}", store), backend, rank, world_size, timeout=timeout,
                        group_timeout=timeout, kernel_backend=kernel_backend, transport_options=transport_options,
                        group_options={"stall_warning_s": stall_warning_s, "trace": trace})
    finally:
        if owned:
            store.close()  # the TCPStore master lingers until the other ranks have disconnected


def _connect(ns: Store, backend: str, rank: int, size: int, *, timeout: float, group_timeout: float,
             kernel_backend: str | None, transport_options: dict[str, Any], group_options: dict[str, Any],
             control_host: str | None = None, generation: int = 0) -> ProcessGroup:
    """Connect the transport and the control channel through ``ns`` and return the group (init and shrink)."""
    from .diagnosis import open_control

    module = _load_backend(backend)
    transport = module.create(ns, rank, size, timeout=timeout, **transport_options)
    try:
        host = control_host or str(transport_options.get("host") or "127.0.0.1")
        control = open_control(ns, rank, size, timeout=timeout, host=host, backend=backend,
                               options=transport_options, generation=generation)
        try:
            _meet(ns, rank, size, timeout)
        except BaseException:
            control.close()
            raise
    except BaseException:
        transport.close()
        raise
    return ProcessGroup(transport, timeout=group_timeout, kernel_backend=kernel_backend, control=control,
                        **group_options)


def _meet(store: Store, rank: int, size: int, timeout: float) -> None:
    """Wait until every rank has its transport (the store is not needed after this)."""
    # The rendezvous generation: the k-th init on a rank meets the k-th on every other.
    k = store.add(f"init/calls/{rank}", 1)
    store.set(f"init/{k}/ready/{rank}", b"1")
    store.wait([f"init/{k}/ready/{r}" for r in range(size)], timeout)
