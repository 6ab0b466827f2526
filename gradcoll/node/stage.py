"""Stages as data: ``OpSpec`` / ``StageSpec`` (JSON in, JSON out) and their execution.

The coordinator ships a stage as JSON, for example:

    {"stage_id": "mlp-1", "device": "auto", "dtype": "float32",
     "ops": [{"op": "linear", "weight": "file:///w/l1.npy", "bias": "file:///w/b1.npy"},
             {"op": "gelu"}, {"op": "scale", "factor": 0.5}]}

Every op must be in the fixed registry of ``gradcoll.node.ops``, with
exactly the arguments it declares: parsing refuses anything else before a
single weight is fetched. ``compile_stage`` resolves the weight URIs
through a ``WeightCache`` and returns a
``Stage`` you call on activations. The trainer binds the same ops to
named parameters instead of URIs (``bind``, ``forward``,
``backward``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import UsageError
from .dtypes import canonical_dtype
from .ops import OPS, OpDef
from .weights import Resolver, weight_cache

__all__ = ["OpSpec", "StageSpec", "Stage", "BoundOp", "compile_stage", "bind", "forward", "backward", "check_dtype",
           "parse_ops", "float64_accumulate_of"]

def is_finite_number(value: int | float) -> bool:
    """math.isfinite that treats integers too large for a float as not finite (instead of raising)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


#: The old name of ``canonical_dtype`` (``gradcoll.node.dtypes``).
check_dtype = canonical_dtype


def float64_accumulate_of(float64_accumulate: Any, deterministic: Any = None) -> bool:
    """The ``float64_accumulate`` flag, given under that name or its old one, ``deterministic`` (None: not given).

    The old name said more than the flag does: it widens the sum to float64
    and rounds once, which makes a float32 result independent of the order
    the ranks are added in, not bitwise equal to the group's
    ``allreduce(deterministic=True)``. Both names given must agree.
    """
    if not isinstance(float64_accumulate, bool):
        raise UsageError(f"float64_accumulate must be true or false, got {float64_accumulate!r}")
    if deterministic is None:
        return float64_accumulate
    if not isinstance(deterministic, bool):
        raise UsageError(f"deterministic must be true or false, got {deterministic!r}")
    if float64_accumulate and not deterministic:
        raise UsageError("float64_accumulate=True and deterministic=False disagree (deterministic is its old name)")
    return deterministic


