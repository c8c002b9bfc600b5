"""Pooled gRPC clients for Triton: `AsyncTritonClient` (grpc.aio) and `TritonClient` (blocking).

What to ask Triton and how to read its answers is written once, in `_TritonClientBase`: each
operation is a generator that yields the RPCs it needs (a `Call`, or a list of calls to run
concurrently) and is sent their responses back. The two clients differ only in how they run
a call: awaiting on grpc.aio channels, or blocking on plain grpc channels from a small
thread pool. Both give every call a deadline, retry UNAVAILABLE with exponential backoff and
jitter inside that deadline, and turn gRPC errors into the exceptions of `errors.py`.

Several replicas (a list of addresses, or a `dns:///` name: embeddings/triton/targets.py) are
balanced by gRPC's own `round_robin` policy, which skips a replica whose connection fails; a call
one of them does not answer within `attempt_timeout_s` (a link whose packets are dropped answers
nothing, not even a refusal) is sent again, within the same deadline, and round-robin takes it to
another. `replica(endpoint)` gives a client of one replica, for readiness and statistics; a model
the replicas disagree about is refused (`refuse_model`) rather than served mixed.

Besides inference they speak Triton's model repository API (Triton run with
--model-control-mode=explicit): `repository_index`, `model_load` (optionally with a JSON
ModelConfig override) and `model_unload`. A model Triton does not serve (never loaded, unloaded,
failed to load, or not that version) raises `TritonModelNotLoaded` at once, without retries.
"""

import asyncio
import itertools
import json
import os
import random
import re
import threading
import time
from collections.abc import Generator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import grpc
import numpy as np

from . import codec
from .errors import (
    TritonError,
    TritonInvalidInput,
    TritonModelError,
    TritonModelLoadFailed,
    TritonModelMismatch,
    TritonModelNotLoaded,
    TritonTimeout,
    TritonUnavailable,
)
from .protocol import grpc_service_pb2 as pb
from .protocol import grpc_service_pb2_grpc as pb_grpc
from .protocol import model_config_pb2
from .targets import TritonTarget, replica_endpoints

# gRPC's default receive cap is 4 MiB, about 1,000 vectors of 1024 floats.
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024

# Triton's gRPC server keeps gRPC core's keepalive defaults unless told otherwise:
# keepalive_permit_without_calls=0, http2 min_recv_ping_interval_without_data=300 s and
# max_ping_strikes=2; a client pinging more often, or while no call is in flight, collects strikes
# and is sent GOAWAY (ENHANCE_YOUR_CALM), failing its calls. So by default: ping only during calls,
# and no more often than every 360 s; a single Triton's death during a call is caught by the call's
# deadline. A connection to one of several replicas is pinged every `keepalive_s` (TRITON_KEEPALIVE_S)
# instead, so a replica that went silent is found out within twice that and its calls go elsewhere:
# its Triton must accept such pings (TRITON_PING_FLAGS in server.py, which the local Triton, compose
# and Kubernetes pass).
KEEPALIVE_TIME_MS = 360_000
KEEPALIVE_TIMEOUT_MS = 20_000


def channel_options(
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, keepalive_s: float | None = None
) -> list[tuple[str, int | str]]:
    """gRPC channel arguments shared by the async and the sync channels; `keepalive_s`: ping each
    connection that has calls in flight this often, and drop it when a ping goes unanswered as
    long (also its TCP user timeout)."""
    keepalive_ms = KEEPALIVE_TIME_MS if keepalive_s is None else max(1000, round(keepalive_s * 1000))
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS if keepalive_s is None else keepalive_ms),
        ("grpc.keepalive_permit_without_calls", 0),
        # With fast pings, as many as the call needs (a long inference sends no data meanwhile).
        ("grpc.http2.max_pings_without_data", 2 if keepalive_s is None else 0),
        # Without it gRPC shares one subchannel (one TCP connection) among equal channels,
        # and a pool of N channels would be one connection.
        ("grpc.use_local_subchannel_pool", 1),
        # After a Triton restart, reconnect within seconds instead of backing off up to 120 s.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 5_000),
        ("grpc.service_config", SERVICE_CONFIG),
    ]


# How each channel spreads its calls over the replicas, all of it gRPC's own: round_robin takes every
# address the target resolves to in turn, skipping those whose connection failed (the default,
# pick_first, would send everything to the first); outlier detection takes a replica out for a
# while (5 s, then longer each time) when half its calls in a second failed, as calls to a replica
# that answers nothing do (each attempt times out): without it round_robin keeps choosing that
# replica while its connection looks open, and every other call waits out an attempt there. Never
# more than half the replicas are taken out; with one replica it does nothing.
SERVICE_CONFIG = json.dumps(
    {
        "loadBalancingConfig": [
            {
                "outlier_detection_experimental": {
                    "interval": "1s",
                    "baseEjectionTime": "5s",
                    "maxEjectionTime": "30s",
                    "maxEjectionPercent": 50,
                    "failurePercentageEjection": {
                        "threshold": 50,
                        "enforcementPercentage": 100,
                        "minimumHosts": 2,
                        # Per channel and second: a pool's channels each see few calls.
                        "requestVolume": 1,
                    },
                    "childPolicy": [{"round_robin": {}}],
                }
            }
        ]
    }
)


