"""Client logic without a server: gRPC error mapping, retries, deadlines, model adaptation."""

import asyncio
from dataclasses import replace
from types import SimpleNamespace

import grpc
import numpy as np
import pytest

from embeddings.tooling.triton_server import TRITON_PING_FLAGS
from embeddings.triton import (
    AsyncTritonClient,
    ModelSpec,
    RepositoryModel,
    TensorSpec,
    TritonClient,
    TritonError,
    TritonInvalidInput,
    TritonModelError,
    TritonModelLoadFailed,
    TritonModelNotLoaded,
    TritonTimeout,
    TritonUnavailable,
)
from embeddings.triton import client as client_module
from embeddings.triton.client import channel_options, error_from_rpc, text_inputs, token_inputs
from embeddings.triton.protocol import grpc_service_pb2 as pb
from tests.clocks import ManualClock

pytestmark = pytest.mark.unit


def rpc_error(code: grpc.StatusCode, details: str = "boom") -> grpc.RpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (grpc.StatusCode.UNAVAILABLE, TritonUnavailable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, TritonTimeout),
        (grpc.StatusCode.INVALID_ARGUMENT, TritonInvalidInput),
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
    # Faster pings (replicas) no faster than the Triton we start allows.
    fast = dict(channel_options(keepalive_s=0.2))
    allowed_ms = int(TRITON_PING_FLAGS[0].rsplit("=", 1)[1])
    assert fast["grpc.keepalive_time_ms"] >= allowed_ms and fast["grpc.keepalive_permit_without_calls"] == 0


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


def test_retries_stop_at_the_deadline(monkeypatch):
    # The client's clock is one the backoff sleeps move, by exactly the delay: a loaded machine's
    # late wake-up cannot turn the last retry into a timeout.
    clock = ManualClock()
    monkeypatch.setattr(client_module, "time", SimpleNamespace(monotonic=clock, sleep=clock.advance))
    stub = FakeStub([rpc_error(grpc.StatusCode.UNAVAILABLE)] * 1000)
    client = sync_client(stub, retries=1000, timeout_s=0.3)
    client.retry_backoff_s = client.retry_backoff_max_s = 0.05
    started = clock()
    with pytest.raises(TritonUnavailable):
        client.server_ready()
    # Each retry waits 0.025-0.05 s; the one that would end past the deadline is not made.
    assert 0.25 < clock() - started < 0.3
    assert 6 < len(stub.calls) <= 13


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


# --- Models Triton does not serve, and the model repository API ----------------------------------

# Triton 2.51's own words (tests/triton/test_repository_api.py sees them from a real server).
UNKNOWN = "Request for unknown model: 'm' is not found"
NO_VERSIONS = "Request for unknown model: 'm' has no available versions"
NO_SUCH_VERSION = "Request for unknown model: 'm' version 7 is not found"
LOAD_FAILED = "load failed for model 'm': version 1 is at UNAVAILABLE state: Internal: RuntimeError: no"


