"""What a node is and can do: roles, capabilities, platform and device resolution.

Capabilities travel from every worker to rank 0 as JSON (``send_caps`` /
``collect_caps``), so placement follows what the hardware can do. A received
document is validated field by field into frozen dataclasses; nothing a
peer sends is unpickled or executed.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import BackendUnavailable, ProtocolError, UsageError
from ..group.process_group import ProcessGroup
from . import wire
from .errors import StageRefused
from .fixed_function import FixedFunction
from .stage import StageSpec

__all__ = ["NodeRole", "NodeCaps", "platform_tag", "node_device", "send_caps", "collect_caps", "KNOWN_DEVICES"]

log = logging.getLogger(__name__)

#: Device directives ``node_device`` understands (besides "auto" / "").
KNOWN_DEVICES = ("cpu", "cuda", "cudasim")
_PLATFORMS = ("linux", "macos", "windows", "android", "ios", "wasm", "unknown")
_MAX_PLATFORM = 64
_WORKER, _FIXED = "worker", "fixed_function"


def platform_tag() -> str:
    """This interpreter's platform: linux, macos, windows, android, ios, wasm or unknown."""
    p = sys.platform
    if p == "android" or (p.startswith("linux") and hasattr(sys, "getandroidapilevel")):
        return "android"  # Android's Python reports "linux" before 3.13
    if p.startswith("linux"):
        return "linux"
    if p == "darwin":
        return "macos"
    if p in ("ios", "tvos", "watchos", "visionos"):
        return "ios"
    if p in ("win32", "cygwin", "msys"):
        return "windows"
    if p in ("emscripten", "wasi"):
        return "wasm"
    return "unknown"


def _available(device: str) -> bool:
    # Probed on demand (never at import): the kernels' CUDA backend loads only
    # if numba finds a real GPU and driver, and "cudasim" only under the simulator.
    from .. import kernels

    try:
        kernels.select_backend(device)
        return True
    except BackendUnavailable:
        return False


def node_device(directive: str = "auto") -> str:
    """Resolve a device directive to a concrete one ("auto"/"" pick the fastest of cuda, cpu).

    An unknown or unavailable name falls back (to what "auto" gives, or to
    cpu for an unavailable GPU) with a logged warning, never an error: a
    node with a wrong directive should still serve.
    """
    d = (directive or "auto").strip().lower() if isinstance(directive, str) else "?"
    if d == "auto":
        return "cuda" if _available("cuda") else "cpu"
    if d == "cpu":
        return d
    base = "cuda" if d.startswith("cuda:") else d
    if base in KNOWN_DEVICES:
        if _available(base):
            return d
        log.warning("device %r is not available on this node; falling back to cpu", directive)
        return "cpu"
    fallback = node_device("auto")
    log.warning("unknown device %r (known: auto, %s); falling back to %s", directive, ", ".join(KNOWN_DEVICES), fallback)
    return fallback


@dataclass(frozen=True)
class NodeRole:
    """What kind of work a node accepts: ``kind`` "worker" or "fixed_function" (with ``fixed``)."""

    kind: str = _WORKER
    fixed: FixedFunction | None = None

    def __post_init__(self) -> None:
        if self.kind not in (_WORKER, _FIXED) or (self.kind == _FIXED) != isinstance(self.fixed, FixedFunction):
            raise UsageError(f"a role is NodeRole.worker() or NodeRole.fixed_function(ff), got {self!r}")

    @classmethod
    def worker(cls) -> "NodeRole":
        """A general worker: compiles and runs whatever stage the coordinator ships."""
        return cls(_WORKER)

    @classmethod
    def fixed_function(cls, ff: FixedFunction) -> "NodeRole":
        """Fixed-function hardware that runs only the stage ``ff`` describes."""
        return cls(_FIXED, ff)

    @property
    def is_fixed_function(self) -> bool:
        """True for fixed-function hardware."""
        return self.kind == _FIXED

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"kind": self.kind, "fixed": None if self.fixed is None else self.fixed.to_dict()}

    @classmethod
    def from_dict(cls, d: Any) -> "NodeRole":
        """Parse the JSON form."""
        if not isinstance(d, Mapping):
            raise UsageError(f"a role must be a JSON object, got {d!r}")
        fixed = d.get("fixed")
        return cls(str(d.get("kind")), None if fixed is None else FixedFunction.from_dict(fixed))


