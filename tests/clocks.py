"""A clock a test moves by hand, for code that reads time through a clock it is given (the API key
cache's TTLs): a window is crossed by moving the clock, never by sleeping through it."""

from __future__ import annotations


class ManualClock:
    """Seconds on a monotonic scale that moves only when the test calls `advance`."""

    def __init__(self, start: float = 1_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