# Calls that may be sent again when an attempt times out: reads and inference (a pure function).
# Loading and unloading models are not: they have their own long deadline.
_REPEATABLE = frozenset(
    {"ModelInfer", "ModelMetadata", "ModelConfig", "ModelReady", "ServerLive", "ServerReady",
     "ModelStatistics", "RepositoryIndex"}
)  # fmt: skip


# Triton's dynamic batcher serves lower levels first when the model config sets priority_levels
# (ours: 3, default 1): a request that fits in one sub-batch, the sub-batches of a large request,
# then bulk work (job chunks). So across server processes a small request overtakes a large one's
# queued sub-batches, and both overtake queued job chunks. A model without priority levels treats
# any level as its default.
PRIORITY_INTERACTIVE = 1
PRIORITY_LARGE = 2
PRIORITY_BULK = 3


_ERRORS_BY_STATUS: dict[grpc.StatusCode, type[TritonError]] = {
    grpc.StatusCode.UNAVAILABLE: TritonUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: TritonTimeout,
    grpc.StatusCode.INVALID_ARGUMENT: TritonInvalidInput,
}

# Triton (2.51) answers a call for a model it serves no ready version of with NOT_FOUND for
# ModelInfer, ModelMetadata and ModelConfig: "Request for unknown model: 'm' is not found" (not
# loaded, or unknown), "... 'm' has no available versions" (unloaded, failed to load, loading),
# "... 'm' version 7 is not found"; and ModelStatistics with INVALID_ARGUMENT "requested model 'm'
# is not available". The words decide, whatever the status, so such an answer is never retried.
MODEL_NOT_LOADED_DETAILS = re.compile(r"Request for unknown model|requested model '.*' is not available")
# Whatever stops a load other than the connection or the deadline is the model's failure: Triton
# says INVALID_ARGUMENT "load failed for model 'm': version 1 is at UNAVAILABLE state: <reason>", or
# INTERNAL "failed to poll from model repository" (no such folder, a config that does not parse).
_LOAD_TRANSPORT_FAILURES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _error_class(status: grpc.StatusCode, details: str, *, method: str, model: str) -> type[TritonError]:
    if method == "RepositoryModelLoad" and status not in _LOAD_TRANSPORT_FAILURES:
        return TritonModelLoadFailed
    if model and (status == grpc.StatusCode.NOT_FOUND or MODEL_NOT_LOADED_DETAILS.search(details)):
        return TritonModelNotLoaded
    return _ERRORS_BY_STATUS.get(status, TritonModelError)


def error_from_rpc(
    error: grpc.RpcError, *, target: str, method: str, model: str = "", version: str = ""
) -> TritonError:
    """Our exception for a failed RPC: a model Triton does not serve is `TritonModelNotLoaded`, a
    failed RepositoryModelLoad `TritonModelLoadFailed`; otherwise UNAVAILABLE, DEADLINE_EXCEEDED and
    INVALID_ARGUMENT map to their own classes and every other status is a `TritonModelError`."""
    code = error.code() if callable(getattr(error, "code", None)) else None
    status = code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN
    details = (error.details() if callable(getattr(error, "details", None)) else None) or str(error)
    error_class = _error_class(status, details, method=method, model=model)
    model_named = f"model {model!r}" + (f" version {version}" if version else "")
    subject = f"{method} for {model_named}" if model else method
    message = f"Triton at {target}: {subject} failed with {status.name}: {details}"
    context = {"target": target, "model": model, "status": status.name, "details": details}
    if error_class is TritonModelNotLoaded:
        return TritonModelNotLoaded(message, version=version, **context)
    return error_class(message, **context)


class RepositoryModel(NamedTuple):
    """One entry of Triton's repository index: a model version and what state it is in."""

    name: str
    # "" for a model Triton has never tried to load.
    version: str
    # As Triton says it: "READY", "UNAVAILABLE", "LOADING", "UNLOADING"; "" when never loaded.
    state: str
    # Why it is in that state (a failed load's error), else "".
    reason: str


