"""``TrainSpec``: a data-parallel training job as JSON data.

For example:

    {"ops": [{"op": "linear", "weight": "w1", "bias": "b1"}, {"op": "relu"},
             {"op": "linear", "weight": "w2"}],
     "params": [["w1", "file:///job/w1.npy"], ["b1", "file:///job/b1.npy"], ["w2", "file:///job/w2.npy"]],
     "data": {"x": "file:///job/x.npy", "y": "file:///job/y.npy", "shard_start": 0, "shard_len": 64,
              "pushed": null},
     "loss": "mse", "momentum": 0.9, "lr": [0.1, 0.1, 0.05], "batch": 16,
     "dtype": "float32", "float64_accumulate": false}

The ops come from the same registry as a stage's, but name parameters
(``params`` maps each name to the URI of its initial value) instead of
weight URIs. Each rank trains on rows ``[shard_start, shard_start +
shard_len)`` of ``x``/``y`` for ``len(lr)`` epochs (one learning rate per
epoch) in batches of ``batch`` rows, the last batch of an epoch possibly
shorter. ``pushed`` optionally carries this rank's shard inline
(``{"x": [[...], ...], "y": [...]}``, exactly ``shard_len`` rows) for a node
with no file access. ``loss`` is ``mse`` (mean over output features of the
squared error) or ``cross_entropy`` (``y`` holds class indices; the model
outputs logits). ``float64_accumulate`` sums the gradients across ranks in
float64 and rounds once (see `gradcoll.node.reduce`); its old name,
``deterministic``, is still read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..errors import UsageError
from .dtypes import canonical_dtype
from .ops import OPS
from .stage import OpSpec, float64_accumulate_of, is_finite_number, parse_ops

__all__ = ["DataSpec", "TrainSpec", "LOSSES"]

#: Loss functions a train spec may name.
LOSSES = ("mse", "cross_entropy")


def _int(name: str, v: Any, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise UsageError(f"{name} must be an int >= {lo}, got {v!r}")
    return v


def _num(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not is_finite_number(v):
        raise UsageError(f"{name} must be a finite number, got {v!r}")
    return float(v)


def _rows(name: str, v: Any, n: int) -> np.ndarray:
    try:
        a = np.array(v, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"pushed {name} must be a rectangular array of numbers ({exc})") from None
    if a.ndim == 0 or a.shape[0] != n:
        raise UsageError(f"pushed {name} must have shard_len = {n} rows, got shape {a.shape}")
    return a


@dataclass(frozen=True)
class DataSpec:
    """Where a rank's training rows come from: URIs and a shard, or rows pushed inline."""

    x: str | None = None
    y: str | None = None
    shard_start: int = 0
    shard_len: int = 1
    pushed_x: np.ndarray | None = field(default=None, compare=False, repr=False)
    pushed_y: np.ndarray | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        _int("shard_start", self.shard_start, 0)
        _int("shard_len", self.shard_len, 1)
        if (self.pushed_x is None) != (self.pushed_y is None):
            raise UsageError("pushed data needs both x and y")
        if self.pushed_x is not None:
            object.__setattr__(self, "pushed_x", _rows("x", self.pushed_x, self.shard_len))
            object.__setattr__(self, "pushed_y", _rows("y", self.pushed_y, self.shard_len))
        elif not (isinstance(self.x, str) and self.x and isinstance(self.y, str) and self.y):
            raise UsageError("data needs x and y URIs, or pushed rows")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        pushed = None if self.pushed_x is None else {"x": self.pushed_x.tolist(), "y": self.pushed_y.tolist()}  # type: ignore[union-attr]
        return {"x": self.x, "y": self.y, "shard_start": self.shard_start, "shard_len": self.shard_len,
                "pushed": pushed}

    @classmethod
    def from_dict(cls, d: Any) -> "DataSpec":
        """Parse the JSON form."""
        if not isinstance(d, Mapping) or not set(d) <= {"x", "y", "shard_start", "shard_len", "pushed"}:
            raise UsageError(f"data must have x, y, shard_start, shard_len and optional pushed; got {d!r}")
        pushed = d.get("pushed")
        if pushed is not None and (not isinstance(pushed, Mapping) or set(pushed) != {"x", "y"}):
            raise UsageError("pushed data must be {\"x\": rows, \"y\": rows}")
        return cls(d.get("x"), d.get("y"), d.get("shard_start", 0), d.get("shard_len", 1),
                   None if pushed is None else pushed["x"], None if pushed is None else pushed["y"])


def _pairs(params: Any) -> tuple[tuple[str, str], ...]:
    """``params`` as (name, uri) pairs, from a mapping or a list of pairs (checked by the caller)."""
    if isinstance(params, Mapping):
        return tuple(params.items())
    if isinstance(params, (str, bytes)) or not isinstance(params, Sequence):
        raise UsageError("params must be a mapping or a list of [name, uri] pairs")
    return tuple(tuple(p) if isinstance(p, (list, tuple)) else (p,) for p in params)


