"""DistributedConfig: who this process is in a coordinator cluster, and how long anything may take.

Fields as in entrenar (role, bind_addr, coordinator_addr, expect_workers,
heartbeat_interval_ms, heartbeat_timeout_ms, node_id) plus gradcoll's:
``timeout_s`` bounds every blocking call, ``secret`` turns on the HMAC join
handshake, ``max_frame_bytes`` caps frames both ways and ``shard_policy``
picks how samples are split ("fixed", entrenar's, or "epoch", rotating).
"""

from __future__ import annotations

import enum
import os
import socket
from dataclasses import dataclass, field
from typing import Any

from ..errors import UsageError
from .protocol import DEFAULT_MAX_FRAME

__all__ = ["DistributedConfig", "Role", "SHARD_POLICIES", "default_node_id", "parse_addr", "shard_bounds"]

#: Shard policies: "fixed" gives worker i the same slice every step (entrenar);
#: "epoch" rotates the slices by one worker per step.
SHARD_POLICIES = ("fixed", "epoch")


class Role(str, enum.Enum):
    """The part a process plays in the cluster."""

    COORDINATOR = "coordinator"
    WORKER = "worker"


def default_node_id() -> str:
    """``hostname-pid``, entrenar's default node id."""
    return f"{socket.gethostname()}-{os.getpid()}"


def parse_addr(addr: Any, what: str = "address") -> tuple[str, int]:
    """``"host:port"``, ``"[v6]:port"`` or ``(host, port)`` as ``(host, port)``."""
    if isinstance(addr, tuple) and len(addr) >= 2:
        host, port = str(addr[0]), addr[1]
    elif isinstance(addr, str) and ":" in addr:
        host, _, port = addr.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    else:
        raise UsageError(f"{what} must be 'host:port' or (host, port), got {addr!r}")
    try:
        port = int(port)
    except (TypeError, ValueError):
        raise UsageError(f"{what} {addr!r} has a non-numeric port") from None
    if not host or not 0 <= port <= 65535:
        raise UsageError(f"{what} {addr!r} needs a host and a port in 0..65535")
    return host, port


def shard_bounds(total: int, workers: int, worker: int, step: int = 0, policy: str = "fixed") -> tuple[int, int]:
    """Samples ``[start, end)`` of ``worker`` at ``step``: ``total // workers`` each, the last slice takes the rest."""
    if workers < 1:
        raise UsageError("no workers joined: nothing to shard (call wait_for_workers() first)")
    if total < workers:
        raise UsageError(f"total_samples={total} is fewer than the {workers} workers: every worker needs at least "
                         "one sample (call set_total_samples() with the dataset size)")
    size = total // workers
    # "epoch": slice (worker + step) mod n, so over n steps every worker sees every slice.
    slot = worker if policy == "fixed" else (worker + step) % workers
    start = slot * size
    return start, total if slot == workers - 1 else start + size


@dataclass(frozen=True)
class DistributedConfig:
    """Configuration of a coordinator or a worker; build it with ``coordinator`` or ``worker``."""

    role: Role
    bind_addr: str | tuple[str, int] | None = None
    coordinator_addr: str | tuple[str, int] | None = None
    expect_workers: int = 0
    heartbeat_interval_ms: int = 5000
    heartbeat_timeout_ms: int = 30000
    node_id: str = field(default_factory=default_node_id)
    timeout_s: float = 300.0
    secret: bytes | str | None = field(default=None, repr=False)
    max_frame_bytes: int = DEFAULT_MAX_FRAME
    shard_policy: str = "fixed"

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "role", Role(self.role))
        except ValueError:
            raise UsageError(f"role must be 'coordinator' or 'worker', got {self.role!r}") from None
        if self.role is Role.COORDINATOR:
            parse_addr(self.bind_addr, "bind_addr")
            if not isinstance(self.expect_workers, int) or self.expect_workers < 1:
                raise UsageError(f"a coordinator needs expect_workers >= 1, got {self.expect_workers!r}")
        elif self.coordinator_addr is None:
            raise UsageError("a worker config needs coordinator_addr")
        else:
            parse_addr(self.coordinator_addr, "coordinator_addr")
        if not 0 < self.heartbeat_interval_ms < self.heartbeat_timeout_ms:
            raise UsageError(f"need 0 < heartbeat_interval_ms ({self.heartbeat_interval_ms}) < heartbeat_timeout_ms "
                             f"({self.heartbeat_timeout_ms})")
        if not self.timeout_s > 0:
            raise UsageError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if not isinstance(self.max_frame_bytes, int) or not 64 <= self.max_frame_bytes < 2**32:
            raise UsageError(f"max_frame_bytes must be an int in [64, 2**32), got {self.max_frame_bytes!r}")
        if self.shard_policy not in SHARD_POLICIES:
            raise UsageError(f"shard_policy must be one of {SHARD_POLICIES}, got {self.shard_policy!r}")
        if isinstance(self.secret, str):
            object.__setattr__(self, "secret", self.secret.encode("utf-8"))
        if self.secret is not None and not self.secret:
            raise UsageError("secret must not be empty (use None for no authentication)")

    @classmethod
    def coordinator(cls, bind_addr: str | tuple[str, int], expect_workers: int, **options: Any) -> "DistributedConfig":
        """A coordinator listening on ``bind_addr`` for ``expect_workers`` workers."""
        return cls(Role.COORDINATOR, bind_addr=bind_addr, expect_workers=expect_workers, **options)

    @classmethod
    def worker(cls, coordinator_addr: str | tuple[str, int], **options: Any) -> "DistributedConfig":
        """A worker that joins the coordinator at ``coordinator_addr``."""
        return cls(Role.WORKER, coordinator_addr=coordinator_addr, **options)

    @property
    def secret_key(self) -> bytes | None:
        """``secret`` as bytes (a str secret is its UTF-8 encoding)."""
        return self.secret.encode("utf-8") if isinstance(self.secret, str) else self.secret

    @property
    def heartbeat_interval_s(self) -> float:
        """``heartbeat_interval_ms`` in seconds."""
        return self.heartbeat_interval_ms / 1000.0

    @property
    def heartbeat_timeout_s(self) -> float:
        """``heartbeat_timeout_ms`` in seconds."""
        return self.heartbeat_timeout_ms / 1000.0
