"""Token-bounded sub-batches and the fair scheduler, without Triton (fake calls on the event loop)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embeddings.services.inference.scheduling import FairScheduler, SubBatch, reassembled, sub_batches

pytestmark = pytest.mark.unit


@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=300),
    budget=st.integers(1, 5000),
    max_rows=st.integers(0, 70),
    buckets=st.sampled_from([(), (16, 32, 64, 128, 256)]),
)
@settings(max_examples=300, deadline=None)
def test_sub_batches_cover_every_row_once_within_the_budget(lengths, budget, max_rows, buckets):
    groups = sub_batches(np.array(lengths), max_batch_tokens=budget, max_rows=max_rows, buckets=buckets)
    rows = np.concatenate([group.rows for group in groups])
    assert sorted(rows.tolist()) == list(range(len(lengths)))
    for group in groups:
        longest = max(lengths[row] for row in group.rows)
        assert group.width >= longest
        if buckets and longest <= buckets[-1]:
            assert group.width in buckets
        # Over the budget (or the row limit) only as a row of its own.
        if group.cost > budget or (max_rows and len(group.rows) > max_rows):
            assert len(group.rows) == 1


def test_a_request_that_fits_stays_whole_and_in_order():
    (group,) = sub_batches(np.array([5, 3, 9]), max_batch_tokens=27, max_rows=64)
    assert group.rows.tolist() == [0, 1, 2] and group.width == 9 and group.cost == 27


def test_long_and_short_rows_are_not_padded_together():
    lengths = np.array([256, 8, 256, 8, 8, 256])
    groups = sub_batches(lengths, max_batch_tokens=512, max_rows=64)
    # The three short rows share one sub-batch of width 8; the long ones go two by two.
    assert [(sorted(g.rows.tolist()), g.width) for g in groups] == [([1, 3, 4], 8), ([0, 2], 256), ([5], 256)]


def test_reassembled_puts_rows_back_in_input_order():
    groups = [SubBatch(np.array([2, 0]), 4), SubBatch(np.array([1]), 4)]
    parts = [(groups[0], np.array([[2.0], [0.0]], np.float32)), (groups[1], np.array([[1.0]], np.float32))]
    assert reassembled(parts, 3).ravel().tolist() == [0.0, 1.0, 2.0]


class FakeTriton:
    """Runs granted sub-batches until the test finishes them; records the tokens in flight."""

    def __init__(self, scheduler: FairScheduler) -> None:
        self.scheduler = scheduler
        self.running: list[tuple[str, asyncio.Event]] = []
        self.started: list[str] = []
        self.peak = 0

    async def call(self, name: str, share, cost: int) -> str:
        async with self.scheduler.slot(share, cost):
            self.peak = max(self.peak, self.scheduler.in_flight)
            done = asyncio.Event()
            self.running.append((name, done))
            self.started.append(name)
            await done.wait()
            return name

    async def finish_oldest(self) -> str:
        name, done = self.running.pop(0)
        done.set()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return name


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_small_request_waits_for_one_sub_batch_not_the_backlog():
    scheduler = FairScheduler(capacity=4096)
    triton = FakeTriton(scheduler)
    large = scheduler.share()
    backlog = [asyncio.ensure_future(triton.call(f"large-{i}", large, 2048)) for i in range(20)]
    await settle()
    assert triton.started == ["large-0", "large-1"] and scheduler.waiting_sub_batches == 18
    small = asyncio.ensure_future(triton.call("small", scheduler.share(), 10))
    await settle()
    assert "small" not in triton.started  # the capacity is full
    await triton.finish_oldest()
    await settle()
    # The first freed room goes to the request with nothing in flight, ahead of large's backlog.
    assert triton.started[-1] == "small"
    assert triton.peak <= 4096
    for task in [*backlog, small]:
        task.cancel()
    await asyncio.gather(*backlog, small, return_exceptions=True)
    assert scheduler.in_flight == 0 and scheduler.waiting_sub_batches == 0


async def test_requests_take_turns():
    scheduler = FairScheduler(capacity=100)
    triton = FakeTriton(scheduler)
    first, second = scheduler.share(), scheduler.share()
    tasks = [asyncio.ensure_future(triton.call(f"a{i}", first, 100)) for i in range(3)]
    await settle()
    tasks += [asyncio.ensure_future(triton.call(f"b{i}", second, 100)) for i in range(3)]
    await settle()
    for _ in range(5):
        await triton.finish_oldest()
        await settle()
    assert triton.started == ["a0", "b0", "a1", "b1", "a2", "b2"]
    await triton.finish_oldest()
    assert await asyncio.gather(*tasks) == ["a0", "a1", "a2", "b0", "b1", "b2"]


async def test_cancelled_waiters_are_dropped_and_granted_tokens_come_back():
    scheduler = FairScheduler(capacity=100)
    triton = FakeTriton(scheduler)
    share = scheduler.share()
    running = asyncio.ensure_future(triton.call("running", share, 100))
    waiting = [asyncio.ensure_future(triton.call(f"w{i}", share, 100)) for i in range(5)]
    await settle()
    assert scheduler.waiting_sub_batches == 5
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert scheduler.waiting_sub_batches == 0
    await triton.finish_oldest()
    assert await running == "running"
    assert scheduler.in_flight == 0 and triton.started == ["running"]


async def test_a_sub_batch_over_the_capacity_runs_alone():
    scheduler = FairScheduler(capacity=100)
    triton = FakeTriton(scheduler)
    big = asyncio.ensure_future(triton.call("big", scheduler.share(), 500))
    await settle()
    small = asyncio.ensure_future(triton.call("small", scheduler.share(), 1))
    await settle()
    assert triton.started == ["big"]
    await triton.finish_oldest()
    await settle()
    assert triton.started == ["big", "small"]
    await triton.finish_oldest()
    await asyncio.gather(big, small)
    assert scheduler.in_flight == 0
