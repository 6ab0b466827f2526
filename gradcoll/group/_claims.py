"""Who holds a rank: every start records a claim, and a second live process started as the same rank is refused.

``init_process_group`` gives the k-th start of a rank the k-th generation of
the store (``calls/{rank}``), which meets the k-th start of every other
rank. A second process started as rank 1 against the same store therefore
draws generation 2; without a check it waited there until the startup
timeout while the first one ran with the others. So every start writes a
*claim* under ``claims/{rank}/{generation}`` right after drawing its
generation: host name, pid namespace, pid, the process's start time and a
random token of the process. A start of generation g > 1 then reads the
claim of generation g - 1:

* the same process (same token): a second ``init_process_group`` after the
  first group was destroyed, as re-initialising programs and tests do: fine;
* another process of this host (same host name and pid namespace) that is
  still alive (``os.kill(pid, 0)``; on Linux also the same start time, so a
  recycled pid does not count, and not a zombie): a duplicate, a
  ``UsageError`` naming both processes (``rank 1 joined twice: from host A
  pid 123 and host A pid 456``);
* another process of this host that is gone: the rank was restarted after a
  crash: fine;
* a process of another host: whether it lives cannot be checked from here,
  and a rank restarted on another host looks the same, so it is no error;
  the progress log and the startup timeout then say ``rank 1 was also
  claimed by host X pid N: was it started twice?``.

Which side fails. Both claimants are the same to the protocol (the first is
whichever drew its generation first, a race), so the duplicate also vetoes
the earlier generation if its startup has not finished (``veto``): every
rank waiting there raises the same UsageError, within about a second, and
nobody runs with whichever process happened to come first. Running on would
let a job started twice, or two jobs given one rendezvous address, mix one
job's gradients into the other's without an error. A group whose startup
had finished is left alone (its ranks are connected to each other); only
the newcomer fails. The duplicate then gives its generation back
(``calls/{rank}`` minus one, unless another start drew after it), so that
the running group can still meet the other ranks again on this store.

The decision is made once per generation, by the counter ``join/seats``
that every rank of the barrier increments by one and a veto by ``VETO``:
the rank that takes the last seat seals the startup (``join/sealed``) if no
veto came before it, else it publishes the veto as ``join/error``; a veto
that came after the last seat is void. Every other rank waits for one of
the two keys, so all ranks of a generation agree.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from dataclasses import dataclass

from .._util import Deadline
from ..errors import CollectiveTimeout, ProtocolError, UsageError
from ..store import PrefixStore, Store

__all__ = ["Claim", "claim", "veto", "seal", "parse_join", "VETO", "CLAIM_WAIT_S"]

log = logging.getLogger("gradcoll")

#: What a veto adds to ``join/seats``: more than any number of ranks, so ``seats % VETO`` still counts them.
VETO = 1 << 32
#: Longest wait for the previous claim of a rank when its key is not there yet (it is written right after the
#: previous start drew its generation: only a process that died in between never writes it).
CLAIM_WAIT_S = 5.0
_tokens: dict[int, str] = {}  # pid -> token: a forked child is a process of its own


@dataclass(frozen=True)
class Claim:
    """One start of a rank: where it ran, which process, and the process's random token."""

    host: str
    pidns: str
    pid: int
    started: str
    token: str

    @classmethod
    def here(cls) -> "Claim":
        """The claim of this process."""
        pid = os.getpid()
        token = _tokens.setdefault(pid, secrets.token_hex(8))
        return cls(socket.gethostname(), _pid_namespace(), pid, _stat(pid)[1], token)

    def encode(self) -> bytes:
        return "\n".join(("claim1", self.host, self.pidns, str(self.pid), self.started, self.token)).encode()

    @classmethod
    def decode(cls, raw: bytes, key: str) -> "Claim":
        try:
            tag, host, pidns, pid, started, token = raw.decode().split("\n")
            if tag != "claim1":
                raise ValueError(tag)
            return cls(host, pidns, int(pid), started, token)
        except (UnicodeDecodeError, ValueError):
            raise ProtocolError(f"store key {key!r} holds {raw[:64]!r}, not a rank's claim") from None

    def where(self) -> str:
        return f"host {self.host} pid {self.pid}"

    def alive(self) -> bool:
        """Whether this claim's process still runs (only meaningful on its own host and pid namespace)."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # it exists, as another user's process
        state, started = _stat(self.pid)
        if state in ("Z", "X"):
            return False  # dead, not yet reaped by its parent
        return not (started and self.started and started != self.started)  # a recycled pid is another process


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _stat(pid: int) -> tuple[str, str]:
    """(state, start time in clock ticks since boot) from ``/proc``; empty strings where there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0].decode(), fields[19].decode()
    except (OSError, IndexError, UnicodeDecodeError):
        return "", ""