@dataclass(frozen=True)
class NodeCaps:
    """What a node tells the coordinator: its rank, role, devices (best first) and platform (a free-form tag)."""

    rank: int
    role: NodeRole
    devices: tuple[str, ...]
    platform: str

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise UsageError(f"caps rank must be an int >= 0, got {self.rank!r}")
        if not isinstance(self.role, NodeRole):
            raise UsageError(f"caps role must be a NodeRole, got {self.role!r}")
        devices = tuple(self.devices) if not isinstance(self.devices, str) else (self.devices,)
        if not all(isinstance(d, str) and d for d in devices):
            raise UsageError(f"caps devices must be non-empty strings, got {self.devices!r}")
        object.__setattr__(self, "devices", devices)
        # Free-form, as in the original: only ever logged or displayed, so any short
        # printable tag will do (platform_tag() gives the known ones).
        if not isinstance(self.platform, str) or not 0 < len(self.platform) <= _MAX_PLATFORM \
                or not self.platform.isprintable():
            raise UsageError(f"caps platform must be a printable tag of 1..{_MAX_PLATFORM} characters "
                             f"(such as {', '.join(_PLATFORMS)}), got {self.platform!r:.80}")

    @classmethod
    def here(cls, rank: int, role: NodeRole | None = None, device: str = "auto") -> "NodeCaps":
        """Capabilities of this process: ``device`` resolved, then cpu, on this platform."""
        best = node_device(device)
        devices = (best,) if best == "cpu" else (best, "cpu")
        return cls(rank, role or NodeRole.worker(), devices, platform_tag())

    def accepts(self, stage: StageSpec) -> bool:
        """True if this node can run ``stage`` (a fixed-function node only its own stage id)."""
        return self.role.fixed is None or self.role.fixed.accepts(stage)

    def can_train(self) -> None:
        """Raise StageRefused if this node cannot train (fixed-function hardware)."""
        if self.role.is_fixed_function:
            raise StageRefused(f"rank {self.rank} is fixed-function stage {self.role.fixed.stage_id!r} "  # type: ignore[union-attr]
                               "and cannot train: its datapath is baked into hardware")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"rank": self.rank, "role": self.role.to_dict(), "devices": list(self.devices), "platform": self.platform}

    @classmethod
    def from_dict(cls, d: Any) -> "NodeCaps":
        """Parse the JSON form (strictly)."""
        if not isinstance(d, Mapping) or set(d) != {"rank", "role", "devices", "platform"}:
            raise UsageError(f"caps must have exactly rank, role, devices, platform; got {d!r}")
        if not isinstance(d["devices"], list):
            raise UsageError(f"caps devices must be a list, got {d['devices']!r}")
        return cls(d["rank"], NodeRole.from_dict(d["role"]), tuple(d["devices"]), d["platform"])


def send_caps(group: ProcessGroup, caps: NodeCaps) -> None:
    """Worker: announce ``caps`` to the coordinator (rank 0)."""
    if group.rank == 0:
        raise UsageError("rank 0 is the coordinator: it collects caps, it does not send them")
    if caps.rank != group.rank:
        raise UsageError(f"rank {group.rank}: caps say rank {caps.rank}")
    wire.send_json(group, 0, {"type": "caps", "caps": caps.to_dict()})


def collect_caps(group: ProcessGroup, timeout: float | None = None) -> list[NodeCaps]:
    """Coordinator: receive every worker's caps, ranks 1..world-1 in order."""
    if group.rank != 0:
        raise UsageError(f"rank {group.rank}: only rank 0 collects caps")
    out = []
    for r in range(1, group.size):
        doc = wire.recv_json(group, r, "caps", timeout=timeout)
        try:
            caps = NodeCaps.from_dict(doc["caps"] if doc else None)
        except (UsageError, KeyError) as exc:
            raise ProtocolError(f"rank 0: peer {r} sent invalid caps: {exc}") from exc
        if caps.rank != r:
            raise ProtocolError(f"rank 0: peer {r} sent caps for rank {caps.rank}")
        out.append(caps)
    return out
