"""Fair, bounded inference: requests cut into token-bounded sub-batches, interleaved per process.

Triton runs what it is sent in arrival order. Sent whole, one request of a thousand long texts
would keep every model instance busy for a minute and every other request would queue behind it.
So a request's rows are sorted by length and cut into sub-batches of at most MAX_BATCH_TOKENS
padded tokens (as TEI's max_batch_tokens), and `FairScheduler` lets each process keep at most
MAX_TOKENS_IN_FLIGHT of them at Triton. When room frees, the waiting request with the fewest
tokens in flight goes next, so a small request waits for at most about one sub-batch of a large
one, never for its backlog. Sub-batches not yet granted belong to a request that can still give
them up: when its deadline passes or its client goes away (the view task is cancelled), they are
dropped and nothing computes for nobody.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import numpy as np

from embeddings.tokenization import padded_length


@dataclass(frozen=True)
class SubBatch:
    """Rows of one request sent to Triton together, padded to `width` tokens."""

    # Indices into the request's inputs.
    rows: np.ndarray
    width: int

    @property
    def cost(self) -> int:
        """Padded tokens: what the model computes, padding included."""
        return len(self.rows) * self.width


def sub_batches(
    lengths: np.ndarray, *, max_batch_tokens: int, max_rows: int, buckets: Sequence[int] = ()
) -> list[SubBatch]:
    """Cut rows of these token lengths into sub-batches of at most `max_batch_tokens` padded
    tokens and `max_rows` rows (0: no row limit). Rows are taken shortest first, so each
    sub-batch pads to little more than its own longest row; one row longer than the budget forms
    a sub-batch of its own. A request that fits whole stays one sub-batch in its own order."""
    lengths = np.asarray(lengths, dtype=np.int64)
    count = len(lengths)
    if count == 0:
        return []
    max_rows = max_rows if max_rows > 0 else count
    width = padded_length(int(lengths.max()), tuple(buckets))
    if count <= max_rows and count * width <= max_batch_tokens:
        return [SubBatch(np.arange(count), width)]
    order = np.argsort(lengths, kind="stable")
    groups: list[SubBatch] = []
    start = 0
    for position in range(1, count + 1):
        if position < count:
            next_width = padded_length(int(lengths[order[position]]), tuple(buckets))
            rows = position - start + 1
            if rows <= max_rows and rows * next_width <= max_batch_tokens:
                continue
        last_width = padded_length(int(lengths[order[position - 1]]), tuple(buckets))
        groups.append(SubBatch(order[start:position], last_width))
        start = position
    return groups


@dataclass(eq=False)
class RequestShare:
    """One request's place in the scheduler: its tokens in flight and its waiting sub-batches."""

    in_flight: int = 0
    # When it was last granted room (the scheduler's count), -1 before its first grant.
    last_granted: int = -1
    waiting: deque[tuple[asyncio.Future, int]] = field(default_factory=deque)


class FairScheduler:
    """Admits sub-batches to Triton while the process's padded tokens in flight stay within
    `capacity` (one sub-batch may always run when nothing else does).

    Waiting sub-batches are granted one at a time to the waiting request with the fewest tokens
    in flight; among equals, the one served least recently (so requests take turns). The event
    loop runs one coroutine at a time, so no lock is needed; one scheduler per event loop.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1 token, got {capacity}")
        self.capacity = capacity
        self.in_flight = 0
        self._grants = 0
        # Requests with sub-batches waiting (an ordered set, in order of arrival).
        self._waiting: OrderedDict[RequestShare, None] = OrderedDict()

    @property
    def waiting_sub_batches(self) -> int:
        return sum(len(share.waiting) for share in self._waiting)

    def share(self) -> RequestShare:
        return RequestShare()

    @asynccontextmanager
    async def slot(self, share: RequestShare, cost: int) -> AsyncIterator[None]:
        """Hold `cost` tokens of the capacity for `share` while the body runs."""
        await self._acquire(share, cost)
        try:
            yield
        finally:
            self._release(share, cost)

    def _fits(self, cost: int) -> bool:
        return self.in_flight == 0 or self.in_flight + cost <= self.capacity

    def _take(self, share: RequestShare, cost: int) -> None:
        self.in_flight += cost
        share.in_flight += cost
        share.last_granted = self._grants
        self._grants += 1

    async def _acquire(self, share: RequestShare, cost: int) -> None:
        if not self._waiting and self._fits(cost):
            self._take(share, cost)
            return
        granted = asyncio.get_running_loop().create_future()
        entry = (granted, cost)
        share.waiting.append(entry)
        self._waiting[share] = None
        self._grant()
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                # Granted, then cancelled before it could run: give the tokens back.
                self._release(share, cost)
            else:
                self._forget(share, entry)
                self._grant()
            raise

    def _release(self, share: RequestShare, cost: int) -> None:
        self.in_flight -= cost
        share.in_flight -= cost
        self._grant()

    def _forget(self, share: RequestShare, entry: tuple[asyncio.Future, int]) -> None:
        if entry in share.waiting:
            share.waiting.remove(entry)
        if not share.waiting:
            self._waiting.pop(share, None)

    def _grant(self) -> None:
        while self._waiting:
            share = min(self._waiting, key=lambda candidate: (candidate.in_flight, candidate.last_granted))
            granted, cost = entry = share.waiting[0]
            if granted.done():
                # Cancelled while waiting; its task has not run its cleanup yet.
                self._forget(share, entry)
                continue
            if not self._fits(cost):
                return
            self._forget(share, entry)
            self._take(share, cost)
            granted.set_result(None)


def reassembled(parts: Sequence[tuple[SubBatch, np.ndarray]], count: int) -> np.ndarray:
    """The rows of every sub-batch's output put back in input order."""
    if len(parts) == 1 and len(parts[0][0].rows) == count:
        group, vectors = parts[0]
        if np.array_equal(group.rows, np.arange(count)):
            return vectors
    dims = parts[0][1].shape[1]
    out = np.empty((count, dims), dtype=np.float32)
    for group, vectors in parts:
        out[group.rows] = vectors
    return out
