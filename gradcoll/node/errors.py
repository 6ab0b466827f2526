"""The two errors the node driver adds to gradcoll's taxonomy.

``StageRefused`` is local: this node (or the coordinator on its
behalf) will not take a stage, a train spec or an input that does not fit
it; it is also a ``ValueError``. ``RemoteStageError`` is remote:
another rank reported that its stage failed, and the text is that rank's
message (only ever displayed, never interpreted).
"""

from __future__ import annotations

from ..errors import GradcollError, UsageError

__all__ = ["StageRefused", "RemoteStageError"]


class StageRefused(UsageError):
    """A node refused a stage, a train spec or an input that does not fit it."""


class RemoteStageError(GradcollError):
    """Another rank reported that its stage failed (``rank`` says which)."""

    def __init__(self, message: str, *, rank: int | None = None) -> None:
        self.rank = rank
        super().__init__(message)