class TensorSpec(NamedTuple):
    name: str
    datatype: str
    # As in ModelMetadata: includes the batch dimension (-1) when the model batches.
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ModelSpec:
    """What the client needs to know about a model, read once from ModelMetadata and ModelConfig."""

    name: str
    version: str
    platform: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    # 0: the model does not batch; otherwise the most rows one ModelInfer call may carry.
    max_batch_size: int
    # Every version the server serves, oldest first.
    served_versions: tuple[str, ...] = ()
    # What runs it, from its configuration: the backend ("embedsite_onnx", "embedsite_torch"), its
    # parameters (key, value), its instance groups' kinds ("KIND_GPU") and GPU execution
    # accelerators (name, its parameters). Not compared: replicas that run one version on different
    # engines still answer the same inputs and outputs (a change of engine rolls out replica by replica).
    backend: str = field(default="", compare=False)
    parameters: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    instance_kinds: tuple[str, ...] = field(default=(), compare=False)
    gpu_accelerators: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = field(default=(), compare=False)

    def parameter(self, key: str, default: str = "") -> str:
        return dict(self.parameters).get(key, default)

    def input(self, name: str) -> TensorSpec | None:
        return next((tensor for tensor in self.inputs if tensor.name == name), None)

    def embedding_output(self, name: str | None = None) -> TensorSpec:
        """The named output, or else the model's first FP32 output."""
        for tensor in self.outputs:
            if tensor.name == name or (name is None and tensor.datatype == "FP32"):
                return tensor
        wanted = f"output named {name!r}" if name else "FP32 output"
        raise TritonModelError(
            f"model {self.name!r} has no {wanted}; its outputs are {_describe(self.outputs)}",
            model=self.name,
        )


@dataclass(frozen=True)
class ModelStatistics:
    """Cumulative counters of one model, summed over its versions."""

    name: str
    # Rows inferred: one request of 64 rows adds 64.
    inference_count: int
    # Model executions: requests merged by Triton's dynamic batcher count once.
    execution_count: int
    success_count: int
    failure_count: int
    queue_ns: int
    compute_infer_ns: int
    # Batch size -> number of executions with that size.
    batch_executions: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Call:
    """One RPC an operation needs: the stub method's name, its request, the model (and version)
    it concerns."""

    method: str
    request: Any
    model: str = ""
    version: str = ""

    @property
    def repeatable(self) -> bool:
        return self.method in _REPEATABLE


# An operation yields a Call (and is sent its response) or a list of Calls (and is sent the
# list of responses, in the same order), and returns its result.
Operation = Generator[Call | list[Call], Any, Any]


def _describe(tensors: Sequence[TensorSpec]) -> str:
    return ", ".join(f"{t.name} {t.datatype} {list(t.shape)}" for t in tensors) or "none"


def _model_spec(
    metadata: pb.ModelMetadataResponse, config: model_config_pb2.ModelConfig, version: str
) -> ModelSpec:
    def tensors(entries) -> tuple[TensorSpec, ...]:
        return tuple(TensorSpec(t.name, t.datatype, tuple(t.shape)) for t in entries)

    served = sorted(metadata.versions, key=lambda v: (len(v), v))
    return ModelSpec(
        name=metadata.name,
        version=version or (served[-1] if served else ""),
        platform=metadata.platform,
        inputs=tensors(metadata.inputs),
        outputs=tensors(metadata.outputs),
        max_batch_size=config.max_batch_size,
        served_versions=tuple(served),
        backend=config.backend,
        parameters=tuple(sorted((key, value.string_value) for key, value in config.parameters.items())),
        instance_kinds=tuple(
            model_config_pb2.ModelInstanceGroup.Kind.Name(group.kind) for group in config.instance_group
        ),
        gpu_accelerators=tuple(
            (accelerator.name, tuple(sorted(accelerator.parameters.items())))
            for accelerator in config.optimization.execution_accelerators.gpu_execution_accelerator
        ),
    )


