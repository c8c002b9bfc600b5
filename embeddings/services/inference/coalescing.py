"""Merging concurrent requests' token sub-batches into one Triton call per model (COALESCE_REQUESTS).

Query traffic is mostly one short text per request from many clients: sent alone, each request
is one ModelInfer call and pays gRPC's and the Python backend's per-request cost. A `Coalescer`
keeps at most `max_calls` calls per model at Triton; sub-batches that arrive meanwhile wait and
leave together in the next call as soon as one returns ("next call when the previous returns":
no timer, so a lone request is sent at once), bounded by the model's max batch size and
MAX_BATCH_TOKENS padded tokens. Per-request semantics stay exact:

- a waiter whose deadline passed or whose client went away (its task cancelled) is dropped
  before the call is formed: its rows are never computed;
- a merged call Triton refuses as a model or input error is retried one request at a time, so a
  row-level bad input fails only its own request; other errors (unavailable, timeout, model not
  loaded) concern every request in the call and are given to each;
- quotas and metrics are settled around each request by the caller, never per merged call.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from embeddings.observability import tracing
from embeddings.triton import TritonInvalidInput, TritonModelError, TritonModelNotLoaded

# (input_ids, attention_mask, token_type_ids or None, deadline) -> FP32 [rows, dimensions]; the
# deadline is monotonic.
MergedCall = Callable[[np.ndarray, np.ndarray, np.ndarray | None, float], Awaitable[np.ndarray]]


@dataclass(eq=False)
class Waiter:
    """One request's sub-batch waiting for a merged call, and the future its request awaits."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    deadline: float
    result: asyncio.Future
    # When its request asked for room (perf_counter), for the queue time; its trace context.
    queued: float = 0.0
    trace_context: object = None
    # A cross-encoder's pair segments; None: all 0 (single texts).
    token_type_ids: np.ndarray | None = None

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]


