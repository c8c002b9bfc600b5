"""SingleFlight: one lookup per key at a time, whatever its callers do."""

from __future__ import annotations

import asyncio

import pytest

from embeddings.single_flight import SingleFlight

pytestmark = pytest.mark.unit


class Lookup:
    def __init__(self, result=None, error: Exception | None = None) -> None:
        self.result, self.error = result, error
        self.calls = 0
        self.release = asyncio.Event()

    async def __call__(self):
        self.calls += 1
        await self.release.wait()
        if self.error is not None:
            raise self.error
        return self.result


async def test_concurrent_callers_share_one_lookup_and_a_later_one_runs_again():
    flights, lookup = SingleFlight(), Lookup(result="caller")
    waiting = [asyncio.ensure_future(flights.run("key", lookup)) for _ in range(20)]
    other_key = asyncio.ensure_future(flights.run("other", Lookup(result="other").__call__))
    await asyncio.sleep(0)
    lookup.release.set()
    assert await asyncio.gather(*waiting) == ["caller"] * 20
    assert lookup.calls == 1
    other_key.cancel()
    lookup.release.clear()
    later = asyncio.ensure_future(flights.run("key", lookup))
    await asyncio.sleep(0)
    lookup.release.set()
    assert await later == "caller" and lookup.calls == 2


async def test_every_caller_gets_the_lookups_exception():
    flights, lookup = SingleFlight(), Lookup(error=LookupError("no"))
    waiting = [asyncio.ensure_future(flights.run("key", lookup)) for _ in range(3)]
    await asyncio.sleep(0)
    lookup.release.set()
    outcomes = await asyncio.gather(*waiting, return_exceptions=True)
    assert [type(outcome) for outcome in outcomes] == [LookupError] * 3 and lookup.calls == 1


async def test_a_caller_that_leaves_leaves_the_lookup_to_the_others():
    flights, lookup = SingleFlight(), Lookup(result=7)
    first = asyncio.ensure_future(flights.run("key", lookup))
    second = asyncio.ensure_future(flights.run("key", lookup))
    await asyncio.sleep(0)
    first.cancel()
    await asyncio.sleep(0)
    lookup.release.set()
    assert await second == 7 and first.cancelled() and lookup.calls == 1