@dataclass(frozen=True)
class OpSpec:
    """One op of a stage: a registry name and its arguments (array references and numbers)."""

    op: str
    args: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        defn = OPS.get(self.op) if isinstance(self.op, str) else None
        if defn is None:
            raise UsageError(f"unknown op {self.op!r}; the registry has {', '.join(OPS)}")
        args = dict(self.args)
        if len(args) != len(self.args):
            raise UsageError(f"op {self.op!r} names an argument twice")
        unknown = set(args) - set(defn.arrays + defn.optional + defn.scalars)
        missing = set(defn.arrays + defn.scalars) - set(args)
        if unknown or missing:
            raise UsageError(f"op {self.op!r} takes {_signature(defn)}; "
                             + ", ".join(filter(None, (_which("unknown", unknown), _which("missing", missing)))))
        for name, value in args.items():
            if name in defn.scalars:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not is_finite_number(value):
                    raise UsageError(f"op {self.op!r}: {name} must be a finite number, got {value!r}")
            elif not isinstance(value, str) or not value:
                raise UsageError(f"op {self.op!r}: {name} must be a non-empty string reference, got {value!r}")
        object.__setattr__(self, "args", tuple(sorted(args.items())))

    @classmethod
    def of(cls, op: str, **args: Any) -> "OpSpec":
        """``OpSpec.of("linear", weight=uri, bias=uri)``."""
        return cls(op, tuple(args.items()))

    @property
    def kwargs(self) -> dict[str, Any]:
        """The arguments as a dict."""
        return dict(self.args)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: ``{"op": name, **args}``."""
        return {"op": self.op, **self.kwargs}

    @classmethod
    def from_dict(cls, d: Any) -> "OpSpec":
        """Parse the JSON form (strictly: unknown ops and arguments are refused)."""
        if not isinstance(d, Mapping) or not isinstance(d.get("op"), str):
            raise UsageError(f"an op must be an object with an \"op\" name, got {d!r}")
        return cls(d["op"], tuple((k, v) for k, v in d.items() if k != "op"))


def _signature(defn: OpDef) -> str:
    parts = list(defn.arrays) + [f"[{a}]" for a in defn.optional] + [f"{s}=<number>" for s in defn.scalars]
    return "(" + ", ".join(parts) + ")"


def _which(what: str, names: set[str]) -> str:
    return f"{what}: {', '.join(sorted(names))}" if names else ""


def parse_ops(ops: Iterable[Any]) -> tuple[OpSpec, ...]:
    """Ops from OpSpecs or their JSON dicts."""
    if isinstance(ops, (str, bytes, Mapping)) or not isinstance(ops, Iterable):
        raise UsageError(f"ops must be a list of ops, got {type(ops).__name__}")
    return tuple(o if isinstance(o, OpSpec) else OpSpec.from_dict(o) for o in ops)


@dataclass(frozen=True)
class StageSpec:
    """A pipeline stage as data: ops from the registry, an optional id, a device and a dtype."""

    ops: Sequence[OpSpec] = ()  # stored as a tuple
    stage_id: str | None = None
    device: str = "auto"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", parse_ops(self.ops))
        if self.stage_id is not None and (not isinstance(self.stage_id, str) or not self.stage_id):
            raise UsageError(f"stage_id must be a non-empty string or None, got {self.stage_id!r}")
        if not isinstance(self.device, str):
            raise UsageError(f"device must be a string, got {self.device!r}")
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"stage_id": self.stage_id, "device": self.device, "dtype": self.dtype,
                "ops": [o.to_dict() for o in self.ops]}

    def to_json(self) -> str:
        """The JSON text a coordinator ships."""
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: Any) -> "StageSpec":
        """Parse the JSON form; unknown keys are refused."""
        if not isinstance(d, Mapping):
            raise UsageError(f"a stage spec must be a JSON object, got {type(d).__name__}")
        extra = set(d) - {"stage_id", "device", "dtype", "ops"}
        if extra:
            raise UsageError(f"stage spec has unknown keys {sorted(extra)}")
        return cls(ops=d.get("ops", ()), stage_id=d.get("stage_id"), device=d.get("device", "auto"),
                   dtype=d.get("dtype", "float32"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "StageSpec":
        """Parse JSON text."""
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as exc:
            raise UsageError(f"stage spec is not valid JSON: {exc}") from exc


@dataclass(frozen=True)
class BoundOp:
    """An op with its array arguments resolved: ``args`` for the math, ``refs`` naming each array."""

    defn: OpDef
    args: dict[str, Any] = field(compare=False)
    refs: dict[str, str] = field(compare=False)


def bind(ops: Iterable[OpSpec], lookup: Callable[[str], Any], dtype: str) -> tuple[BoundOp, ...]:
    """Resolve every array reference of ``ops`` with ``lookup`` and cast it to ``dtype``."""
    out = []
    for i, o in enumerate(ops):
        defn = OPS[o.op]
        args: dict[str, Any] = {}
        refs: dict[str, str] = {}
        for name, value in o.args:
            if name in defn.scalars:
                args[name] = float(value)
                continue
            try:
                arr = lookup(value)
            except UsageError as exc:
                raise UsageError(f"op {i} ({o.op}): {exc}") from exc
            args[name] = np.asarray(arr, dtype=dtype)
            refs[name] = value
        out.append(BoundOp(defn, args, refs))
    return tuple(out)


def forward(bound: Iterable[BoundOp], x: np.ndarray) -> tuple[np.ndarray, list[Any]]:
    """Run the ops on ``x``; returns the output and what ``backward`` needs."""
    caches = []
    for i, b in enumerate(bound):
        try:
            x, cache = b.defn.forward(x, b.args)
        except UsageError as exc:
            raise UsageError(f"op {i} ({b.defn.name}): {exc}") from exc
        caches.append(cache)
    return x, caches


def backward(bound: tuple[BoundOp, ...], caches: list[Any], g: np.ndarray) -> dict[str, np.ndarray]:
    """Gradients of every referenced array (summed over the batch and over ops that share it)."""
    grads: dict[str, np.ndarray] = {}
    for b, cache in zip(reversed(bound), reversed(caches), strict=True):
        g, local = b.defn.backward(g, cache, b.args)
        for name, grad in local.items():
            ref = b.refs[name]
            grads[ref] = grads[ref] + grad if ref in grads else grad
    return grads


class Stage:
    """A compiled ``StageSpec``: call it on an activation (or a batch) to run the ops."""

    def __init__(self, spec: StageSpec, resolve: Resolver | None = None) -> None:
        self.spec = spec
        self._bound = bind(spec.ops, weight_cache(resolve), spec.dtype)

    def __call__(self, x: Any) -> np.ndarray:
        """Run the stage on ``x`` (cast to the stage dtype); returns a new array."""
        y, _ = forward(self._bound, np.asarray(x, dtype=self.spec.dtype))
        return np.ascontiguousarray(y, dtype=self.spec.dtype)


def compile_stage(spec: StageSpec, resolve: Resolver | None = None) -> Stage:
    """Resolve ``spec``'s weights (through a cache) and return the runnable stage."""
    return Stage(spec, resolve)
