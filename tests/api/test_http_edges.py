"""The HTTP edge of the API: hosts and nosniff on every route. Request bodies (size, framing,
timeouts) are in test_intake.py."""

from __future__ import annotations

import pytest

from tests.api.test_embeddings import assert_error

MODEL = "all-MiniLM-L6-v2"
JOB_ID = "job_000000000000000000000000"
# Every route, the methods it documents, and a request each documented method accepts.
ROUTES = {
    "/v1/embeddings": {"POST": {"model": MODEL, "input": "hello"}},
    "/v1/embedding": {"POST": [{"query": "hello"}]},
    "/api/v1/embed": {"POST": {"inputs": "hello"}},
    "/embed": {"POST": {"inputs": "hello"}},
    "/v1/models": {"GET": None},
    "/v1/models/minilm": {"GET": None},
    "/v1/usage": {"GET": None},
    "/v1/jobs": {"GET": None, "POST": {"model": MODEL, "input": ["hello"]}},
    f"/v1/jobs/{JOB_ID}": {"GET": None, "DELETE": None},
    f"/v1/jobs/{JOB_ID}/cancel": {"POST": None},
    f"/v1/jobs/{JOB_ID}/results": {"GET": None},
}


# --- Hosts and headers -----------------------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
async def test_a_host_outside_allowed_hosts_is_400_on_every_route(client, alpha, route):
    method, body = next(iter(ROUTES[route].items()))
    response = await client.request(
        method, route, json=body, headers={**alpha.headers, "Host": "attacker.example"}
    )
    assert_error(response, 400, code="invalid_host")
    assert response.headers["x-content-type-options"] == "nosniff"
    assert "x-ratelimit-limit-requests" not in response.headers


async def test_other_paths_keep_djangos_host_check(client, model):
    response = await client.get("/admin/login/", headers={"Host": "attacker.example"})
    assert response.status_code == 400
    assert (await client.get("/admin/login/")).status_code == 200


async def test_nosniff_on_answers_and_errors(client, alpha):
    answers = [
        await client.post("/v1/embeddings", json=ROUTES["/v1/embeddings"]["POST"], headers=alpha.headers),
        await client.post("/v1/embeddings", json={"input": "x"}, headers=alpha.headers),  # 422
        await client.post("/v1/embeddings", json={}),  # 401
        await client.get("/v1/nothing-here", headers=alpha.headers),  # 404
        await client.get(f"/v1/jobs/{JOB_ID}/results", headers=alpha.headers),  # 404
        await client.get("/health"),
    ]
    assert [answer.status_code for answer in answers] == [200, 422, 401, 404, 404, 200]
    for answer in answers:
        assert answer.headers["x-content-type-options"] == "nosniff", answer.request.url
