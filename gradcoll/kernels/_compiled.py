"""The compiled extension built from ``_cython_kernels.pyx``, for the modules that use it.

It is imported by its dotted name, not with ``from . import _cython_kernels``:
an import checker cannot look inside a compiled module, so that statement reads
as an import of the package ``gradcoll.kernels`` itself, and every backend
module using the extension would sit in an import cycle with the facade.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

NAME = "gradcoll.kernels._cython_kernels"


def load() -> ModuleType:
    """The extension module; raises ImportError when it was not built (no compiler at install time)."""
    return importlib.import_module(NAME)


@functools.cache
def extension() -> ModuleType | None:
    """The extension module, or None when it was not built."""
    try:
        return load()
    except ImportError:
        return None
