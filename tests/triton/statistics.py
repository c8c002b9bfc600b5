"""Reading Triton's statistics in tests: they lag the responses they count."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# Triton counts a request in its statistics as it releases it, which can be just after the
# response reached the client: a read at once may miss the last calls. Tests read until the
# count they expect is reached (or this long passed), then assert it exactly.
STATISTICS_SETTLE_S = 10.0


def settled(read: Callable[[], T], reached: Callable[[T], bool]) -> T:
    """`read()` again until `reached` says its value has counted everything (or the time is up)."""
    deadline = time.monotonic() + STATISTICS_SETTLE_S
    while True:
        value = read()
        if reached(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.05)
