"""Module paths from before the layered layout, still importable.

``import gradcoll.rendezvous`` gives the module object of
``gradcoll.group.rendezvous`` itself (not a copy), so names, classes and
monkeypatching behave as they always did. The new paths are the documented
ones; these stay so that no user's import breaks.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence

#: Old module path -> where the module lives now.
MOVED = {
    "gradcoll.rendezvous": "gradcoll.group.rendezvous",
    "gradcoll.shrink": "gradcoll.group.shrink",
    "gradcoll.buffers": "gradcoll.group.buffers",
    "gradcoll.diagnosis": "gradcoll.observe.diagnosis",
    "gradcoll.trace": "gradcoll.observe.trace",
    "gradcoll.stragglers": "gradcoll.observe.stragglers",
    "gradcoll.costmodel": "gradcoll.model.costmodel",
    "gradcoll.launch": "gradcoll.cli.launch",
    "gradcoll.bench": "gradcoll.cli.bench",
    "gradcoll.demo": "gradcoll.cli.demo",
    "gradcoll.transport.sim": "gradcoll.algorithms.simulate",
    "gradcoll.algorithms.wire": "gradcoll.algorithms.low_precision",
}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the module at its new path."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(fullname, self) if fullname in MOVED else None

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(MOVED[spec.name])
        self._specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The import machinery stamped the old path's spec on the module: give it back its own.
        module.__spec__ = self._specs.pop(module.__name__, module.__spec__)

    def get_code(self, fullname: str) -> types.CodeType:
        """For ``python -m gradcoll.launch`` and the like: run the new module as ``__main__``."""
        return compile(f"import runpy\nrunpy.run_module({MOVED[fullname]!r}, run_name='__main__', alter_sys=True)\n",
                       f"<moved to {MOVED[fullname]}>", "exec")


def install() -> None:
    """Put the finder on ``sys.meta_path`` once."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