@dataclass(frozen=True, init=False)
class TrainSpec:
    """One rank's training job (see the module doc for the JSON form).

    ``deterministic=`` is accepted as the old name of ``float64_accumulate=``
    (and ``spec.deterministic`` reads it).
    """

    ops: Sequence[OpSpec]  # stored as a tuple, like params and lr
    params: Sequence[tuple[str, str]]  # (name, uri) pairs; a {name: uri} mapping is accepted too
    data: DataSpec
    lr: Sequence[float]
    momentum: float = 0.0
    batch: int = 1
    loss: str = "mse"
    dtype: str = "float32"
    float64_accumulate: bool = False

    def __init__(self, ops: Sequence[OpSpec], params: Sequence[tuple[str, str]], data: DataSpec, lr: Sequence[float],
                 momentum: float = 0.0, batch: int = 1, loss: str = "mse", dtype: str = "float32",
                 float64_accumulate: bool = False, *, deterministic: bool | None = None) -> None:
        for name, value in (("ops", ops), ("params", params), ("data", data), ("lr", lr), ("momentum", momentum),
                            ("batch", batch), ("loss", loss), ("dtype", dtype)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "float64_accumulate", float64_accumulate_of(float64_accumulate, deterministic))
        self.__post_init__()

    @property
    def deterministic(self) -> bool:
        """The old name of ``float64_accumulate``."""
        return self.float64_accumulate

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", parse_ops(self.ops))
        params = _pairs(self.params)
        if not params or any(len(p) != 2 or not all(isinstance(s, str) and s for s in p) for p in params) \
                or len({p[0] for p in params}) != len(params):
            raise UsageError(f"params must be distinct (name, uri) string pairs, got {self.params!r}")
        object.__setattr__(self, "params", params)
        names = {p[0] for p in params}
        for i, o in enumerate(self.ops):
            for arg, ref in o.args:
                if arg not in OPS[o.op].scalars and ref not in names:
                    raise UsageError(f"op {i} ({o.op}) names parameter {ref!r}, which params does not define")
        if not isinstance(self.data, DataSpec):
            raise UsageError(f"data must be a DataSpec, got {self.data!r}")
        lr = tuple(_num("lr", v) for v in ((self.lr,) if isinstance(self.lr, (int, float)) else self.lr))
        if not lr:
            raise UsageError("lr needs one learning rate per epoch (at least one)")
        object.__setattr__(self, "lr", lr)
        object.__setattr__(self, "momentum", _num("momentum", self.momentum))
        _int("batch", self.batch, 1)
        if self.loss not in LOSSES:
            raise UsageError(f"loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch (the last may be short)."""
        return -(-self.data.shard_len // self.batch)

    def shards(self, world: int) -> list["TrainSpec"]:
        """``world`` specs with consecutive uniform shards: rank r reads rows ``start + r*len ...``."""
        if self.data.pushed_x is not None:
            raise UsageError("pushed data is one rank's shard; build one spec per rank instead")
        d = self.data
        return [replace(self, data=replace(d, shard_start=d.shard_start + r * d.shard_len)) for r in range(world)]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"ops": [o.to_dict() for o in self.ops], "params": [list(p) for p in self.params],
                "data": self.data.to_dict(), "lr": list(self.lr), "momentum": self.momentum,
                "batch": self.batch, "loss": self.loss, "dtype": self.dtype,
                "float64_accumulate": self.float64_accumulate}

    def to_json(self) -> str:
        """The JSON text a coordinator ships."""
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: Any) -> "TrainSpec":
        """Parse the JSON form; unknown keys are refused."""
        keys = {"ops", "params", "data", "lr", "momentum", "batch", "loss", "dtype", "float64_accumulate", "deterministic"}
        if not isinstance(d, Mapping) or not {"ops", "params", "data", "lr"} <= set(d) <= keys:
            raise UsageError(f"a train spec needs ops, params, data, lr (optional: momentum, batch, loss, dtype, "
                             f"float64_accumulate); got {sorted(d) if isinstance(d, Mapping) else d!r}")
        old = d.get("deterministic")  # the old name of float64_accumulate
        if "deterministic" in d and old is None:
            raise UsageError("deterministic must be true or false, got None")
        params = _pairs(d["params"])
        lr = d["lr"]
        if not isinstance(lr, list):
            raise UsageError("lr must be a list (one learning rate per epoch)")
        return cls(d["ops"], params, DataSpec.from_dict(d["data"]), tuple(lr), d.get("momentum", 0.0),
                   d.get("batch", 1), d.get("loss", "mse"), d.get("dtype", "float32"), d.get("float64_accumulate", False),
                   deterministic=old)

    @classmethod
    def from_json(cls, text: str | bytes) -> "TrainSpec":
        """Parse JSON text."""
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as exc:
            raise UsageError(f"train spec is not valid JSON: {exc}") from exc