def claim(base: Store, rank: int, generation: int, deadline: Deadline) -> str | None:
    """Record this start of ``rank`` and check the previous one (the module docstring).

    Raises UsageError if a live process of this host holds the previous
    generation; returns a note for the startup messages when the previous
    claimant is on another host, else None.
    """
    me = Claim.here()
    base.set(f"claims/{rank}/{generation}", me.encode())
    if generation <= 1:
        return None
    key = f"claims/{rank}/{generation - 1}"
    left = deadline.remaining()
    left = CLAIM_WAIT_S if left is None else left
    try:  # a key that is there waits only for the store's answer; a missing one at most CLAIM_WAIT_S
        wait = max(1.0, left) if base.check([key]) else max(0.001, min(CLAIM_WAIT_S, left))
        prev = Claim.decode(base.get(key, wait), key)
    except CollectiveTimeout:
        return None
    if prev.token == me.token and prev.pid == me.pid:
        return None
    if (prev.host, prev.pidns) != (me.host, me.pidns):
        return f"rank {rank} was also claimed by {prev.where()}: was it started twice?"
    if not prev.alive():
        log.info("rank %d: the previous start of this rank (%s) has ended: this start takes its place", rank,
                 prev.where())
        return None
    why = (f"rank {rank} joined twice: from {prev.where()} and {me.where()}, both alive, against the same "
           "rendezvous store. Start each rank once (two jobs need two rendezvous addresses: MASTER_PORT or "
           "init_method)")
    started = veto(PrefixStore(str(generation - 1), base), rank, why, deadline)
    if base.add(f"calls/{rank}", -1) != generation - 1:
        base.add(f"calls/{rank}", 1)  # another start drew after this one: its generation stays its own
    if not started:
        why += f"; the group {prev.where()} belongs to had finished its startup and goes on without this process"
    raise UsageError(why)


def veto(prev: Store, rank: int, why: str, deadline: Deadline) -> bool:
    """Fail the startup of the generation ``prev`` with ``why`` unless it is sealed; True if it was not."""
    prev.set("join/veto", why.encode())
    seats = prev.add("join/seats", VETO) % VETO
    record = prev.get(f"join/{rank}", max(1.0, deadline.remaining() or 1.0)) if prev.check([f"join/{rank}"]) else None
    # Without the other claimant's record its seat was not taken before the veto: the startup cannot be sealed.
    if record is None or seats < parse_join(record, rank)[0]:
        prev.set("join/error", why.encode())
        return True
    return False


def seal(store: Store, rank: int, size: int, seat: int, deadline: Deadline) -> bool:
    """Every rank has joined: True once the startup is sealed (this rank took the last seat, or saw the seal)."""
    if seat % VETO != size:
        return store.check(["join/sealed"])
    if seat < VETO:  # the last seat, and no veto before it: the group starts
        store.set("join/sealed", b"1")
        return True
    why = store.get("join/veto", max(1.0, deadline.remaining() or 1.0))
    store.set("join/error", why)  # the veto came first: every rank raises it
    raise UsageError(f"rank {rank}: {why.decode(errors='replace')}")


def parse_join(raw: bytes, r: int) -> tuple[int, str]:
    """(world size, where it came from) of rank ``r``'s startup record."""
    try:
        size, source = raw.decode().split("\n", 1)
        return int(size), source
    except (UnicodeDecodeError, ValueError):
        raise ProtocolError(f"rank {r} published a malformed startup record {raw[:40]!r}") from None
