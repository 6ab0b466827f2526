"""The ``gradcoll`` command: ``launch``, ``bench``, ``demo`` and ``stragglers``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch ``gradcoll <command>``."""
    from . import launch

    parser = argparse.ArgumentParser(prog="gradcoll", description="gradcoll command-line tools")
    sub = parser.add_subparsers(dest="command", required=True)
    launch.build_parser(sub)
    from . import bench, demo, stragglers

    bench.build_parser(sub)
    demo.build_parser(sub)
    stragglers.build_parser(sub)
    a = parser.parse_args(argv)
    if a.command == "launch":
        return launch.run_from_args(a)
    if a.command == "bench":
        return bench.run_from_args(a)
    if a.command == "stragglers":
        return stragglers.run_from_args(a)
    return demo.run_from_args(a)


if __name__ == "__main__":
    sys.exit(main())
