"""Fixed-function hardware: the stage descriptor, the board protocol and a software board.

A fixed-function node (an FPGA with a synthesized datapath) cannot compile
a shipped graph. It advertises the one stage it implements as a
``FixedFunction`` and refuses any stage with another id, any input of
the wrong length, and any board output of the wrong length. ``dtype`` is
the element type the datapath was synthesized for, in any spelling
``gradcoll.node.dtypes`` reads (``"f32"`` or ``"float32"``), stored and sent
in its canonical one. The serving loop is
``gradcoll.node.serve_fixed_function_n``; it converts each activation to
``exchange_dtype`` on the host: the datapath's own type when NumPy computes
in it (float16/32/64), else float32, which the board's driver converts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..errors import UsageError
from .dtypes import BOARD_DTYPES, canonical_dtype, exchange_dtype
from .errors import StageRefused
from .stage import StageSpec

__all__ = ["FixedFunction", "FixedFunctionDevice", "LoopbackFixedFunction"]


@dataclass(frozen=True)
class FixedFunction:
    """The one stage a piece of hardware implements: its id, input/output lengths and datapath dtype."""

    stage_id: str
    input_elems: int
    output_elems: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not isinstance(self.stage_id, str) or not self.stage_id:
            raise UsageError(f"fixed-function stage_id must be a non-empty string, got {self.stage_id!r}")
        for name in ("input_elems", "output_elems"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise UsageError(f"fixed-function {name} must be an int >= 0, got {n!r}")
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype, BOARD_DTYPES, what="fixed-function dtype"))

    @property
    def exchange_dtype(self) -> str:
        """The dtype the host hands the board and reads back (float32 for bfloat16 and integer datapaths)."""
        return exchange_dtype(self.dtype)

    def accepts(self, spec: StageSpec) -> bool:
        """True if ``spec`` is this stage; ``check_stage`` raises with the reason instead."""
        return spec.stage_id == self.stage_id

    def check_stage(self, spec: StageSpec) -> None:
        """Raise StageRefused unless ``spec`` is this stage (errors name both ids)."""
        if not self.accepts(spec):
            raise StageRefused(f"fixed-function stage {self.stage_id!r} cannot run stage {spec.stage_id!r}: "
                               "its datapath is baked into hardware")

    def check_input(self, x: np.ndarray) -> None:
        """Raise StageRefused unless ``x`` has ``input_elems`` elements."""
        if x.size != self.input_elems:
            raise StageRefused(f"fixed-function stage {self.stage_id!r} takes {self.input_elems} elems, got {x.size}")

    def check_output(self, y: np.ndarray) -> None:
        """Raise StageRefused unless the board produced ``output_elems`` elements."""
        if y.size != self.output_elems:
            raise StageRefused(f"fixed-function stage {self.stage_id!r} must produce {self.output_elems} elems, "
                               f"the board returned {y.size}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"stage_id": self.stage_id, "input_elems": self.input_elems,
                "output_elems": self.output_elems, "dtype": self.dtype}

    @classmethod
    def from_dict(cls, d: Any) -> "FixedFunction":
        """Parse the JSON form."""
        if not isinstance(d, Mapping) or set(d) != {"stage_id", "input_elems", "output_elems", "dtype"}:
            raise UsageError(f"a fixed-function descriptor has stage_id, input_elems, output_elems, dtype; got {d!r}")
        return cls(d["stage_id"], d["input_elems"], d["output_elems"], d["dtype"])


@runtime_checkable
class FixedFunctionDevice(Protocol):
    """The host-side driver of a fixed-function board."""

    def stage_id(self) -> str:
        """The id of the stage the hardware implements (checked against the descriptor)."""
        ...

    def execute(self, x: np.ndarray) -> np.ndarray:
        """Push one activation through the datapath and return the result."""
        ...


class LoopbackFixedFunction:
    """A software stand-in for a board: runs ``fn`` so the fixed-function path works with no FPGA."""

    def __init__(self, stage_id: str, fn: Callable[[np.ndarray], Any]) -> None:
        self._stage_id = stage_id
        self._fn = fn

    def stage_id(self) -> str:
        """The id this board claims to implement."""
        return self._stage_id

    def execute(self, x: np.ndarray) -> np.ndarray:
        """``fn(x)`` as an array."""
        return np.asarray(self._fn(x))

    def __repr__(self) -> str:
        return f"LoopbackFixedFunction({self._stage_id!r})"
