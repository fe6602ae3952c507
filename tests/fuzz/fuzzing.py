"""Shared settings for the fuzz suite: one hypothesis profile, scaled by an env var, and a
tally of the cases run per input kind (printed at the end of the pytest run).

- Default: each test runs its own small budget, derandomized (the same cases on every run),
  with no example database, so ``tests/fuzz`` stays under a minute on two cores.
- ``KVCR_FUZZ_EXAMPLES=N`` runs N examples per test instead (still derandomized: a long run
  explores more inputs, and the same ones each time).
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from hypothesis import HealthCheck, settings

PROFILE = "kvcr-fuzz"
settings.register_profile(
    PROFILE,
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=False,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)

CASES: Counter[str] = Counter()  # input kind -> cases run in this process


def examples(default: int) -> int:
    """The number of examples a test runs: its own default, or ``KVCR_FUZZ_EXAMPLES``."""
    raw = os.environ.get("KVCR_FUZZ_EXAMPLES")
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"KVCR_FUZZ_EXAMPLES must be a positive int, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"KVCR_FUZZ_EXAMPLES must be a positive int, got {raw!r}")
    return value


def fuzz(default: int, **overrides: Any) -> settings:
    """The suite's hypothesis settings for one test (not loaded globally, so the rest of the
    test suite keeps its own settings)."""
    return settings(settings.get_profile(PROFILE), max_examples=examples(default), **overrides)


def case(kind: str) -> None:
    """Count one case of ``kind`` (call it once per example, in the test body)."""
    CASES[kind] += 1


def open_fds() -> int:
    """Descriptors open in this process (an example must give back what it opened)."""
    return len(os.listdir("/proc/self/fd"))
