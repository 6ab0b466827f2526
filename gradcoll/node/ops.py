"""The fixed op registry: forward and backward math of every op a stage may name.

A stage is data, so the set of things it can do is this table and nothing
else: a peer can pick ops and their arguments, never supply code. Each op
works on activations of shape ``(..., features)`` (a single activation
vector or a batch of them) with vectorised NumPy, which on a CPU runs in
BLAS and SIMD loops and needs no per-process JIT warm-up.

``forward(x, args) -> (y, cache)`` and ``backward(g, cache, args) -> (dx,
grads)``, where ``args`` maps argument names to arrays (already in the
activation dtype) or scalars, and ``grads`` maps the array arguments to
their gradients summed over the batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import UsageError

__all__ = ["OpDef", "OPS"]

Args = dict[str, Any]
Grads = dict[str, np.ndarray]


@dataclass(frozen=True)
class OpDef:
    """One registry entry: which arguments the op takes and its math."""

    name: str
    arrays: tuple[str, ...] = ()  # required array arguments (URIs in a stage, param names in training)
    optional: tuple[str, ...] = ()  # optional array arguments
    scalars: tuple[str, ...] = ()  # required numeric arguments
    forward: Callable[[np.ndarray, Args], tuple[np.ndarray, Any]] = lambda x, a: (x, None)
    backward: Callable[[np.ndarray, Any, Args], tuple[np.ndarray, Grads]] = lambda g, c, a: (g, {})


def _rows(a: np.ndarray) -> np.ndarray:
    """``a`` as a 2-D ``(lanes, features)`` view, so batch and single vectors share one code path."""
    return a.reshape(-1, a.shape[-1])


def _linear_fwd(x: np.ndarray, a: Args) -> tuple[np.ndarray, Any]:
    w = a["weight"]
    if w.ndim != 2:
        raise UsageError(f"linear weight must be 2-D (out, in), got shape {w.shape}")
    if x.shape[-1] != w.shape[1]:
        raise UsageError(f"linear weight {w.shape} takes {w.shape[1]} features, the input has {x.shape[-1]}")
    y = x @ w.T
    b = a.get("bias")
    if b is not None:
        if b.shape != (w.shape[0],):
            raise UsageError(f"linear bias has shape {b.shape}, expected ({w.shape[0]},)")
        y += b
    return y, x


def _linear_bwd(g: np.ndarray, x: np.ndarray, a: Args) -> tuple[np.ndarray, Grads]:
    grads = {"weight": _rows(g).T @ _rows(x)}
    if a.get("bias") is not None:
        grads["bias"] = _rows(g).sum(axis=0)
    return g @ a["weight"], grads


def _relu_fwd(x: np.ndarray, a: Args) -> tuple[np.ndarray, Any]:
    return np.maximum(x, 0), x


def _relu_bwd(g: np.ndarray, x: np.ndarray, a: Args) -> tuple[np.ndarray, Grads]:
    return g * (x > 0), {}


# GELU in its tanh form (the one most frameworks ship as "gelu_tanh"): no erf needed.
_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_K = 0.044715


def _gelu_fwd(x: np.ndarray, a: Args) -> tuple[np.ndarray, Any]:
    t = np.tanh(_GELU_C * (x + _GELU_K * x**3))
    return 0.5 * x * (1 + t), (x, t)


def _gelu_bwd(g: np.ndarray, cache: Any, a: Args) -> tuple[np.ndarray, Grads]:
    x, t = cache
    dt = (1 - t * t) * _GELU_C * (1 + 3 * _GELU_K * x * x)
    return g * (0.5 * (1 + t) + 0.5 * x * dt), {}


def _scale_fwd(x: np.ndarray, a: Args) -> tuple[np.ndarray, Any]:
    return x * x.dtype.type(a["factor"]), None


def _scale_bwd(g: np.ndarray, cache: Any, a: Args) -> tuple[np.ndarray, Grads]:
    return g * g.dtype.type(a["factor"]), {}


def _add_bias_fwd(x: np.ndarray, a: Args) -> tuple[np.ndarray, Any]:
    b = a["bias"]
    if b.shape != (x.shape[-1],):
        raise UsageError(f"add_bias bias has shape {b.shape}, the input has {x.shape[-1]} features")
    return x + b, None


def _add_bias_bwd(g: np.ndarray, cache: Any, a: Args) -> tuple[np.ndarray, Grads]:
    return g, {"bias": _rows(g).sum(axis=0)}


def _softmax_fwd(x: np.ndarray, a: Args) -> tuple[np.ndarray, Any]:
    e = np.exp(x - x.max(axis=-1, keepdims=True))  # shift: exp never overflows
    y = e / e.sum(axis=-1, keepdims=True)
    return y, y


def _softmax_bwd(g: np.ndarray, y: np.ndarray, a: Args) -> tuple[np.ndarray, Grads]:
    return y * (g - (g * y).sum(axis=-1, keepdims=True)), {}


#: Every op a stage or a train spec may name.
OPS: dict[str, OpDef] = {
    d.name: d
    for d in (
        OpDef("linear", arrays=("weight",), optional=("bias",), forward=_linear_fwd, backward=_linear_bwd),
        OpDef("relu", forward=_relu_fwd, backward=_relu_bwd),
        OpDef("gelu", forward=_gelu_fwd, backward=_gelu_bwd),
        OpDef("scale", scalars=("factor",), forward=_scale_fwd, backward=_scale_bwd),
        OpDef("add_bias", arrays=("bias",), forward=_add_bias_fwd, backward=_add_bias_bwd),
        OpDef("softmax", forward=_softmax_fwd, backward=_softmax_bwd),
    )
}
