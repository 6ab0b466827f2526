"""Fuzz budget: GRADCOLL_FUZZ_EXAMPLES inputs per decoder (``make fuzz`` sets 20,000; the default keeps ``make test`` fast)."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

EXAMPLES = int(os.environ.get("GRADCOLL_FUZZ_EXAMPLES", "300"))

settings.register_profile(
    "gradcoll-fuzz",
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    derandomize=False,
)
