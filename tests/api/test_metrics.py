"""/metrics: our counters and histograms with the right labels, in one process and summed over workers."""

from __future__ import annotations

import asyncio

import httpx2
from prometheus_client.parser import text_string_to_metric_families

from embeddings.services.inference import reset_clients
from embeddings.triton.server import free_port

MODEL = "all-MiniLM-L6-v2"
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


async def test_in_flight_gauge_counts_calls_in_progress(client, alpha, settings):
    body = {"model": MODEL, "input": ["a sentence that takes a while to embed " * 20] * 32}
    pending = [
        asyncio.create_task(client.post("/v1/embeddings", json=body, headers=alpha.headers)) for _ in range(3)
    ]
    seen = 0.0
    while not all(task.done() for task in pending):
        seen = max(seen, value(await scrape(client), "embedsite_triton_in_flight"))
        await asyncio.sleep(0.005)
    assert [task.result().status_code for task in pending] == [200, 200, 200]
    assert seen >= 1
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
    """N requests spread over two uvicorn workers; /metrics from either worker reports N."""
    requests = 24
    ok = (
        "embedsite_requests_total",
        frozenset({"endpoint": "openai", "model": MODEL, "status": "200"}.items()),
    )

    def scrape_live() -> Samples:
        response = httpx2.get(f"{uvicorn_server.base_url}/metrics", timeout=10)
        assert response.status_code == 200
        return parse(response.text)

    async def send_all() -> list[int]:
        # A connection per request, all at once, so both workers accept some.
        async def one(i: int) -> int:
            async with httpx2.AsyncClient(base_url=uvicorn_server.base_url, timeout=30) as http:
                response = await http.post(
                    "/v1/embeddings",
                    json={"model": MODEL, "input": f"text {i}"},
                    headers=uvicorn_server.headers,
                )
                return response.status_code

        return await asyncio.gather(*(one(i) for i in range(requests)))

    before = scrape_live().get(ok, 0.0)
    assert asyncio.run(send_all()) == [200] * requests
    serving_pids = {
        path.stem.rsplit("_", 1)[1] for path in uvicorn_server.prometheus_dir.glob("counter_*.db")
    }
    assert len(serving_pids) == 2, f"expected both workers to count requests, got pids {serving_pids}"
    # Each scrape is a new connection: whichever worker answers sums every worker's files.
    for _ in range(4):
        samples = scrape_live()
        assert samples.get(ok, 0.0) - before == requests
        assert value(samples, "embedsite_inputs_total", endpoint="openai", model=MODEL) >= requests
        assert value(samples, "embedsite_triton_in_flight") == 0