def token_inputs(
    spec: ModelSpec,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    token_type_ids: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """The input tensors of a token-id model (`input_ids`, `attention_mask`, optional
    `token_type_ids`: the given ones, else all 0; a model without token types gets none)."""
    names = {tensor.name for tensor in spec.inputs}
    if not {"input_ids", "attention_mask"} <= names or not names <= {
        "input_ids",
        "attention_mask",
        "token_type_ids",
    }:
        raise TritonModelError(
            f"model {spec.name!r} does not take input_ids/attention_mask token ids; "
            f"its inputs are {_describe(spec.inputs)}",
            model=spec.name,
        )
    input_ids, attention_mask = np.asarray(input_ids), np.asarray(attention_mask)
    if input_ids.ndim != 2 or input_ids.shape != attention_mask.shape:
        raise TritonInvalidInput(
            f"input_ids {input_ids.shape} and attention_mask {attention_mask.shape} "
            "must both be [batch, sequence]",
            model=spec.name,
        )
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if "token_type_ids" in names:
        if token_type_ids is None:
            token_type_ids = np.zeros_like(input_ids)
        elif np.shape(token_type_ids) != input_ids.shape:
            raise TritonInvalidInput(
                f"token_type_ids {np.shape(token_type_ids)} must have input_ids' shape {input_ids.shape}",
                model=spec.name,
            )
        inputs["token_type_ids"] = np.asarray(token_type_ids)
    return inputs


def text_inputs(spec: ModelSpec, texts: Sequence[str | bytes]) -> dict[str, np.ndarray]:
    """The input tensor of a text model: its single BYTES input, one text per row ([N, 1])."""
    if len(spec.inputs) != 1 or spec.inputs[0].datatype != codec.BYTES or len(spec.inputs[0].shape) > 2:
        raise TritonModelError(
            f"model {spec.name!r} does not take a single BYTES text input; its inputs are "
            f"{_describe(spec.inputs)} (tokenize in the service and use embed_tokens)",
            model=spec.name,
        )
    tensor = spec.inputs[0]
    array = np.empty(len(texts), dtype=object)
    array[:] = [text.encode("utf-8") if isinstance(text, str) else bytes(text) for text in texts]
    return {tensor.name: array.reshape(-1, 1) if len(tensor.shape) == 2 else array}


class _TritonClientBase:
    """Configuration, the model spec cache, and every operation, independent of the transport.

    target: "host:port" of Triton's gRPC endpoint. channels: connections in the round-robin
    pool. timeout_s: the deadline of each RPC, retries included (an embed call may make
    several RPCs: ModelMetadata and ModelConfig the first time a model is used, then one
    ModelInfer per batch, all concurrent). retries: extra attempts after UNAVAILABLE, waiting
    retry_backoff_s * 2**attempt (at most retry_backoff_max_s) with jitter.
    max_message_bytes: gRPC send/receive cap. model_load_timeout_s: the deadline of `model_load`
    and `model_unload` (Triton answers once the model is loaded or failed, or unloaded).
    attempt_timeout_s: how long one attempt of a repeatable call may take before it is sent again
    (to another replica) within the deadline; None: the whole deadline. keepalive_s: ping
    connections with calls in flight this often (channel_options); None: every 360 s.
    """

    def __init__(
        self,
        target: str,
        *,
        channels: int = 2,
        timeout_s: float = 30.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        retries: int = 3,
        retry_backoff_s: float = 0.1,
        retry_backoff_max_s: float = 2.0,
        model_load_timeout_s: float = 300.0,
        attempt_timeout_s: float | None = None,
        keepalive_s: float | None = None,
    ) -> None:
        if (
            channels < 1
            or timeout_s <= 0
            or retries < 0
            or max_message_bytes <= 0
            or model_load_timeout_s <= 0
        ):
            raise ValueError(
                f"need channels >= 1, timeout_s > 0, retries >= 0, max_message_bytes > 0 and "
                f"model_load_timeout_s > 0; got {channels}, {timeout_s}, {retries}, {max_message_bytes}, "
                f"{model_load_timeout_s}"
            )
        self.target = target
        self.channels = channels
        self.timeout_s = timeout_s
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        self.retry_backoff_max_s = retry_backoff_max_s
        self.model_load_timeout_s = model_load_timeout_s
        self.attempt_timeout_s = attempt_timeout_s
        self.replicas = TritonTarget.of_grpc_target(target)
        self._options = channel_options(max_message_bytes, keepalive_s)
        self._max_message_bytes = max_message_bytes
        self._round_robin = itertools.count()
        self._specs: dict[tuple[str, str], ModelSpec] = {}
        # Model name -> why it is refused: its replicas disagree (set by readiness checks).
        self._refused: dict[str, str] = {}
        self._replica_clients: dict[str, _TritonClientBase] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.target!r}, channels={self.channels})"

    # Replicas.

    def replica_endpoints(self) -> list[str]:
        """Each replica's "address:port" (resolving a `dns:///` name: blocking)."""
        return replica_endpoints(self.replicas)

    def replica(self, endpoint: str, *, timeout_s: float) -> Any:
        """A client of one replica (no retries), kept for the next time; for readiness and
        statistics, never for inference."""
        client = self._replica_clients.get(endpoint)
        if client is None:
            client = self._replica_clients[endpoint] = type(self)(
                endpoint,
                channels=1,
                timeout_s=timeout_s,
                retries=0,
                max_message_bytes=self._max_message_bytes,
            )
        return client

    def refuse_model(self, name: str, reason: str | None) -> None:
        """Refuse calls for `name` with TritonModelMismatch(reason), or serve it again (None)."""
        if reason is None:
            self._refused.pop(name, None)
        elif self._refused.get(name) != reason:
            self._refused[name] = reason
            self.forget_model(name)

    # Retries and errors, used by both transports.

    def _attempt_timeout(self, call: Call, remaining: float) -> tuple[float, bool]:
        """(timeout of this attempt, whether it is shorter than what is left of the deadline)."""
        if self.attempt_timeout_s is not None and call.repeatable and self.attempt_timeout_s < remaining:
            return self.attempt_timeout_s, True
        return remaining, False

    def _retry_delay(
        self, error: grpc.RpcError, call: Call, attempt: int, deadline: float, *, cut_short: bool = False
    ) -> float:
        """Seconds to wait before retrying `call`, or raise our exception for `error`.

        UNAVAILABLE is retried (Triton unreachable, restarting, or the connection dropped:
        inference is a pure function, so sending it again is safe), and only while the retry
        still fits in the call's deadline. An attempt `cut_short` by attempt_timeout_s is sent
        again at once, as often as the deadline allows: a replica that answers nothing costs
        each call one attempt, not the call.
        """
        if cut_short and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() < deadline:
            return 0.0
        failure = error_from_rpc(
            error, target=self.target, method=call.method, model=call.model, version=call.version
        )
        if isinstance(failure, TritonModelNotLoaded):
            # Its spec may describe a version that is gone, or come back different once loaded again.
            self.forget_model(call.model)
        # With replicas: another may serve a model one does not (still loading it, restarted), and a
        # connection that breaks fails every call on it at once, retries just sent there included.
        # Four more attempts, backing off, last past the second in which outlier detection takes a
        # failing replica out of the rotation (with none serving the model: a 503 in ~2 s).
        retryable = isinstance(failure, TritonUnavailable) or (
            self.replicas.replicated and isinstance(failure, TritonModelNotLoaded)
        )
        if retryable and attempt < self.retries + (4 if self.replicas.replicated else 0):
            backoff = min(self.retry_backoff_max_s, self.retry_backoff_s * 2**attempt)
            delay = backoff * random.uniform(0.5, 1.0)
            if time.monotonic() + delay < deadline:
                return delay
        if attempt:
            failure.args = (f"{failure.args[0]} (after {attempt + 1} attempts)",)
        raise failure from error

    def _remaining(self, deadline: float, call: Call, budget_s: float) -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TritonTimeout(
                f"Triton at {self.target}: {call.method} ran out of its {budget_s} s deadline",
                target=self.target,
                model=call.model,
                status="DEADLINE_EXCEEDED",
            )
        return remaining

    def forget_model(self, name: str) -> None:
        """Drop the cached specs of every version of `name` (it was loaded, unloaded or is gone)."""
        for key in [key for key in self._specs if key[0] == name]:
            self._specs.pop(key, None)

    # Operations: generators run by the transports' `_run`.

    def _server_live_op(self) -> Operation:
        return (yield Call("ServerLive", pb.ServerLiveRequest())).live

    def _server_ready_op(self) -> Operation:
        return (yield Call("ServerReady", pb.ServerReadyRequest())).ready

    def _model_ready_op(self, name: str, version: str) -> Operation:
        request = pb.ModelReadyRequest(name=name, version=version)
        return (yield Call("ModelReady", request, name, version)).ready

    def _model_spec_op(self, name: str, version: str) -> Operation:
        if name in self._refused:
            raise TritonModelMismatch(self._refused[name], target=self.target, model=name)
        key = (name, version)
        if key not in self._specs:
            metadata, config = yield [
                Call("ModelMetadata", pb.ModelMetadataRequest(name=name, version=version), name, version),
                Call("ModelConfig", pb.ModelConfigRequest(name=name, version=version), name, version),
            ]
            self._specs[key] = _model_spec(metadata, config.config, version)
        return self._specs[key]

    def _model_statistics_op(self, name: str, version: str) -> Operation:
        request = pb.ModelStatisticsRequest(name=name, version=version)
        response = yield Call("ModelStatistics", request, name, version)
        batch_executions: dict[int, int] = {}
        totals = dict.fromkeys(("inference", "execution", "success", "failure", "queue", "infer"), 0)
        for stats in response.model_stats:
            totals["inference"] += stats.inference_count
            totals["execution"] += stats.execution_count
            totals["success"] += stats.inference_stats.success.count
            totals["failure"] += stats.inference_stats.fail.count
            totals["queue"] += stats.inference_stats.queue.ns
            totals["infer"] += stats.inference_stats.compute_infer.ns
            for batch in stats.batch_stats:
                size = int(batch.batch_size)
                batch_executions[size] = batch_executions.get(size, 0) + batch.compute_infer.count
        return ModelStatistics(
            name=name,
            inference_count=totals["inference"],
            execution_count=totals["execution"],
            success_count=totals["success"],
            failure_count=totals["failure"],
            queue_ns=totals["queue"],
            compute_infer_ns=totals["infer"],
            batch_executions=batch_executions,
        )

    def _infer_op(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        version: str,
        output_name: str | None,
        priority: int = 0,
    ) -> Operation:
        spec = yield from self._model_spec_op(model, version)
        output = spec.embedding_output(output_name)
        inputs = {name: np.asarray(array) for name, array in inputs.items()}
        rows = self._batch_rows(spec, inputs)
        # Cast to the model's datatypes (int32 ids to INT64, ...); unknown names are Triton's to refuse.
        datatypes = {tensor.name: tensor.datatype for tensor in spec.inputs if tensor.name in inputs}
        requests = [
            codec.build_infer_request(
                model,
                codec.slice_rows(inputs, batch) if spec.max_batch_size > 0 else inputs,
                version=version,
                datatypes=datatypes,
                output_names=[output.name],
                priority=priority,
            )
            for batch in codec.split_batches(rows, spec.max_batch_size)
        ]
        responses = yield [Call("ModelInfer", request, model, version) for request in requests]
        parts = []
        for response in responses:
            decoded = codec.decode_infer_response(response)
            if output.name not in decoded:
                raise TritonModelError(
                    f"model {model!r} answered without output {output.name!r}",
                    target=self.target,
                    model=model,
                )
            parts.append(decoded[output.name])
        return codec.reassemble(parts)

    def _repository_index_op(self, ready_only: bool) -> Operation:
        response = yield Call("RepositoryIndex", pb.RepositoryIndexRequest(ready=ready_only))
        return [RepositoryModel(m.name, m.version, m.state, m.reason) for m in response.models]

    def _model_load_op(self, name: str, config: str | None) -> Operation:
        parameters = {} if config is None else {"config": pb.ModelRepositoryParameter(string_param=config)}
        request = pb.RepositoryModelLoadRequest(model_name=name, parameters=parameters)
        try:
            yield Call("RepositoryModelLoad", request, name)
        finally:
            # Loaded, reloaded with another config, or failed: what was cached may be untrue now.
            self.forget_model(name)

    def _model_unload_op(self, name: str, unload_dependents: bool) -> Operation:
        parameters = {"unload_dependents": pb.ModelRepositoryParameter(bool_param=unload_dependents)}
        request = pb.RepositoryModelUnloadRequest(model_name=name, parameters=parameters)
        try:
            yield Call("RepositoryModelUnload", request, name)
        finally:
            self.forget_model(name)

    def _embed_op(
        self, model: str, version: str, output_name: str | None, priority: int, make_inputs, *arguments
    ) -> Operation:
        spec = yield from self._model_spec_op(model, version)
        embeddings = yield from self._infer_op(
            model, make_inputs(spec, *arguments), version, output_name, priority
        )
        if embeddings.ndim != 2 or embeddings.dtype != np.float32:
            raise TritonModelError(
                f"model {model!r} answered {embeddings.dtype} {list(embeddings.shape)}, "
                "not FP32 [batch, dimensions]",
                target=self.target,
                model=model,
            )
        return embeddings

    def _batch_rows(self, spec: ModelSpec, inputs: Mapping[str, np.ndarray]) -> int:
        """The number of rows in `inputs` (1 when the model does not batch)."""
        if not inputs:
            raise TritonInvalidInput(f"no input tensors for model {spec.name!r}", model=spec.name)
        if spec.max_batch_size <= 0:
            return 1
        counts = {name: (array.shape[0] if array.ndim else None) for name, array in inputs.items()}
        if len(set(counts.values())) != 1 or None in counts.values():
            raise TritonInvalidInput(
                f"inputs of model {spec.name!r} must share their first (batch) dimension: {counts}",
                model=spec.name,
            )
        rows = next(iter(counts.values()))
        if rows == 0:
            raise TritonInvalidInput(f"inputs of model {spec.name!r} have no rows", model=spec.name)
        return rows


