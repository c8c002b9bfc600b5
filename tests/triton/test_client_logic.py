"""Client logic without a server: gRPC error mapping, retries, deadlines, model adaptation."""

import asyncio
import time
from dataclasses import replace

import grpc
import numpy as np
import pytest

from embeddings.triton import (
    AsyncTritonClient,
    ModelSpec,
    TensorSpec,
    TritonClient,
    TritonError,
    TritonInvalidInput,
    TritonModelError,
    TritonTimeout,
    TritonUnavailable,
)
from embeddings.triton.client import channel_options, error_from_rpc, text_inputs, token_inputs
from embeddings.triton.protocol import grpc_service_pb2 as pb

pytestmark = pytest.mark.unit


def rpc_error(code: grpc.StatusCode, details: str = "boom") -> grpc.RpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (grpc.StatusCode.UNAVAILABLE, TritonUnavailable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, TritonTimeout),
        (grpc.StatusCode.INVALID_ARGUMENT, TritonInvalidInput),
        (grpc.StatusCode.NOT_FOUND, TritonModelError),
        (grpc.StatusCode.INTERNAL, TritonModelError),
        (grpc.StatusCode.UNKNOWN, TritonModelError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, TritonModelError),
    ],
)
def test_grpc_status_maps_to_our_exception(code, expected):
    error = error_from_rpc(rpc_error(code, "the details"), target="h:1", method="ModelInfer", model="m")
    assert type(error) is expected
    assert isinstance(error, TritonError)
    assert (error.target, error.model, error.status, error.details) == ("h:1", "m", code.name, "the details")
    assert str(error) == f"Triton at h:1: ModelInfer for model 'm' failed with {code.name}: the details"


def test_keepalive_never_pings_idle_connections_nor_faster_than_triton_allows():
    options = dict(channel_options())
    assert options["grpc.keepalive_permit_without_calls"] == 0
    # Triton's default grpc-http2-min-recv-ping-interval-without-data is 300 s.
    assert options["grpc.keepalive_time_ms"] > 300_000
    assert options["grpc.max_receive_message_length"] >= 256 * 1024 * 1024


class FakeStub:
    """Stands in for the generated stub: ServerReady fails with the queued errors, then answers."""

    def __init__(self, errors: list[grpc.RpcError]):
        self.errors = list(errors)
        self.calls: list[float] = []

    def ServerReady(self, request, timeout):
        assert timeout > 0
        self.calls.append(timeout)
        if self.errors:
            raise self.errors.pop(0)
        return pb.ServerReadyResponse(ready=True)


class AsyncFakeStub(FakeStub):
    async def ServerReady(self, request, timeout):
        return FakeStub.ServerReady(self, request, timeout)


def sync_client(stub: FakeStub, **options) -> TritonClient:
    client = TritonClient("fake:1", retry_backoff_s=0.01, **options)
    client._stub = lambda: stub
    return client


def test_unavailable_is_retried_then_succeeds():
    stub = FakeStub([rpc_error(grpc.StatusCode.UNAVAILABLE)] * 2)
    assert sync_client(stub, retries=2).server_ready() is True
    assert len(stub.calls) == 3
    assert stub.calls[0] > stub.calls[1] > stub.calls[2]  # one deadline shared by all attempts


def test_unavailable_after_all_retries_raises_from_the_grpc_error():
    last = rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused")
    stub = FakeStub([rpc_error(grpc.StatusCode.UNAVAILABLE)] * 2 + [last])
    with pytest.raises(TritonUnavailable, match=r"connection refused \(after 3 attempts\)") as raised:
        sync_client(stub, retries=2).server_ready()
    assert raised.value.__cause__ is last


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL]
)
def test_other_statuses_are_not_retried(code):
    stub = FakeStub([rpc_error(code)])
    with pytest.raises(TritonError):
        sync_client(stub, retries=5).server_ready()
    assert len(stub.calls) == 1


def test_retries_stop_at_the_deadline():
    stub = FakeStub([rpc_error(grpc.StatusCode.UNAVAILABLE)] * 1000)
    client = sync_client(stub, retries=1000, timeout_s=0.3)
    client.retry_backoff_s = client.retry_backoff_max_s = 0.05
    started = time.monotonic()
    with pytest.raises(TritonUnavailable):
        client.server_ready()
    assert time.monotonic() - started < 0.5
    assert 2 < len(stub.calls) < 20


def test_async_client_retries_like_the_sync_one():
    stub = AsyncFakeStub([rpc_error(grpc.StatusCode.UNAVAILABLE)])
    client = AsyncTritonClient("fake:1", retries=1, retry_backoff_s=0.01)
    client._stub = lambda: stub
    assert asyncio.run(client.server_ready()) is True
    assert len(stub.calls) == 2


def test_async_channels_are_made_per_event_loop():
    client = AsyncTritonClient("127.0.0.1:1", channels=3)

    async def stubs():
        return [client._stub() for _ in range(6)]

    first = asyncio.run(stubs())
    assert len({id(s) for s in first}) == 3  # round-robin over the pool
    second = asyncio.run(stubs())
    assert not {id(s) for s in first} & {id(s) for s in second}
    asyncio.run(client.close())


TOKEN_MODEL = ModelSpec(
    name="tokens",
    version="1",
    platform="python",
    inputs=(TensorSpec("input_ids", "INT64", (-1, -1)), TensorSpec("attention_mask", "INT64", (-1, -1))),
    outputs=(TensorSpec("token_count", "INT64", (-1, 1)), TensorSpec("vector", "FP32", (-1, 768))),
    max_batch_size=8,
)
TEXT_MODEL = ModelSpec(
    name="text",
    version="1",
    platform="ensemble",
    inputs=(TensorSpec("TEXT", "BYTES", (-1, 1)),),
    outputs=(TensorSpec("embedding", "FP32", (-1, 384)),),
    max_batch_size=64,
)


def test_embedding_output_is_the_named_or_else_the_first_fp32_output():
    assert TOKEN_MODEL.embedding_output().name == "vector"
    assert TOKEN_MODEL.embedding_output("token_count").name == "token_count"
    with pytest.raises(
        TritonModelError, match="has no output named 'nope'; its outputs are token_count INT64"
    ):
        TOKEN_MODEL.embedding_output("nope")


def test_token_inputs_for_a_token_model():
    ids = np.array([[101, 7, 102]])
    inputs = token_inputs(TOKEN_MODEL, ids, np.ones_like(ids))
    assert list(inputs) == ["input_ids", "attention_mask"]
    with_types = replace(
        TOKEN_MODEL, inputs=(*TOKEN_MODEL.inputs, TensorSpec("token_type_ids", "INT64", (-1, -1)))
    )
    np.testing.assert_array_equal(
        token_inputs(with_types, ids, np.ones_like(ids))["token_type_ids"], [[0, 0, 0]]
    )
    with pytest.raises(TritonInvalidInput, match="must both be"):
        token_inputs(TOKEN_MODEL, ids, np.ones((1, 2)))
    with pytest.raises(TritonModelError, match="does not take input_ids"):
        token_inputs(TEXT_MODEL, ids, np.ones_like(ids))


def test_text_inputs_are_n_by_1_bytes():
    inputs = text_inputs(TEXT_MODEL, ["héllo", "", b"\xff"])
    assert inputs["TEXT"].shape == (3, 1)
    assert inputs["TEXT"].ravel().tolist() == ["héllo".encode(), b"", b"\xff"]
    with pytest.raises(TritonModelError, match="single BYTES"):
        text_inputs(TOKEN_MODEL, ["x"])
