"""X-Request-Id: on every response, the client's when sane, in error bodies; through the real server
for a body refused before any view runs."""

from __future__ import annotations

import re

import httpx2
import pytest

MODEL = "all-MiniLM-L6-v2"
GENERATED = re.compile(r"[0-9a-f]{32}")
KEY_SHAPED = "emb_abcdefghij12_" + "s3cret" * 7


async def test_a_sane_client_id_is_kept_in_the_header_and_the_error_body(client):
    answer = await client.post(
        "/v1/embeddings", json={"input": "x"}, headers={"X-Request-Id": "req_01HZX-9.a:b"}
    )
    assert answer.status_code == 401
    assert answer.headers["x-request-id"] == "req_01HZX-9.a:b"
    assert answer.json()["error"]["request_id"] == "req_01HZX-9.a:b"


# The last two: an API key (or one inside an id) would be logged with every line of the request.
@pytest.mark.parametrize(
    "sent",
    ["", "has space", "x" * 129, "semi;colon", "new\tline", "é", KEY_SHAPED, f"req-{KEY_SHAPED}"],
)
async def test_an_insane_client_id_is_replaced(client, sent):
    answer = await client.get("/health", headers={"X-Request-Id": sent.encode()})
    assert GENERATED.fullmatch(answer.headers["x-request-id"]), answer.headers["x-request-id"]


async def test_each_request_gets_its_own_id_and_successes_carry_it_too(client, alpha):
    answers = [
        await client.post("/v1/embeddings", json={"model": MODEL, "input": "hello"}, headers=alpha.headers),
        await client.get("/v1/models", headers=alpha.headers),
        await client.get("/no/such/route"),
        await client.get("/admin/login/"),
    ]
    assert [answer.status_code for answer in answers] == [200, 200, 404, 200]
    ids = [answer.headers["x-request-id"] for answer in answers]
    assert all(GENERATED.fullmatch(request_id) for request_id in ids)
    assert len(set(ids)) == len(ids)
    assert answers[2].json()["error"]["request_id"] == ids[2]


def test_a_body_refused_at_the_edge_of_the_real_server_has_the_request_id(edge_server):
    answer = httpx2.post(
        f"{edge_server.base_url}/v1/embeddings",
        content=b"x" * (128 * 1024),
        headers={**edge_server.headers, "Content-Type": "application/json", "X-Request-Id": "edge-413"},
        timeout=30,
    )
    assert answer.status_code == 413
    assert answer.headers["x-request-id"] == "edge-413"
    assert answer.json()["error"]["request_id"] == "edge-413"
