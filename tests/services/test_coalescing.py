"""The request coalescer without Triton: a fake merged call on the event loop records what it got."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from embeddings.services.inference.coalescing import Coalescer, merged_inputs
from embeddings.triton import TritonInvalidInput, TritonUnavailable

pytestmark = pytest.mark.unit

BAD_TOKEN = 999


class FakeModel:
    """Embeds each row as [first token id, real tokens]; refuses a call holding BAD_TOKEN, as Triton
    refuses a whole call for one bad row. Calls wait on `release` when given."""

    def __init__(self, *, fail_with: Exception | None = None) -> None:
        self.calls: list[np.ndarray] = []
        self.release: asyncio.Event | None = None
        self.fail_with = fail_with

    async def __call__(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        token_type_ids: np.ndarray | None,
        deadline: float,
    ) -> np.ndarray:
        self.calls.append(input_ids.copy())
        if self.release is not None:
            await self.release.wait()
        if self.fail_with is not None:
            raise self.fail_with
        if (input_ids == BAD_TOKEN).any():
            raise TritonInvalidInput("a token id out of the vocabulary")
        return np.stack([input_ids[:, 0], attention_mask.sum(axis=1)], axis=1).astype(np.float32)


def rows(*first_tokens: int, width: int = 4) -> tuple[np.ndarray, np.ndarray]:
    ids = np.array([[token] + [7] * (width - 1) for token in first_tokens], dtype=np.int64)
    return ids, np.ones_like(ids)


def far() -> float:
    return time.monotonic() + 60


async def test_concurrent_requests_share_a_call_and_get_their_own_rows():
    model = FakeModel()
    coalescer = Coalescer(model, max_rows=64, max_tokens=2048, max_calls=1)
    results = await asyncio.gather(
        *(
            coalescer.embed(*rows(request, request + 100, width=2 + request), deadline=far())
            for request in range(5)
        )
    )
    assert len(model.calls) == 1 and model.calls[0].shape == (10, 6)
    for request, vectors in enumerate(results):
        assert vectors.tolist() == [[request, 2 + request], [request + 100, 2 + request]]


async def test_the_next_call_takes_what_arrived_while_the_previous_ran():
    model = FakeModel()
    model.release = asyncio.Event()
    coalescer = Coalescer(model, max_rows=64, max_tokens=2048, max_calls=1)
    first = asyncio.ensure_future(coalescer.embed(*rows(1), deadline=far()))
    await asyncio.sleep(0.01)
    later = [asyncio.ensure_future(coalescer.embed(*rows(token), deadline=far())) for token in (2, 3, 4)]
    await asyncio.sleep(0.01)
    assert len(model.calls) == 1
    model.release.set()
    await asyncio.gather(first, *later)
    assert [call[:, 0].tolist() for call in model.calls] == [[1], [2, 3, 4]]


async def test_calls_stay_within_the_row_and_token_bounds():
    model = FakeModel()
    coalescer = Coalescer(model, max_rows=3, max_tokens=8, max_calls=1)
    await asyncio.gather(*(coalescer.embed(*rows(token, width=2), deadline=far()) for token in range(7)))
    assert [len(call) for call in model.calls] == [3, 3, 1]
    # One request over the token bound still goes, alone.
    await coalescer.embed(*rows(1, 2, 3, width=16), deadline=far())
    assert model.calls[-1].shape == (3, 16)


async def test_a_bad_request_merged_with_good_ones_fails_alone():
    model = FakeModel()
    coalescer = Coalescer(model, max_rows=64, max_tokens=2048, max_calls=1)
    outcomes = await asyncio.gather(
        *(coalescer.embed(*rows(token), deadline=far()) for token in (1, BAD_TOKEN, 3)),
        return_exceptions=True,
    )
    assert outcomes[0].tolist() == [[1, 4]] and outcomes[2].tolist() == [[3, 4]]
    assert isinstance(outcomes[1], TritonInvalidInput)


async def test_an_unavailable_triton_fails_every_request_in_the_call_without_retries():
    model = FakeModel(fail_with=TritonUnavailable("down"))
    coalescer = Coalescer(model, max_rows=64, max_tokens=2048, max_calls=1)
    outcomes = await asyncio.gather(
        *(coalescer.embed(*rows(token), deadline=far()) for token in (1, 2)), return_exceptions=True
    )
    assert all(isinstance(outcome, TritonUnavailable) for outcome in outcomes)
    assert len(model.calls) == 1


async def test_a_request_that_gives_up_while_waiting_is_never_computed():
    model = FakeModel()
    model.release = asyncio.Event()
    coalescer = Coalescer(model, max_rows=64, max_tokens=2048, max_calls=1)
    busy = asyncio.ensure_future(coalescer.embed(*rows(1), deadline=far()))
    await asyncio.sleep(0.01)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):
            await coalescer.embed(*rows(2), deadline=far())
    cancelled = asyncio.ensure_future(coalescer.embed(*rows(3), deadline=far()))
    kept = asyncio.ensure_future(coalescer.embed(*rows(4), deadline=far()))
    await asyncio.sleep(0.01)
    cancelled.cancel()
    model.release.set()
    assert (await kept).tolist() == [[4, 4]]
    await busy
    assert [call[:, 0].tolist() for call in model.calls] == [[1], [4]]
    assert coalescer.waiting == 0 and coalescer.calls_in_flight == 0


async def test_a_request_that_gives_up_during_the_call_leaves_its_neighbours_their_answer():
    model = FakeModel()
    model.release = asyncio.Event()
    coalescer = Coalescer(model, max_rows=64, max_tokens=2048, max_calls=1)
    leaving = asyncio.ensure_future(coalescer.embed(*rows(1), deadline=far()))
    staying = asyncio.ensure_future(coalescer.embed(*rows(2), deadline=far()))
    await asyncio.sleep(0.01)
    leaving.cancel()
    model.release.set()
    assert (await staying).tolist() == [[2, 4]]


def test_merged_inputs_pad_shorter_rows_with_masked_zeros():
    ids, mask, types = merged_inputs_of(
        (np.array([[5, 6]]), np.array([[1, 1]])), (np.array([[8, 9, 10]]), np.array([[1, 1, 1]]))
    )
    assert ids.tolist() == [[5, 6, 0], [8, 9, 10]]
    assert mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert types is None


def test_merged_pairs_keep_each_rows_token_types():
    ids, mask, types = merged_inputs_of(
        (np.array([[5, 6, 7]]), np.array([[1, 1, 1]]), np.array([[0, 1, 1]])),
        (np.array([[8, 9]]), np.array([[1, 1]]), np.array([[0, 1]])),
    )
    assert ids.tolist() == [[5, 6, 7], [8, 9, 0]]
    assert mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert types.tolist() == [[0, 1, 1], [0, 1, 0]]


async def test_a_call_of_pairs_is_sent_their_token_types():
    seen = []

    async def model(input_ids, attention_mask, token_type_ids, deadline):
        seen.append(token_type_ids.copy())
        return np.zeros((len(input_ids), 1), dtype=np.float32)

    coalescer = Coalescer(model, max_rows=64, max_tokens=2048, max_calls=1)
    ids, mask = rows(1, 2, width=3)
    await asyncio.gather(
        coalescer.embed(ids[:1], mask[:1], token_type_ids=np.array([[0, 1, 1]]), deadline=far()),
        coalescer.embed(ids[1:], mask[1:], token_type_ids=np.array([[0, 0, 1]]), deadline=far()),
    )
    assert [call.tolist() for call in seen] == [[[0, 1, 1], [0, 0, 1]]]


def merged_inputs_of(*parts: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    from embeddings.services.inference.coalescing import Waiter

    return merged_inputs(
        [
            Waiter(part[0], part[1], 0.0, None, token_type_ids=part[2] if len(part) > 2 else None)
            for part in parts
        ]  # type: ignore[arg-type]
    )


async def test_each_rows_queue_time_is_its_wait_for_its_first_call():
    model = FakeModel()
    model.release = asyncio.Event()
    waits: list[float] = []
    coalescer = Coalescer(model, max_rows=64, max_tokens=2048, max_calls=1, observe_queued=waits.append)
    first = asyncio.ensure_future(coalescer.embed(*rows(1), deadline=far()))
    await asyncio.sleep(0.01)
    # Two more wait behind the first call; one holds a bad row, so their merged call is split.
    queued = time.perf_counter()
    later = [
        asyncio.ensure_future(coalescer.embed(*rows(token), deadline=far(), queued=queued))
        for token in (2, BAD_TOKEN)
    ]
    await asyncio.sleep(0.05)
    released = time.perf_counter()
    model.release.set()
    outcomes = await asyncio.gather(first, *later, return_exceptions=True)
    assert isinstance(outcomes[2], TritonInvalidInput)
    # Once per request's rows (the split's second calls count no second wait); the later two waited
    # for the first call to return.
    assert len(waits) == 3
    assert all(wait >= released - queued for wait in waits[1:])
