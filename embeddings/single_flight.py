"""One lookup at a time per key, shared by every coroutine that asks meanwhile.

The request path caches what a key and the model catalog resolve to for a few seconds. When such
an entry expires under load, every request in flight misses it at once: without this, each ran
the same database query in a thread of its own (a few milliseconds of CPU each, dozens at a time).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class SingleFlight(Generic[T]):
    """`await run(key, lookup)`: the result of `lookup()`, run once for all who ask for `key` while
    it runs (each gets its result, or its exception). A caller that is cancelled leaves the lookup
    running for the others. For one event loop (the caches that use it are per process, and the
    request path has one loop)."""

    def __init__(self) -> None:
        self.running: dict[Hashable, asyncio.Future[T]] = {}

    async def run(self, key: Hashable, lookup: Callable[[], Awaitable[T]]) -> T:
        running = self.running.get(key)
        if running is None or running.get_loop() is not asyncio.get_running_loop():
            running = self.running[key] = asyncio.ensure_future(lookup())
            running.add_done_callback(lambda done: self._forget(key, done))
        return await asyncio.shield(running)

    def _forget(self, key: Hashable, done: asyncio.Future) -> None:
        if self.running.get(key) is done:
            del self.running[key]
        if not done.cancelled():
            done.exception()  # retrieved: the callers who waited have it (none may be left)
