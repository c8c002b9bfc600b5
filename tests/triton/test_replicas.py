"""Several Triton replicas behind one client: gRPC's round_robin spreads the calls, a replica that
answers nothing (its process stopped: the kernel still accepts, nothing replies) costs a call one
attempt and not the call, and it takes calls again once it answers. Two real Tritons on loopback."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from embeddings.tooling.triton_server import TritonServer, free_port
from embeddings.triton.client import AsyncTritonClient, TritonClient
from tests.processes import process_group_paused
from tests.triton.statistics import settled

MODEL = "minilm"
ROWS = 4


@pytest.fixture
def replicas(triton_server: TritonServer, second_triton_server: TritonServer) -> list[TritonServer]:
    return [triton_server, second_triton_server]


def listed(servers: list[TritonServer]) -> str:
    return "ipv4:" + ",".join(server.grpc_target for server in servers)


def tokens() -> tuple[np.ndarray, np.ndarray]:
    ids = np.full((ROWS, 8), 1000, dtype=np.int64)
    ids[:, 0], ids[:, -1] = 101, 102
    return ids, np.ones_like(ids)


def executions(servers: list[TritonServer]) -> list[int]:
    """Each replica's model executions so far, asked of that replica alone."""
    counts = []
    for server in servers:
        with TritonClient(server.grpc_target, retries=0) as client:
            counts.append(client.model_statistics(MODEL).execution_count)
    return counts


async def test_calls_are_spread_over_every_replica(replicas):
    before = executions(replicas)
    async with AsyncTritonClient(listed(replicas), channels=1) as client:
        for _ in range(20):  # one at a time: Triton cannot merge them, each is one execution
            vectors = await client.embed_tokens(MODEL, *tokens())
            assert vectors.shape == (ROWS, 384)
    now = settled(lambda: executions(replicas), lambda counts: sum(counts) - sum(before) >= 20)
    spread = [after - earlier for after, earlier in zip(now, before, strict=True)]
    assert sum(spread) == 20 and min(spread) >= 5, spread


async def test_a_silent_replica_costs_a_call_one_attempt_then_takes_calls_again(replicas):
    silent = replicas[1]
    async with AsyncTritonClient(listed(replicas), channels=1, timeout_s=60, attempt_timeout_s=1.0) as client:
        await client.embed_tokens(MODEL, *tokens())  # both connections open
        with process_group_paused(silent.process):
            results = await asyncio.gather(*(client.embed_tokens(MODEL, *tokens()) for _ in range(16)))
            assert all(vectors.shape == (ROWS, 384) for vectors in results)
            before = executions(replicas[:1])
        # Answering again, it takes calls once outlier detection lets it back (5 s after it was
        # taken out; the calls held while it was stopped may finish there too, answered already).
        silent_before = executions(replicas)[1]
        resumed = time.monotonic()
        while executions(replicas)[1] <= silent_before + 2:
            assert time.monotonic() - resumed < 60, "the replica never took calls again"
            await client.embed_tokens(MODEL, *tokens())
    assert executions(replicas[:1])[0] > before[0]


def test_the_blocking_client_fails_over_too(replicas):
    silent = replicas[0]
    with TritonClient(listed(replicas), channels=1, timeout_s=60, attempt_timeout_s=1.0) as client:
        client.embed_tokens(MODEL, *tokens())
        with process_group_paused(silent.process):
            for _ in range(6):
                assert client.embed_tokens(MODEL, *tokens()).shape == (ROWS, 384)


async def test_a_replica_refusing_connections_is_skipped(triton_server):
    # A port nothing listens on: connections are refused, round_robin leaves it out.
    target = f"ipv4:{triton_server.grpc_target},127.0.0.1:{free_port()}"
    async with AsyncTritonClient(target, channels=1, timeout_s=30) as client:
        for _ in range(6):
            assert (await client.embed_tokens(MODEL, *tokens())).shape == (ROWS, 384)
