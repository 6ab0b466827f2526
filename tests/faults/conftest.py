"""Fault-injection settings: the matrix size and where measurements go.

``GRADCOLL_FAULTS=full`` runs every transport x algorithm x fault x victim
(``make faults``); otherwise a small sample runs in ``make test``.
``GRADCOLL_FAULT_REPEATS`` repeats each scenario; ``GRADCOLL_FAULT_LOG``
names a JSON-lines file that every scenario appends its measurements to
(``benches/faults_report.py`` turns it into the table of docs/reliability.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from tests.faults._harness import log_fault

FULL = os.environ.get("GRADCOLL_FAULTS") == "full"
REPEATS = int(os.environ.get("GRADCOLL_FAULT_REPEATS", "1"))


@pytest.fixture
def fault_log() -> Callable[..., None]:
    """``fault_log(area=..., fault=..., ...)`` appends one record to GRADCOLL_FAULT_LOG (if set)."""
    return log_fault
