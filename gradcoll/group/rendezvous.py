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

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from .. import _auth
from .._util import Deadline
from ..errors import BackendUnavailable, CollectiveTimeout, UsageError, seconds
from ..store import FileStore, PrefixStore, Store, TCPStore
from ._claims import claim, parse_join, seal
from .connect import connect, load_backend
from .process_group import ProcessGroup

__all__ = ["init_process_group", "parse_init_method", "env_rank_size", "InitMethod", "DEFAULT_PORT",
           "DEFAULT_STARTUP_TIMEOUT", "join"]

log = logging.getLogger("gradcoll")

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


def _default_kernels() -> str | None:
    """'cython' when the compiled extension loads here, else None (automatic choice).

    Only the compiled backend is probed: asking for every available backend imports the GPU one too,
    which costs seconds at every start-up.
    """
    from ..kernels.select import load_backend as load_kernels

    try:
        load_kernels("cython")
    except BackendUnavailable:
        return None
    return "cython"


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
    startup_timeout: float | None = None,
    secret: bytes | str | None = None,
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
    cores (many times slower than one thread per rank). Pass ``kernel_backend="numba"``
    when one rank owns several cores.
    ``stall_warning_s`` and ``trace`` go to the ProcessGroup (stall warnings,
    Chrome trace path). The group also gets a control channel (a UDP socket
    per rank on the tcp ``host`` option, default 127.0.0.1) for stall reports
    and ``shrink()``; see ``gradcoll.observe.diagnosis``.

    Startup: every rank publishes the world size it was given (and where it
    came from: the argument or a launcher's variable); ranks that disagree
    raise UsageError within about a second, naming both values. A rank
    waiting for the others logs, every few seconds on logger ``"gradcoll"``,
    which ranks have joined and which have not. ``startup_timeout`` (default
    ``GRADCOLL_STARTUP_TIMEOUT`` or 60 s, never more than ``timeout``) bounds
    the whole startup; ``timeout`` bounds every later collective.
    Raises BackendUnavailable if that module is missing, UsageError for a
    missing rank/size, a world-size disagreement, a bad init_method or a
    store address already in use, ProtocolError when the address reached is
    not a gradcoll store, CollectiveTimeout if the others do not show up
    within ``startup_timeout`` seconds. A second live process started as
    the same rank against the same store raises UsageError naming both
    processes, at once, and so does every rank of the first one's group if
    its startup had not finished (``gradcoll.group._claims``); a second
    init from the same process, or a restart after the first process died,
    is no error.

    ``secret`` (bytes or str; default ``GRADCOLL_SECRET``; none if unset):
    every connection of the group proves both ends know it: the TCPStore's
    clients and server, every tcp link and shm segment, and every control
    datagram (HMAC challenge-response and tags; docs/wire.md). A peer
    without it is refused and logged with its address. Without a secret the
    group trusts everything that can reach its addresses (127.0.0.1 by
    default): see docs/reliability.md.
    """
    if backend is None:
        backend = os.environ.get("GRADCOLL_BACKEND") or "tcp"
    rank, world_size, source = _rank_and_size(rank, world_size)
    boot = _startup_timeout(startup_timeout, timeout)
    module = load_backend(backend)
    if callable(prepare := getattr(module, "prepare", None)):
        prepare()  # process-wide set-up the transport needs before the rendezvous (MPI_Init: see transport/mpi.py)
    if kernel_backend is None:
        kernel_backend = _default_kernels()
    key = _auth.resolve(secret)
    if key is not None and backend in ("tcp", "shm"):
        transport_options = {**transport_options, "secret": key}  # also read by the control channel
    owned = store is None
    if store is None:
        store = _open_store(parse_init_method(init_method), rank, boot, key)
    try:
        base = PrefixStore("gradcoll", store)
        # The k-th init on a rank meets the k-th on every other: each gets a namespace of its own.
        generation = base.add(f"calls/{rank}", 1)
        note = claim(base, rank, generation, Deadline(boot))
        ns = PrefixStore(f"gradcoll/{generation}", store)
        join(ns, rank, world_size, source, boot, note)
        return connect(ns, backend, rank, world_size, timeout=boot, group_timeout=timeout,
                       kernel_backend=kernel_backend, transport_options=transport_options,
                       group_options={"stall_warning_s": stall_warning_s, "trace": trace})
    finally:
        if owned:
            store.close()  # the TCPStore master lingers until the other ranks have disconnected


#: Startup timeout (seconds) when neither ``startup_timeout=`` nor GRADCOLL_STARTUP_TIMEOUT says otherwise.
DEFAULT_STARTUP_TIMEOUT = 60.0
#: How often a rank waiting at startup logs who has joined.
PROGRESS_S = 5.0

_NO_LAUNCHER = (
    "rank and world_size were not given and no launcher set them. Start the ranks with "
    "`gradcoll launch -n N script.py` (or torchrun, mpirun, srun), or set RANK and WORLD_SIZE (and MASTER_ADDR, "
    "MASTER_PORT) in each rank's environment, or pass rank= and world_size= to init_process_group"
)


def _rank_and_size(rank: int | None, world_size: int | None) -> tuple[int, int, str]:
    """The rank and world size to use, and where the world size came from (for messages)."""
    env = os.environ
    env_rank, env_size, _ = env_rank_size(env)
    size_var = next((v for v in _SIZE_VARS if (env.get(v) or "").strip()), None)
    if world_size is not None:
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise UsageError(f"world_size must be an int, got {world_size!r}")
        source = f"argument world_size={world_size}"
        if rank is None and env_size is not None and env_size != world_size:
            # The rank comes from a launcher that started env_size ranks: world_size disagrees with it.
            raise UsageError(
                f"world size mismatch: init_process_group(world_size={world_size}) was given, but the launcher "
                f"started {env_size} ranks (environment {size_var}={env_size}) and set this rank's number; "
                f"drop world_size= to use the launcher's, or start {world_size} ranks"
            )
    else:
        world_size = env_size
        source = f"environment {size_var}={env_size}"
    if rank is None:
        rank = env_rank
    if rank is None or world_size is None:
        missing = " and ".join(w for w, v in (("rank", rank), ("world_size", world_size)) if v is None)
        raise UsageError(f"{missing} not known: {_NO_LAUNCHER}")
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise UsageError(f"rank must be an int, got {rank!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise UsageError(f"rank {rank} out of range for world size {world_size} ({source})")
    return rank, world_size, source


def _startup_timeout(startup_timeout: float | None, timeout: float) -> float:
    if startup_timeout is None:
        raw = os.environ.get("GRADCOLL_STARTUP_TIMEOUT", "").strip()
        try:
            startup_timeout = float(raw) if raw else DEFAULT_STARTUP_TIMEOUT
        except ValueError:
            raise UsageError(f"GRADCOLL_STARTUP_TIMEOUT={raw!r} is not a number of seconds") from None
        startup_timeout = min(startup_timeout, timeout)
    if not startup_timeout > 0:
        raise UsageError(f"startup_timeout must be positive, got {startup_timeout!r}")
    return float(startup_timeout)


def _open_store(where: InitMethod, rank: int, timeout: float, key: bytes | None = None) -> Store:
    """The rendezvous store of ``where``: rank 0 hosts the TCPStore, or everyone opens the FileStore.

    Where torch already serves ``MASTER_ADDR:MASTER_PORT``, every rank joins
    torch's store instead (through [`gradcoll.store.c10d`][gradcoll.store.c10d]):
    under torchrun, whose agent hosts it (``TORCHELASTIC_USE_AGENT_STORE=True``),
    and in a process that has initialised ``torch.distributed`` already.
    ``key``: the group's secret, for the TCPStore (torch's store is torch's own).
    """
    if where.scheme == "file":
        return FileStore(where.path, timeout=timeout)
    env = os.environ
    if (where.host, str(where.port)) == (env.get("MASTER_ADDR") or "127.0.0.1", env.get("MASTER_PORT", "")):
        from ..store.c10d import agent_store, torch_default_store, uses_agent_store

        torch_store = torch_default_store(timeout)
        if torch_store is not None:
            return torch_store
        if uses_agent_store(env):
            return agent_store(where.host, where.port, timeout)
    try:
        return TCPStore(where.host, where.port, is_master=rank == 0, timeout=timeout, secret=key)
    except UsageError as exc:
        if rank != 0:
            raise
        raise UsageError(
            f"rank 0 cannot host the rendezvous store on {where.host}:{where.port}: the address is already in use "
            "(another job, or a launcher that holds it). Pick another MASTER_PORT (or init_method port), or start "
            "the ranks with `gradcoll launch -n N script.py`, which picks a free port"
        ) from exc


def join(store: Store, rank: int, size: int, source: str, timeout: float, note: str | None = None) -> None:
    """Startup barrier: publish this rank's world size, wait for every rank, check that all agree.

    A disagreement raises UsageError on this rank and is left in the store
    (``join/error``) so that every other waiting rank raises it too, within
    about a second. Every ``PROGRESS_S`` seconds a waiting rank logs who
    has joined and who has not (and ``note``, if any, in that log and in
    the timeout). Every rank takes a seat (``join/seats``); the one that
    takes the last seals the startup (``join/sealed``) unless a duplicate
    of a rank vetoed it first (``gradcoll.group._claims``), and the others
    return once they see the seal.
    """
    store.set(f"join/{rank}", f"{size}\n{source}".encode())
    seat = store.add("join/seats", 1)
    deadline = Deadline(timeout)
    arrived: dict[int, str] = {rank: source}
    next_log = time.monotonic() + PROGRESS_S
    while True:
        if store.check(["join/error"]):
            why = store.get("join/error", max(1.0, deadline.remaining() or 1.0)).decode(errors="replace")
            raise UsageError(f"rank {rank}: {why}")
        now = time.monotonic()
        full_scan = now >= next_log or deadline.expired()
        for r in range(size):
            if r in arrived:
                continue
            if not store.check([f"join/{r}"]):
                if full_scan:
                    continue
                break
            # The key is there: the wait is only for the store's answer, which a loaded rank 0 may be slow to give.
            their_size, their_source = parse_join(store.get(f"join/{r}", max(1.0, deadline.remaining() or 1.0)), r)
            if their_size != size:
                msg = (f"world size mismatch: rank {rank} was given {size} ({source}), rank {r} was given "
                       f"{their_size} ({their_source}); every rank must be started with the same world size")
                store.set("join/error", msg.encode())
                raise UsageError(f"rank {rank}: {msg}")
            arrived[r] = their_source
        missing = [r for r in range(size) if r not in arrived]
        if not missing and seal(store, rank, size, seat, deadline):
            return
        extra = f" {note}" if note else ""
        if deadline.expired():
            what = (f"rank(s) {_ranks(missing)} never arrived" if missing else
                    "every rank joined but the startup was never sealed (a rank died during startup?)")
            raise CollectiveTimeout(
                f"rank {rank}: startup timed out after {seconds(timeout)}s: {len(arrived)} of {size} ranks joined "
                f"({_ranks(sorted(arrived))}); {what}. Check that {size} ranks were "
                f"started ({source}) and that each reaches the rendezvous address; startup_timeout= or "
                f"GRADCOLL_STARTUP_TIMEOUT waits longer.{extra}",
                rank=rank, missing=missing, op="startup",
            )
        if full_scan:
            if missing:
                log.warning("rank %d: waiting for rank(s) %s to join (%d of %d here: %s) after %ss; giving up after "
                            "%ss%s", rank, _ranks(missing), len(arrived), size, _ranks(sorted(arrived)),
                            seconds(timeout - (deadline.remaining() or 0.0)), seconds(timeout),
                            f";{extra}" if note else "")
            next_log = now + PROGRESS_S
        wait = min(1.0, deadline.remaining() or 0.0, max(0.0, next_log - time.monotonic()))
        try:  # wakes when the first missing rank arrives (or the seal); at least once a second for join/error
            store.get(f"join/{missing[0]}" if missing else "join/sealed", max(wait, 0.001))
        except CollectiveTimeout:
            pass


def _ranks(rs: list[int]) -> str:
    """``0-3, 5`` for a message."""
    out: list[str] = []
    for r in rs:
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out)
