"""Element-type names: the one place the node driver turns a dtype name into its canonical form.

A dtype reaches the node driver from code (``FixedFunction(..., "f32")``,
``StageSpec(dtype=np.float32)``) and from peers (caps, stage specs and
train specs as JSON). Every one of them goes through ``canonical_dtype``,
so a document sent to a peer always carries one spelling: NumPy's name
(``"float32"``), which every gradcoll version reads.

Accepted spellings:

* NumPy's names and objects: ``"float32"``, ``np.float32``, ``np.dtype("<f4")``;
* the short element-type names of the Rust original, in either case:
  ``f16``, ``f32``, ``f64``, ``bf16``, and for a fixed-function datapath also
  ``i8``, ``i16``, ``i32``, ``i64``, ``u8``, ``u32``.

Which types a caller takes depends on what runs on them. Stage ops,
training and activations on the wire are NumPy arithmetic, so they take the
three NumPy float types (``COMPUTE_DTYPES``). A fixed-function board
computes in its own silicon, so its descriptor may also name ``bfloat16``
or an integer datapath (``BOARD_DTYPES``); NumPy cannot hold those types, so
the host hands such a board float32 activations and the board converts
(``exchange_dtype``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import UsageError

__all__ = ["COMPUTE_DTYPES", "BOARD_DTYPES", "SHORT_NAMES", "canonical_dtype", "exchange_dtype"]

#: What stage ops, training and node activations compute in (NumPy float types).
COMPUTE_DTYPES = ("float16", "float32", "float64")
#: What a fixed-function datapath may be synthesized for.
BOARD_DTYPES = COMPUTE_DTYPES + ("bfloat16", "int8", "int16", "int32", "int64", "uint8", "uint32")
#: The Rust original's element-type names and the canonical name of each.
SHORT_NAMES = {"f16": "float16", "f32": "float32", "f64": "float64", "bf16": "bfloat16",
               "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64", "u8": "uint8", "u32": "uint32"}
_SHORT_OF = {v: k for k, v in SHORT_NAMES.items()}


def _name(value: Any) -> str | None:
    """The canonical name of ``value`` if it names any dtype we know of, else None."""
    if isinstance(value, str):
        key = value.strip()
        short = SHORT_NAMES.get(key.lower())
        if short is not None:
            return short
        if key in BOARD_DTYPES:  # "bfloat16" too, which NumPy only knows with ml_dtypes installed
            return key
        value = key
    if value is None or isinstance(value, bool):  # np.dtype(None) would be float64
        return None
    try:
        # Single-letter codes are case-sensitive in NumPy ("f" float32, "F" complex64),
        # so the string goes through unchanged.
        return str(np.dtype(value).name)
    except (TypeError, ValueError):
        return None


def canonical_dtype(value: Any, allowed: tuple[str, ...] = COMPUTE_DTYPES, *, what: str = "dtype") -> str:
    """The canonical (NumPy) name of ``value``, which must be one of ``allowed``; else UsageError.

    ``canonical_dtype("f32") == canonical_dtype(np.float32) == "float32"``.
    """
    name = _name(value)
    if name is not None and name in allowed:
        return name
    choices = ", ".join(f"{a} ({_SHORT_OF[a]})" if a in _SHORT_OF else a for a in allowed)
    hint = ""
    if name in BOARD_DTYPES:
        hint = (f"; {name} is accepted only for a fixed-function board's datapath: stages and training "
                "compute in NumPy's float types")
    raise UsageError(f"{what} must be one of {choices}, got {value!r}{hint}")


def exchange_dtype(name: str) -> str:
    """The dtype the host hands a board whose datapath is ``name``: itself if NumPy computes in it, else float32."""
    return name if name in COMPUTE_DTYPES else "float32"