def merged_inputs(waiters: list[Waiter]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The waiters' rows stacked, right-padded with zeros (masked out) to the widest one; token
    types only when some waiter has them (the others' are 0)."""
    if len(waiters) == 1:
        return waiters[0].input_ids, waiters[0].attention_mask, waiters[0].token_type_ids
    width = max(waiter.width for waiter in waiters)
    rows = sum(waiter.rows for waiter in waiters)
    input_ids = np.zeros((rows, width), dtype=waiters[0].input_ids.dtype)
    attention_mask = np.zeros((rows, width), dtype=waiters[0].attention_mask.dtype)
    typed = any(waiter.token_type_ids is not None for waiter in waiters)
    token_type_ids = np.zeros((rows, width), dtype=np.int64) if typed else None
    start = 0
    for waiter in waiters:
        input_ids[start : start + waiter.rows, : waiter.width] = waiter.input_ids
        attention_mask[start : start + waiter.rows, : waiter.width] = waiter.attention_mask
        if token_type_ids is not None and waiter.token_type_ids is not None:
            token_type_ids[start : start + waiter.rows, : waiter.width] = waiter.token_type_ids
        start += waiter.rows
    return input_ids, attention_mask, token_type_ids


class Coalescer:
    """Merges the sub-batches of one event loop's requests to one (model, version).

    The event loop runs one coroutine at a time, so no lock is needed; one coalescer per loop.
    """

    def __init__(
        self,
        call: MergedCall,
        *,
        max_rows: int,
        max_tokens: int,
        max_calls: int,
        observe: Callable[[int, int], None] = lambda rows, tokens: None,
        observe_queued: Callable[[float], None] = lambda seconds: None,
    ) -> None:
        if max_rows < 1 or max_tokens < 1 or max_calls < 1:
            raise ValueError("max_rows, max_tokens and max_calls must be at least 1")
        self.max_rows = max_rows
        self.max_tokens = max_tokens
        self.max_calls = max_calls
        self.calls_in_flight = 0
        self._call = call
        self._observe = observe
        self._observe_queued = observe_queued
        self._pending: deque[Waiter] = deque()
        self._pump_scheduled = False
        # Strong references to the running calls (the loop keeps only weak ones).
        self._tasks: set[asyncio.Task] = set()

    @property
    def waiting(self) -> int:
        return sum(1 for waiter in self._pending if not waiter.result.done())

    async def embed(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        *,
        deadline: float,
        queued: float | None = None,
        token_type_ids: np.ndarray | None = None,
    ) -> np.ndarray:
        """These rows' vectors (a cross-encoder's: scores), computed in a call shared with other
        requests' rows. `queued`: when the rows started waiting (perf_counter; default now), for the
        queue time."""
        loop = asyncio.get_running_loop()
        waiter = Waiter(
            input_ids,
            attention_mask,
            deadline,
            loop.create_future(),
            queued=time.perf_counter() if queued is None else queued,
            trace_context=tracing.captured(),
            token_type_ids=token_type_ids,
        )
        self._pending.append(waiter)
        self._schedule_pump(loop)
        # Cancelling this (deadline, client gone) cancels the future: the waiter is then skipped.
        return await waiter.result

    def _schedule_pump(self, loop: asyncio.AbstractEventLoop) -> None:
        # On the next turn of the loop, so requests arriving in the same turn leave together; in a
        # context of its own, as the calls it starts serve many requests and may outlive this one.
        if not self._pump_scheduled:
            self._pump_scheduled = True
            loop.call_soon(self._pump, context=contextvars.Context())

    def _pump(self) -> None:
        self._pump_scheduled = False
        loop = asyncio.get_running_loop()
        while self.calls_in_flight < self.max_calls:
            batch = self._take()
            if not batch:
                return
            self.calls_in_flight += 1
            task = loop.create_task(self._run(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _take(self) -> list[Waiter]:
        """The oldest live waiters that fit one call; one waiter always fits alone."""
        batch: list[Waiter] = []
        rows = width = 0
        while self._pending:
            waiter = self._pending[0]
            if waiter.result.done():
                self._pending.popleft()
                continue
            new_rows, new_width = rows + waiter.rows, max(width, waiter.width)
            if batch and (new_rows > self.max_rows or new_rows * new_width > self.max_tokens):
                break
            self._pending.popleft()
            batch.append(waiter)
            rows, width = new_rows, new_width
        return batch

    async def _run(self, batch: list[Waiter]) -> None:
        try:
            await self._send(batch)
        finally:
            for waiter in batch:
                if not waiter.result.done():
                    # Only when this task itself was cancelled (the loop is closing).
                    waiter.result.cancel()
            self.calls_in_flight -= 1
            self._schedule_pump(asyncio.get_running_loop())

    async def _send(self, batch: list[Waiter], *, asked_again: bool = False) -> None:
        # Waiters dropped between forming the call and sending it are left out.
        batch = [waiter for waiter in batch if not waiter.result.done()]
        if not batch:
            return
        input_ids, attention_mask, token_type_ids = merged_inputs(batch)
        self._observe(input_ids.shape[0], input_ids.size)
        if not asked_again:  # a row's queue time is its wait for its first call
            sent = time.perf_counter()
            for waiter in batch:
                self._observe_queued(sent - waiter.queued)
        try:
            # The call may run until the latest deadline; earlier ones end their own wait.
            with tracing.batch_span(
                "triton.batch",
                [waiter.trace_context for waiter in batch],
                requests=len(batch),
                rows=int(input_ids.shape[0]),
                tokens=int(input_ids.size),
            ):
                vectors = await self._call(
                    input_ids, attention_mask, token_type_ids, max(waiter.deadline for waiter in batch)
                )
        except (TritonInvalidInput, TritonModelError) as error:
            if len(batch) > 1 and not isinstance(error, TritonModelNotLoaded):
                # Possibly one request's rows: ask again for each alone, so only that one fails.
                await asyncio.gather(*(self._send([waiter], asked_again=True) for waiter in batch))
                return
            self._fail(batch, error)
            return
        except Exception as error:  # unavailable, timeout: every request in the call is concerned
            self._fail(batch, error)
            return
        if vectors.shape[0] != input_ids.shape[0]:
            self._fail(batch, TritonModelError(f"{vectors.shape[0]} vectors for {input_ids.shape[0]} rows"))
            return
        start = 0
        for waiter in batch:
            if not waiter.result.done():
                waiter.result.set_result(vectors[start : start + waiter.rows])
            start += waiter.rows

    @staticmethod
    def _fail(batch: list[Waiter], error: BaseException) -> None:
        for waiter in batch:
            if not waiter.result.done():
                waiter.result.set_exception(error)


def remaining_s(deadline: float, cap_s: float) -> float:
    """Seconds left before `deadline` (monotonic), at most `cap_s`, at least a millisecond."""
    return max(0.001, min(cap_s, deadline - time.monotonic()))
