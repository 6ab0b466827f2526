"""What the ``gradcoll`` subcommands share: the help formatter and argument types that fail before anything starts.

A bad value is an argparse error (the usage line, the message, exit status
2) raised while the command line is parsed, never a traceback from a rank.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Callable
from typing import Any

__all__ = ["HelpFormatter", "subcommand", "positive_int", "non_negative_int", "positive_float", "port", "existing_file",
           "writable_path", "module_main"]


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions and epilogs kept as written; ``(default: X)`` after every option that has a default.

    An option whose help already says its default, a required one, a flag
    (no value) and one without a default (None: its help says what leaving
    it out does) get nothing appended.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "(default" in text or action.required or action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def subcommand(sub: Any, name: str, summary: str, description: str, epilog: str | None = None) -> argparse.ArgumentParser:
    """The parser of ``gradcoll NAME``: added to ``sub`` (a subparsers object), or standalone when ``sub`` is None.

    ``summary`` is the line ``gradcoll --help`` shows for it; ``description``
    heads ``gradcoll NAME --help`` (wrapped here: the formatter keeps text as
    written, for the epilog's lists).
    """
    description = textwrap.fill(description, 79)
    if sub is None:
        return argparse.ArgumentParser(prog=f"gradcoll {name}", description=description, epilog=epilog,
                                       formatter_class=HelpFormatter)
    p: argparse.ArgumentParser = sub.add_parser(name, help=summary, description=description, epilog=epilog,
                                                formatter_class=HelpFormatter)
    return p


def _number(kind: Callable[[str], Any], ok: Callable[[Any], bool], what: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value

    return parse


#: An int >= 1 (``-n/--nprocs``, ``--iters``).
positive_int: Callable[[str], int] = _number(int, lambda v: v >= 1, "a positive integer")
#: An int >= 0.
non_negative_int: Callable[[str], int] = _number(int, lambda v: v >= 0, "a non-negative integer")
#: A finite float > 0 (seconds).
positive_float: Callable[[str], float] = _number(float, lambda v: 0 < v < float("inf"), "a positive number")
#: A TCP port, 1-65535.
port: Callable[[str], int] = _number(int, lambda v: 1 <= v <= 65535, "a port number from 1 to 65535")


def existing_file(text: str) -> str:
    """A path to a file that exists."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    return text


def writable_path(text: str) -> str:
    """A file path whose directory exists (checked before a run that would write it at the end)."""
    parent = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file")
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"directory {parent!r} does not exist")
    return text


def module_main(worker_main: Callable[[list[str]], int], build_parser: Callable[[], argparse.ArgumentParser],
                check_args: Callable[[argparse.ArgumentParser, argparse.Namespace], None],
                run_from_args: Callable[[argparse.Namespace], int]) -> int:
    """``python -m`` of a command that launches ranks: one rank with ``--worker`` (the driver passes it), else
    the command itself, parsed and checked as ``gradcoll NAME ...`` does."""
    if "--worker" in sys.argv:
        return worker_main([x for x in sys.argv[1:] if x != "--worker"])
    p = build_parser()
    a = p.parse_args()
    check_args(p, a)
    return run_from_args(a)