@pytest.mark.parametrize(
    ("method", "code", "details", "expected"),
    [
        ("ModelInfer", grpc.StatusCode.NOT_FOUND, UNKNOWN, TritonModelNotLoaded),
        ("ModelMetadata", grpc.StatusCode.NOT_FOUND, NO_VERSIONS, TritonModelNotLoaded),
        ("ModelConfig", grpc.StatusCode.NOT_FOUND, NO_SUCH_VERSION, TritonModelNotLoaded),
        (
            "ModelStatistics",
            grpc.StatusCode.INVALID_ARGUMENT,
            "requested model 'm' is not available",
            TritonModelNotLoaded,
        ),
        # The words decide: never retried as a connection failure.
        ("ModelInfer", grpc.StatusCode.UNAVAILABLE, NO_VERSIONS, TritonModelNotLoaded),
        (
            "ModelInfer",
            grpc.StatusCode.INVALID_ARGUMENT,
            "expected 2 inputs but got 1 inputs for model 'm'",
            TritonInvalidInput,
        ),
        ("ModelInfer", grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses", TritonUnavailable),
        ("RepositoryModelLoad", grpc.StatusCode.INVALID_ARGUMENT, LOAD_FAILED, TritonModelLoadFailed),
        (
            "RepositoryModelLoad",
            grpc.StatusCode.INTERNAL,
            "failed to poll from model repository",
            TritonModelLoadFailed,
        ),
        ("RepositoryModelLoad", grpc.StatusCode.NOT_FOUND, UNKNOWN, TritonModelLoadFailed),
        ("RepositoryModelLoad", grpc.StatusCode.UNAVAILABLE, "connection refused", TritonUnavailable),
        ("RepositoryModelLoad", grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", TritonTimeout),
        ("RepositoryModelUnload", grpc.StatusCode.INTERNAL, "boom", TritonModelError),
    ],
)
def test_triton_answers_are_classified(method, code, details, expected):
    error = error_from_rpc(rpc_error(code, details), target="h:1", method=method, model="m")
    assert type(error) is expected
    assert (error.model, error.status, error.details) == ("m", code.name, details)


def test_not_loaded_names_the_model_and_version_and_carries_them():
    error = error_from_rpc(
        rpc_error(grpc.StatusCode.NOT_FOUND, NO_SUCH_VERSION),
        target="h:1",
        method="ModelInfer",
        model="m",
        version="7",
    )
    assert isinstance(error, TritonModelNotLoaded) and isinstance(error, TritonModelError)
    assert (error.model, error.version) == ("m", "7")
    assert (
        str(error)
        == f"Triton at h:1: ModelInfer for model 'm' version 7 failed with NOT_FOUND: {NO_SUCH_VERSION}"
    )


def test_not_found_without_a_model_is_not_a_model_that_is_not_loaded():
    error = error_from_rpc(rpc_error(grpc.StatusCode.NOT_FOUND, "no"), target="h:1", method="RepositoryIndex")
    assert type(error) is TritonModelError


def test_load_failed_carries_tritons_reason():
    error = error_from_rpc(
        rpc_error(grpc.StatusCode.INVALID_ARGUMENT, LOAD_FAILED),
        target="h:1",
        method="RepositoryModelLoad",
        model="m",
    )
    assert isinstance(error, TritonModelLoadFailed) and error.reason == LOAD_FAILED


class ScriptedStub:
    """Stands in for the generated stub: each method answers from its queue (a response, or an
    RpcError raised); every call is recorded as (method, request, timeout)."""

    def __init__(self, answers: dict[str, list]):
        self.answers = {method: list(queue) for method, queue in answers.items()}
        self.calls: list[tuple[str, object, float]] = []

    def answer(self, method: str, request, timeout: float):
        assert timeout > 0
        self.calls.append((method, request, timeout))
        queue = self.answers[method]
        answer = queue.pop(0) if len(queue) > 1 else queue[0]
        if isinstance(answer, grpc.RpcError):
            raise answer
        return answer

    def __getattr__(self, method: str):
        return lambda request, timeout: self.answer(method, request, timeout)

    def methods(self) -> list[str]:
        return [method for method, _, _ in self.calls]


class AsyncScriptedStub(ScriptedStub):
    def __getattr__(self, method: str):
        async def call(request, timeout):
            return self.answer(method, request, timeout)

        return call


def scripted_client(stub: ScriptedStub, *, asynchronous: bool, **options):
    client = (AsyncTritonClient if asynchronous else TritonClient)("fake:1", retry_backoff_s=0.01, **options)
    client._stub = lambda: stub
    return client


def run(client, method: str, *args, **kwargs):
    result = getattr(client, method)(*args, **kwargs)
    return asyncio.run(result) if asyncio.iscoroutine(result) else result


@pytest.fixture
def no_sleeping(monkeypatch):
    """Any backoff (time.sleep or asyncio.sleep inside the client) fails the test."""

    def refuse(seconds):
        raise AssertionError(f"the client slept {seconds} s before answering")

    monkeypatch.setattr(client_module.time, "sleep", refuse)
    monkeypatch.setattr(client_module.asyncio, "sleep", refuse)


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize(
    ("code", "details"),
    [(grpc.StatusCode.NOT_FOUND, NO_VERSIONS), (grpc.StatusCode.UNAVAILABLE, NO_VERSIONS)],
)
def test_a_model_that_is_not_loaded_fails_at_once(asynchronous, code, details, no_sleeping):
    stub = (AsyncScriptedStub if asynchronous else ScriptedStub)(
        {"ModelMetadata": [rpc_error(code, details)], "ModelConfig": [rpc_error(code, details)]}
    )
    client = scripted_client(stub, asynchronous=asynchronous, retries=5)
    ids = np.array([[101, 102]])
    with pytest.raises(TritonModelNotLoaded) as raised:
        run(client, "embed_tokens", "m", ids, np.ones_like(ids), version="2")
    assert (raised.value.model, raised.value.version) == ("m", "2")
    # One attempt per RPC (metadata and config are asked together), none retried.
    assert sorted(stub.methods()) in (["ModelConfig", "ModelMetadata"], ["ModelMetadata"], ["ModelConfig"])


@pytest.mark.parametrize("asynchronous", [False, True])
def test_infer_for_an_unloaded_model_fails_at_once_and_forgets_its_spec(asynchronous, no_sleeping):
    stub = (AsyncScriptedStub if asynchronous else ScriptedStub)(
        {"ModelInfer": [rpc_error(grpc.StatusCode.NOT_FOUND, NO_VERSIONS)]}
    )
    client = scripted_client(stub, asynchronous=asynchronous, retries=5)
    spec = replace(TOKEN_MODEL, name="m")
    client._specs.update({("m", ""): spec, ("m", "1"): spec, ("other", ""): TOKEN_MODEL})
    ids = np.array([[101, 102]] * 20)  # three batches of at most 8 rows, sent together
    with pytest.raises(TritonModelNotLoaded):
        run(client, "embed_tokens", "m", ids, np.ones_like(ids))
    assert 1 <= len(stub.calls) <= 3 and set(stub.methods()) == {"ModelInfer"}
    assert set(client._specs) == {("other", "")}


@pytest.mark.parametrize("asynchronous", [False, True])
def test_repository_index_reads_each_model_version(asynchronous):
    index = pb.RepositoryIndexResponse(
        models=[
            pb.RepositoryIndexResponse.ModelIndex(name="a", version="1", state="READY"),
            pb.RepositoryIndexResponse.ModelIndex(name="b", version="1", state="UNAVAILABLE", reason="bad"),
            pb.RepositoryIndexResponse.ModelIndex(name="c"),
        ]
    )
    stub = (AsyncScriptedStub if asynchronous else ScriptedStub)({"RepositoryIndex": [index]})
    client = scripted_client(stub, asynchronous=asynchronous)
    assert run(client, "repository_index", ready_only=True) == [
        RepositoryModel("a", "1", "READY", ""),
        RepositoryModel("b", "1", "UNAVAILABLE", "bad"),
        RepositoryModel("c", "", "", ""),
    ]
    assert stub.calls[0][1].ready is True


@pytest.mark.parametrize("asynchronous", [False, True])
def test_model_load_sends_the_config_under_its_own_deadline_and_forgets_the_spec(asynchronous):
    stub = (AsyncScriptedStub if asynchronous else ScriptedStub)(
        {"RepositoryModelLoad": [pb.RepositoryModelLoadResponse()]}
    )
    client = scripted_client(stub, asynchronous=asynchronous, timeout_s=5, model_load_timeout_s=250)
    client._specs[("m", "")] = TOKEN_MODEL
    run(client, "model_load", "m", config='{"name": "m"}')
    ((_, request, timeout),) = stub.calls
    assert request.model_name == "m" and request.parameters["config"].string_param == '{"name": "m"}'
    assert 5 < timeout <= 250
    assert not client._specs
    run(client, "model_load", "m", timeout_s=2)
    assert "config" not in stub.calls[1][1].parameters and stub.calls[1][2] <= 2


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_failed_load_raises_tritons_reason_once_and_forgets_the_spec(asynchronous, no_sleeping):
    stub = (AsyncScriptedStub if asynchronous else ScriptedStub)(
        {"RepositoryModelLoad": [rpc_error(grpc.StatusCode.INVALID_ARGUMENT, LOAD_FAILED)]}
    )
    client = scripted_client(stub, asynchronous=asynchronous, retries=5)
    client._specs[("m", "1")] = TOKEN_MODEL
    with pytest.raises(TritonModelLoadFailed, match="RuntimeError: no") as raised:
        run(client, "model_load", "m")
    assert raised.value.reason == LOAD_FAILED and len(stub.calls) == 1
    assert not client._specs


@pytest.mark.parametrize("asynchronous", [False, True])
def test_model_unload_asks_for_dependents_and_forgets_the_spec(asynchronous):
    stub = (AsyncScriptedStub if asynchronous else ScriptedStub)(
        {"RepositoryModelUnload": [pb.RepositoryModelUnloadResponse()]}
    )
    client = scripted_client(stub, asynchronous=asynchronous)
    client._specs[("m", "")] = TOKEN_MODEL
    run(client, "model_unload", "m", unload_dependents=True)
    ((_, request, _),) = stub.calls
    assert request.model_name == "m" and request.parameters["unload_dependents"].bool_param is True
    assert not client._specs