class AsyncTritonClient(_TritonClientBase):
    """asyncio client on a pool of grpc.aio channels, used round-robin.

    Channels are created lazily in the running event loop, and created again when the client
    is used from another loop (grpc.aio channels only work in the loop that made them).
    """

    def __init__(self, target: str, **options: Any) -> None:
        super().__init__(target, **options)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._channel_pool: list[grpc.aio.Channel] = []
        self._stubs: list[pb_grpc.GRPCInferenceServiceStub] = []

    async def __aenter__(self) -> "AsyncTritonClient":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def server_live(self) -> bool:
        return await self._run(self._server_live_op())

    async def server_ready(self) -> bool:
        return await self._run(self._server_ready_op())

    async def model_ready(self, name: str, version: str = "") -> bool:
        return await self._run(self._model_ready_op(name, version))

    async def model_metadata(self, name: str, version: str = "") -> ModelSpec:
        """The model's inputs, outputs and max_batch_size; read from Triton once, then cached."""
        return await self._run(self._model_spec_op(name, version))

    async def model_statistics(self, name: str, version: str = "") -> ModelStatistics:
        return await self._run(self._model_statistics_op(name, version))

    async def repository_index(self, *, ready_only: bool = False) -> list[RepositoryModel]:
        """Every model of Triton's repositories with its versions' states (only READY ones with
        `ready_only`); a model never loaded has one entry with empty version and state."""
        return await self._run(self._repository_index_op(ready_only))

    async def model_load(
        self, name: str, *, config: str | None = None, timeout_s: float | None = None
    ) -> None:
        """Load (or reload) `name` and return once Triton serves it; `config`: a JSON ModelConfig
        used instead of the model folder's. Raises TritonModelLoadFailed with Triton's reason.
        `timeout_s` defaults to model_load_timeout_s."""
        await self._run(self._model_load_op(name, config), timeout_s or self.model_load_timeout_s)

    async def model_unload(
        self, name: str, *, unload_dependents: bool = False, timeout_s: float | None = None
    ) -> None:
        """Unload `name` (and, for an ensemble with `unload_dependents`, the models it is made
        of). Returns once Triton stops taking requests for it (its instances may still finish
        theirs: the index says UNLOADING); Triton answers OK for a model it did not serve."""
        await self._run(
            self._model_unload_op(name, unload_dependents), timeout_s or self.model_load_timeout_s
        )

    async def infer(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        version: str = "",
        output_name: str | None = None,
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> np.ndarray:
        """One output (named, or the first FP32 one) for `inputs`, split into concurrent calls
        of at most max_batch_size rows and reassembled in order. `priority`: Triton's queue level
        (PRIORITY_INTERACTIVE, PRIORITY_BULK; 0 the model's default); `timeout_s` replaces the
        client's deadline for this call."""
        return await self._run(self._infer_op(model, inputs, version, output_name, priority), timeout_s)

    async def embed_tokens(
        self,
        model: str,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        *,
        token_type_ids: np.ndarray | None = None,
        version: str = "",
        output_name: str | None = None,
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> np.ndarray:
        """FP32 [batch, dimensions] embeddings of token ids ([batch, sequence] each), or a
        cross-encoder's [batch, 1] scores of pairs (with their `token_type_ids`); `priority` and
        `timeout_s` as for `infer`."""
        return await self._run(
            self._embed_op(
                model, version, output_name, priority, token_inputs, input_ids, attention_mask, token_type_ids
            ),
            timeout_s,
        )

    async def embed_texts(
        self,
        model: str,
        texts: Sequence[str | bytes],
        *,
        version: str = "",
        output_name: str | None = None,
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> np.ndarray:
        """FP32 [batch, dimensions] embeddings from a model that takes text (a BYTES input);
        `priority` and `timeout_s` as for `infer`."""
        return await self._run(
            self._embed_op(model, version, output_name, priority, text_inputs, texts), timeout_s
        )

    async def close(self) -> None:
        replicas, self._replica_clients = list(self._replica_clients.values()), {}
        for replica in replicas:
            await replica.close()
        channels, loop = self._channel_pool, self._loop
        self._channel_pool, self._stubs, self._loop = [], [], None
        # Channels of another (possibly closed) loop cannot be awaited from this one: dropped.
        if channels and loop is asyncio.get_running_loop():
            await asyncio.gather(*(channel.close() for channel in channels))

    def _stub(self) -> pb_grpc.GRPCInferenceServiceStub:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._channel_pool = [
                grpc.aio.insecure_channel(self.target, options=self._options) for _ in range(self.channels)
            ]
            self._stubs = [pb_grpc.GRPCInferenceServiceStub(channel) for channel in self._channel_pool]
            self._loop = loop
        return self._stubs[next(self._round_robin) % len(self._stubs)]

    async def _call(self, call: Call, timeout_s: float | None = None) -> Any:
        budget_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget_s
        for attempt in itertools.count():
            method = getattr(self._stub(), call.method)
            timeout, cut_short = self._attempt_timeout(call, self._remaining(deadline, call, budget_s))
            try:
                return await method(call.request, timeout=timeout)
            except grpc.RpcError as error:
                delay = self._retry_delay(error, call, attempt, deadline, cut_short=cut_short)
            await asyncio.sleep(delay)

    async def _gather(self, calls: list[Call], timeout_s: float | None = None) -> list[Any]:
        if len(calls) == 1:
            return [await self._call(calls[0], timeout_s)]
        tasks = [asyncio.ensure_future(self._call(call, timeout_s)) for call in calls]
        try:
            return await asyncio.gather(*tasks)
        except BaseException:
            # One failed: the others' answers are useless, stop waiting for them.
            for task in tasks:
                task.cancel()
            raise

    async def _run(self, operation: Operation, timeout_s: float | None = None) -> Any:
        response = None
        try:
            while True:
                try:
                    step = operation.send(response)
                except StopIteration as done:
                    return done.value
                response = await (
                    self._gather(step, timeout_s) if isinstance(step, list) else self._call(step, timeout_s)
                )
        finally:
            operation.close()


class TritonClient(_TritonClientBase):
    """Blocking client for Celery workers and management commands, on a pool of grpc channels.

    A request split into several batches sends them concurrently from a small thread pool:
    Triton runs them in parallel (dynamic batcher, several model instances) and a blocking
    gRPC call releases the GIL while it waits, so N batches cost about one round trip rather
    than N. Channels and threads are created lazily and again after a fork (Celery's prefork
    workers), since neither survives one.
    """

    def __init__(self, target: str, *, split_workers: int = 4, **options: Any) -> None:
        super().__init__(target, **options)
        self.split_workers = split_workers
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._channel_pool: list[grpc.Channel] = []
        self._stubs: list[pb_grpc.GRPCInferenceServiceStub] = []
        self._executor: ThreadPoolExecutor | None = None

    def __enter__(self) -> "TritonClient":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def server_live(self) -> bool:
        return self._run(self._server_live_op())

    def server_ready(self) -> bool:
        return self._run(self._server_ready_op())

    def model_ready(self, name: str, version: str = "") -> bool:
        return self._run(self._model_ready_op(name, version))

    def model_metadata(self, name: str, version: str = "") -> ModelSpec:
        """The model's inputs, outputs and max_batch_size; read from Triton once, then cached."""
        return self._run(self._model_spec_op(name, version))

    def model_statistics(self, name: str, version: str = "") -> ModelStatistics:
        return self._run(self._model_statistics_op(name, version))

    def repository_index(self, *, ready_only: bool = False) -> list[RepositoryModel]:
        """Every model of Triton's repositories with its versions' states (only READY ones with
        `ready_only`); a model never loaded has one entry with empty version and state."""
        return self._run(self._repository_index_op(ready_only))

    def model_load(self, name: str, *, config: str | None = None, timeout_s: float | None = None) -> None:
        """Load (or reload) `name` and return once Triton serves it; `config`: a JSON ModelConfig
        used instead of the model folder's. Raises TritonModelLoadFailed with Triton's reason.
        `timeout_s` defaults to model_load_timeout_s."""
        self._run(self._model_load_op(name, config), timeout_s or self.model_load_timeout_s)

    def model_unload(
        self, name: str, *, unload_dependents: bool = False, timeout_s: float | None = None
    ) -> None:
        """Unload `name` (and, for an ensemble with `unload_dependents`, the models it is made
        of). Returns once Triton stops taking requests for it (its instances may still finish
        theirs: the index says UNLOADING); Triton answers OK for a model it did not serve."""
        self._run(self._model_unload_op(name, unload_dependents), timeout_s or self.model_load_timeout_s)

    def infer(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        version: str = "",
        output_name: str | None = None,
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> np.ndarray:
        """One output (named, or the first FP32 one) for `inputs`, split into concurrent calls
        of at most max_batch_size rows and reassembled in order. `priority`: Triton's queue level
        (PRIORITY_INTERACTIVE, PRIORITY_BULK; 0 the model's default); `timeout_s` replaces the
        client's deadline for this call."""
        return self._run(self._infer_op(model, inputs, version, output_name, priority), timeout_s)

    def embed_tokens(
        self,
        model: str,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        *,
        token_type_ids: np.ndarray | None = None,
        version: str = "",
        output_name: str | None = None,
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> np.ndarray:
        """As AsyncTritonClient.embed_tokens."""
        return self._run(
            self._embed_op(
                model, version, output_name, priority, token_inputs, input_ids, attention_mask, token_type_ids
            ),
            timeout_s,
        )

    def embed_texts(
        self,
        model: str,
        texts: Sequence[str | bytes],
        *,
        version: str = "",
        output_name: str | None = None,
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> np.ndarray:
        """FP32 [batch, dimensions] embeddings from a model that takes text (a BYTES input);
        `priority` and `timeout_s` as for `infer`."""
        return self._run(self._embed_op(model, version, output_name, priority, text_inputs, texts), timeout_s)

    def close(self) -> None:
        replicas, self._replica_clients = list(self._replica_clients.values()), {}
        for replica in replicas:
            replica.close()
        with self._lock:
            channels, executor = self._channel_pool, self._executor
            self._channel_pool, self._stubs, self._executor, self._pid = [], [], None, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        for channel in channels:
            channel.close()

    def _ensure_process_resources(self) -> None:
        # Caller holds the lock. A new pid means first use, or first use after a fork.
        if self._pid != os.getpid():
            self._channel_pool = [
                grpc.insecure_channel(self.target, options=self._options) for _ in range(self.channels)
            ]
            self._stubs = [pb_grpc.GRPCInferenceServiceStub(channel) for channel in self._channel_pool]
            self._executor = None
            self._pid = os.getpid()

    def _stub(self) -> pb_grpc.GRPCInferenceServiceStub:
        with self._lock:
            self._ensure_process_resources()
            return self._stubs[next(self._round_robin) % len(self._stubs)]

    def _split_executor(self) -> ThreadPoolExecutor:
        with self._lock:
            self._ensure_process_resources()
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.split_workers, thread_name_prefix="triton-split")
            return self._executor

    def _call(self, call: Call, timeout_s: float | None = None) -> Any:
        budget_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget_s
        for attempt in itertools.count():
            method = getattr(self._stub(), call.method)
            timeout, cut_short = self._attempt_timeout(call, self._remaining(deadline, call, budget_s))
            try:
                return method(call.request, timeout=timeout)
            except grpc.RpcError as error:
                delay = self._retry_delay(error, call, attempt, deadline, cut_short=cut_short)
            time.sleep(delay)

    def _gather(self, calls: list[Call], timeout_s: float | None = None) -> list[Any]:
        if len(calls) == 1:
            return [self._call(calls[0], timeout_s)]
        futures = [self._split_executor().submit(self._call, call, timeout_s) for call in calls]
        try:
            return [future.result() for future in futures]
        except BaseException:
            for future in futures:
                future.cancel()
            raise

    def _run(self, operation: Operation, timeout_s: float | None = None) -> Any:
        response = None
        try:
            while True:
                try:
                    step = operation.send(response)
                except StopIteration as done:
                    return done.value
                response = (
                    self._gather(step, timeout_s) if isinstance(step, list) else self._call(step, timeout_s)
                )
        finally:
            operation.close()
