"""The HTTP edge of the API: every method on every route, hosts and nosniff; in process, and the host
check and OPTIONS through a real uvicorn on a socket. Request bodies (size, framing, timeouts) are in
test_intake.py."""

from __future__ import annotations

import json

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
UNDOCUMENTED_METHODS = ["PUT", "PATCH", "DELETE", "POST", "TRACE", "CONNECT", "PROPFIND", "FOO"]


def allowed(route: str) -> set[str]:
    methods = set(ROUTES[route]) | {"OPTIONS"}
    return methods | {"HEAD"} if "GET" in methods else methods


def allow_header(response) -> set[str]:
    return {method.strip() for method in response.headers["allow"].split(",")}


# --- Methods --------------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
async def test_options_answers_the_methods_without_a_key(client, model, route):
    response = await client.options(route)
    assert response.status_code == 204, response.text
    assert allow_header(response) == allowed(route)
    assert response.content == b""
    assert response.headers["x-content-type-options"] == "nosniff"


@pytest.mark.parametrize("route", ROUTES)
async def test_undocumented_methods_are_405_with_allow(client, alpha, route):
    for method in UNDOCUMENTED_METHODS:
        if method in ROUTES[route]:
            continue
        response = await client.request(method, route, headers=alpha.headers)
        assert_error(response, 405, code="method_not_allowed")
        assert allow_header(response) == allowed(route), method
        assert response.headers["x-content-type-options"] == "nosniff"


@pytest.mark.parametrize("route", [route for route, methods in ROUTES.items() if "GET" in methods])
async def test_head_is_get_without_a_body(client, alpha, route):
    get = await client.get(route, headers=alpha.headers)
    head = await client.head(route, headers=alpha.headers)
    assert head.status_code == get.status_code
    assert head.status_code in (200, 404), head.status_code  # 404: the made-up job id
    assert head.headers["content-type"] == get.headers["content-type"]


async def test_undocumented_methods_need_a_key_first(client, model):
    assert_error(await client.request("TRACE", "/v1/embeddings"), 401)


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


# --- Through a real uvicorn --------------------------------------------------------------------------


def test_a_wrong_host_is_400_through_uvicorn(raw):
    raw.head("GET", "/v1/models", {}, host="attacker.example")
    status, headers, body = raw.answer()
    assert status == 400, body
    assert json.loads(body)["error"]["code"] == "invalid_host"
    assert headers["x-content-type-options"] == "nosniff"


def test_options_and_trace_through_uvicorn(raw):
    raw.head("OPTIONS", "/v1/embeddings", {})
    status, headers, _ = raw.answer()
    assert status == 204 and {m.strip() for m in headers["allow"].split(",")} == {"POST", "OPTIONS"}
    raw.head("TRACE", "/v1/models", {})
    status, headers, body = raw.answer()
    assert status == 405, body
    assert json.loads(body)["error"]["code"] == "method_not_allowed"
