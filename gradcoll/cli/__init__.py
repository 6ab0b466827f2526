"""The ``gradcoll`` command: ``launch``, ``bench``, ``demo`` and ``stragglers``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from types import ModuleType


def _commands() -> dict[str, ModuleType]:
    from . import bench, demo, launch, stragglers

    return {"launch": launch, "bench": bench, "demo": demo, "stragglers": stragglers}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``gradcoll`` parser and the parser of each command, by name."""
    from ._args import HelpFormatter

    parser = argparse.ArgumentParser(prog="gradcoll", formatter_class=HelpFormatter,
                                     description="gradcoll command-line tools. "
                                                 "'gradcoll COMMAND --help' describes each command and its options.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    return parser, {name: mod.build_parser(sub) for name, mod in _commands().items()}


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch ``gradcoll <command>``; a bad argument exits with status 2 before anything starts."""
    parser, parsers = build_parser()
    a = parser.parse_args(argv)
    mod = _commands()[a.command]
    check = getattr(mod, "check_args", None)  # what one argument cannot check alone (bench, demo)
    if check is not None:
        check(parsers[a.command], a)
    code: int = mod.run_from_args(a)
    return code


if __name__ == "__main__":
    sys.exit(main())
