"""/metrics: our counters and histograms with the right labels, in one process and summed over workers."""

from __future__ import annotations

import asyncio
import time

import httpx2
from prometheus_client.parser import text_string_to_metric_families

from embeddings.services.inference.clients import reset_clients
from embeddings.tooling.triton_server import free_port
from tests.api.worker_metrics import answered_since, requests_answered_by_worker
from tests.processes import process_group_paused

MODEL = "all-MiniLM-L6-v2"
# A deadline against hanging only: far above what waiting for an event takes on a loaded machine.
HANG_DEADLINE_S = 30
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


async def scrape(client: httpx2.AsyncClient) -> Samples:
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return parse(response.text)


async def test_requests_inputs_tokens_and_timings_are_counted(client, alpha):
    before = await scrape(client)
    ok = await client.post(
        "/v1/embeddings", json={"model": MODEL, "input": ["hello", "world"]}, headers=alpha.headers
    )
    too_wide = await client.post(
        "/v1/embeddings", json={"model": MODEL, "input": "x", "dimensions": 4096}, headers=alpha.headers
    )
    malformed = await client.post("/v1/embeddings", json={"model": MODEL, "input": 3}, headers=alpha.headers)
    bad_key = await client.post(
        "/v1/embeddings", json={"model": MODEL, "input": "x"}, headers={"Authorization": "Bearer emb_x_y"}
    )
    tei = await client.post("/api/v1/embed", json={"inputs": "hello there"}, headers=alpha.headers)
    assert [r.status_code for r in (ok, too_wide, malformed, bad_key, tei)] == [200, 422, 422, 401, 200]
    after = await scrape(client)

    requests = "embedsite_requests_total"
    assert delta(before, after, requests, endpoint="openai", model=MODEL, status="200") == 1
    # A model is named once the request resolved one; before that (bad body, bad key) it is empty.
    assert delta(before, after, requests, endpoint="openai", model=MODEL, status="422") == 1
    assert delta(before, after, requests, endpoint="openai", model="", status="422") == 1
    assert delta(before, after, requests, endpoint="openai", model="", status="401") == 1
    assert delta(before, after, requests, endpoint="tei", model=MODEL, status="200") == 1

    assert delta(before, after, "embedsite_inputs_total", endpoint="openai", model=MODEL) == 2
    assert (
        delta(before, after, "embedsite_tokens_total", endpoint="openai", model=MODEL)
        == (ok.json()["usage"]["total_tokens"])
    )
    assert delta(before, after, "embedsite_inputs_total", endpoint="tei", model=MODEL) == 1
    assert (
        delta(before, after, "embedsite_tokens_total", endpoint="tei", model=MODEL)
        == (tei.json()["usage"]["total_tokens"])
    )

    # The two successful requests were tokenised and sent to Triton; every response was rendered.
    assert delta(before, after, "embedsite_tokenization_seconds_count", model="minilm") == 2
    assert delta(before, after, "embedsite_triton_call_seconds_count", model="minilm") == 2
    assert delta(before, after, "embedsite_triton_call_seconds_sum", model="minilm") > 0
    assert delta(before, after, "embedsite_serialization_seconds_count", endpoint="openai") == 4
    assert delta(before, after, "embedsite_serialization_seconds_count", endpoint="tei") == 1
    assert value(after, "embedsite_triton_in_flight") == 0


async def test_in_flight_gauge_counts_calls_in_progress(client, alpha, triton_server):
    """Triton paused (SIGSTOP) while three requests call it: the gauge shows the three calls in flight
    for as long as they wait, and none once Triton answered them."""
    await client.post("/v1/embeddings", json={"model": MODEL, "input": "warm"}, headers=alpha.headers)
    body = {"model": MODEL, "input": ["a sentence to embed"] * 4}
    with process_group_paused(triton_server.process):
        pending = [
            asyncio.create_task(client.post("/v1/embeddings", json=body, headers=alpha.headers))
            for _ in range(3)
        ]
        deadline = time.monotonic() + HANG_DEADLINE_S
        while (in_flight := value(await scrape(client), "embedsite_triton_in_flight")) < 3:
            assert time.monotonic() < deadline, f"{in_flight} calls in flight, not 3"
            await asyncio.sleep(0.01)
        assert not any(task.done() for task in pending)
    responses = await asyncio.gather(*pending)
    assert [response.status_code for response in responses] == [200, 200, 200]
    assert value(await scrape(client), "embedsite_triton_in_flight") == 0


async def test_triton_errors_are_counted_by_kind(client, alpha, settings):
    await client.post("/v1/embeddings", json={"model": MODEL, "input": "warm"}, headers=alpha.headers)
    before = await scrape(client)
    settings.TRITON_GRPC_TARGET = f"127.0.0.1:{free_port()}"
    settings.TRITON_TIMEOUT_S = 2.0
    reset_clients()
    response = await client.post("/v1/embeddings", json={"model": MODEL, "input": "x"}, headers=alpha.headers)
    assert response.status_code == 503
    after = await scrape(client)
    assert (
        delta(before, after, "embedsite_triton_errors_total", model="minilm", kind="TritonUnavailable") == 1
    )
    assert delta(before, after, "embedsite_requests_total", endpoint="openai", model=MODEL, status="503") == 1
    assert value(after, "embedsite_triton_in_flight") == 0


def test_metrics_are_summed_over_worker_processes(uvicorn_server):
    """Requests answered by both uvicorn workers; /metrics from either worker reports them all."""
    wave, max_waves = 24, 20
    labels = {"endpoint": "openai", "model": MODEL}

    def scrape_live() -> Samples:
        response = httpx2.get(f"{uvicorn_server.base_url}/metrics", timeout=10)
        assert response.status_code == 200
        return parse(response.text)

    async def send_wave() -> list[int]:
        # A connection per request, all at once, so that either worker may accept each.
        async def one(i: int) -> int:
            async with httpx2.AsyncClient(base_url=uvicorn_server.base_url, timeout=30) as http:
                response = await http.post(
                    "/v1/embeddings",
                    json={"model": MODEL, "input": f"text {i}"},
                    headers=uvicorn_server.headers,
                )
                return response.status_code

        return await asyncio.gather(*(one(i) for i in range(wave)))

    before = scrape_live()
    answered_before = requests_answered_by_worker(uvicorn_server.prometheus_dir)
    # Each worker counts what it answers in a file of its own. The kernel gives each connection to
    # whichever worker accepts first, and one idle worker can take a whole small wave: waves go on
    # until both answered some (a worker that never answers fails the test after max_waves).
    sent = 0
    for _ in range(max_waves):
        assert asyncio.run(send_wave()) == [200] * wave
        sent += wave
        answered = answered_since(answered_before, requests_answered_by_worker(uvicorn_server.prometheus_dir))
        assert sum(answered.values()) == sent, answered
        if len(answered) == 2:
            break
    assert len(answered) == 2, f"one worker answered all {sent} requests: {answered}"
    # Each scrape is a new connection: whichever worker answers sums every worker's files.
    for _ in range(4):
        samples = scrape_live()
        assert delta(before, samples, "embedsite_requests_total", **labels, status="200") == sent
        assert delta(before, samples, "embedsite_inputs_total", **labels) == sent
        assert value(samples, "embedsite_triton_in_flight") == 0
