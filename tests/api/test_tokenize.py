"""TEI's /tokenize and /decode through the real server as `make run` starts it, checked against the
Hugging Face tokenizer of the bundled MiniLM; and in process, what metering, access and the catalog
decide."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx2
import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from prometheus_client import REGISTRY
from tokenizers import Tokenizer

from embeddings.api.authentication import caller_cache
from embeddings.api.tokenize import EXAMPLE_TEXT, EXAMPLE_TOKENS
from embeddings.models import EmbeddingModel
from embeddings.redis.connections import redis_sync
from embeddings.services.accounts.tenants import quota_limits_update
from embeddings.services.quotas.usage import LIVE_USAGE_KEY, parse_usage_field
from tests.api.conftest import LiveServer
from tests.conftest import TenantWithKey, tenant_with_key

MODEL = "all-MiniLM-L6-v2"
TEXTS = [
    "Hello, world! Tokenizers split unaffable words.",
    "Héllo wörld: naïve café, 日本語のテキスト, emoji 🚀 and Ελληνικά.",
    "a [SEP] inside the text is not added by the tokenizer",
]


@pytest.fixture(scope="module")
def hf_tokenizer() -> Tokenizer:
    """MiniLM's tokenizer as Hugging Face's library loads it, untruncated (the reference)."""
    tokenizer = Tokenizer.from_file(
        str(Path(settings.TRITON_MODEL_REPOSITORY) / "minilm" / "1" / "tokenizer.json")
    )
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def post(server: LiveServer, path: str, body: object, **headers) -> httpx2.Response:
    return httpx2.post(
        f"{server.base_url}{path}", json=body, headers={**server.headers, **headers}, timeout=60
    )


def byte_offset(text: str, character: int) -> int:
    return len(text[:character].encode("utf-8"))


def expected_tokens(hf: Tokenizer, text: str, *, add_special_tokens: bool = True) -> list[dict]:
    """TEI's answer for `text`, from the HF tokenizer: its ids, the added special tokens as
    themselves without offsets, every other token as the text it covers with UTF-8 byte offsets."""
    encoding = hf.encode(text, add_special_tokens=add_special_tokens)
    tokens = []
    for token_id, token, (start, stop), special in zip(
        encoding.ids, encoding.tokens, encoding.offsets, encoding.special_tokens_mask, strict=True
    ):
        if special:
            tokens.append({"id": token_id, "text": token, "special": True, "start": None, "stop": None})
        else:
            tokens.append(
                {
                    "id": token_id,
                    "text": text[start:stop],
                    "special": False,
                    "start": byte_offset(text, start),
                    "stop": byte_offset(text, stop),
                }
            )
    return tokens


# --- Through the real server -------------------------------------------------------------------


def test_tokens_are_the_hf_tokenizers_with_tei_offsets(uvicorn_server, hf_tokenizer):
    response = post(uvicorn_server, "/tokenize", {"inputs": TEXTS})
    assert response.status_code == 200, response.text
    answered = response.json()
    assert answered == [expected_tokens(hf_tokenizer, text) for text in TEXTS]
    for text, tokens in zip(TEXTS, answered, strict=True):
        assert [token["id"] for token in tokens] == hf_tokenizer.encode(text).ids
        # Byte offsets: the text of every token the input holds is those bytes of it.
        for token in tokens:
            if not token["special"]:
                assert text.encode()[token["start"] : token["stop"]].decode() == token["text"]
        assert (tokens[0]["text"], tokens[-1]["text"]) == ("[CLS]", "[SEP]")
        assert [token["special"] for token in tokens].count(True) == 2
    assert response.headers["x-request-id"]
    assert "tokenize;dur=" in response.headers["server-timing"]


def test_non_ascii_offsets_count_utf8_bytes_as_tei_does(uvicorn_server):
    tokens = post(uvicorn_server, "/tokenize", {"inputs": "né 日本 🚀"}).json()[0]
    assert [(t["text"], t["start"], t["stop"]) for t in tokens[1:-1]] == [
        ("né", 0, 3),  # é is two bytes
        ("日", 4, 7),
        ("本", 7, 10),
        ("🚀", 11, 15),  # [UNK], which still covers the emoji's four bytes
    ]
    assert tokens[4]["id"] == 100 and not tokens[4]["special"]


def test_one_string_without_special_tokens(uvicorn_server, hf_tokenizer):
    text = TEXTS[1]
    response = post(uvicorn_server, "/tokenize", {"inputs": text, "add_special_tokens": False})
    assert response.status_code == 200, response.text
    assert response.json() == [expected_tokens(hf_tokenizer, text, add_special_tokens=False)]
    assert not any(token["special"] for token in response.json()[0])
    # A special token's text in the input is the input's, not one the tokenizer added (as in TEI).
    inside = post(uvicorn_server, "/tokenize", {"inputs": TEXTS[2]}).json()[0]
    assert inside[2] == {"id": 102, "text": "[SEP]", "special": False, "start": 2, "stop": 7}


def test_the_documented_example_is_the_answer(uvicorn_server):
    assert post(uvicorn_server, "/tokenize", {"inputs": EXAMPLE_TEXT}).json() == [EXAMPLE_TOKENS]


def test_decode_round_trip_and_special_tokens(uvicorn_server, hf_tokenizer):
    ids = [hf_tokenizer.encode(text).ids for text in TEXTS]
    response = post(uvicorn_server, "/decode", {"ids": ids})
    assert response.status_code == 200, response.text
    assert response.json() == hf_tokenizer.decode_batch(ids, skip_special_tokens=True)
    # MiniLM's tokenizer lower-cases and strips accents: a lower-case ASCII text comes back whole.
    plain = "hello, world! tokenizers split unaffable words."
    tokenized = post(uvicorn_server, "/tokenize", {"inputs": plain}).json()[0]
    round_trip = post(uvicorn_server, "/decode", {"ids": [token["id"] for token in tokenized]})
    assert round_trip.json() == [plain]
    kept = post(uvicorn_server, "/decode", {"ids": ids[0], "skip_special_tokens": False}).json()
    assert kept == [hf_tokenizer.decode(ids[0], skip_special_tokens=False)]
    assert kept[0].startswith("[CLS] hello") and kept[0].endswith("[SEP]")


LONG_WORDS = "word " * 12_801  # 64,005 characters: over 250 per token of MiniLM's 256


@pytest.mark.parametrize(
    ("path", "body", "status", "code", "param"),
    [
        ("/tokenize", {}, 422, None, "inputs"),
        ("/tokenize", {"inputs": []}, 422, None, "inputs"),
        ("/tokenize", {"inputs": ""}, 422, None, "inputs"),
        ("/tokenize", {"inputs": ["a", ""]}, 422, None, "inputs"),
        ("/tokenize", {"inputs": 7}, 422, None, "inputs"),
        ("/tokenize", {"inputs": ["a", 7]}, 422, None, "inputs"),
        ("/tokenize", {"inputs": [["a"]]}, 422, None, "inputs"),
        ("/tokenize", {"inputs": "a", "add_special_tokens": "yes"}, 422, None, "add_special_tokens"),
        ("/tokenize", {"inputs": "a", "prompt_name": "nope"}, 422, "unsupported_by_model", "prompt_name"),
        ("/tokenize", {"inputs": "a", "prompt_name": 3}, 422, None, "prompt_name"),
        ("/tokenize", {"inputs": "a", "model": "no-such-model"}, 404, "model_not_found", "model"),
        ("/tokenize", {"inputs": ["a"] * 2049}, 413, "payload_too_large", "inputs"),
        ("/tokenize", {"inputs": ["short", LONG_WORDS]}, 413, "payload_too_large", "inputs"),
        # Four texts of 10,002 tokens (50,000 characters each): 40,008 in all, over 32,768.
        ("/tokenize", {"inputs": ["word " * 10_000] * 4}, 413, "payload_too_large", "inputs"),
        ("/tokenize", ["a"], 422, None, None),
        ("/decode", {}, 422, None, "ids"),
        ("/decode", {"ids": []}, 422, None, "ids"),
        ("/decode", {"ids": [[101], []]}, 422, None, "ids"),
        ("/decode", {"ids": [101, [102]]}, 422, None, "ids"),
        ("/decode", {"ids": "101"}, 422, None, "ids"),
        ("/decode", {"ids": [1.5]}, 422, None, "ids"),
        ("/decode", {"ids": [True]}, 422, None, "ids"),
        ("/decode", {"ids": [-1]}, 422, None, "ids"),
        ("/decode", {"ids": [2**31]}, 422, None, "ids"),
        ("/decode", {"ids": [[101], [7592, 30522]]}, 422, "unsupported_by_model", "ids"),
        ("/decode", {"ids": [101], "skip_special_tokens": 1}, 422, None, "skip_special_tokens"),
        ("/decode", {"ids": [101], "model": "no-such-model"}, 404, "model_not_found", "model"),
        ("/decode", {"ids": [[101]] * 2049}, 413, "payload_too_large", "ids"),
        ("/decode", {"ids": [1000] * 32_769}, 413, "payload_too_large", "ids"),
    ],
)
def test_bad_requests_are_clear_4xx(uvicorn_server, path, body, status, code, param):
    response = post(uvicorn_server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["request_id"] == response.headers["x-request-id"]
    assert set(error) == {"message", "type", "param", "code", "request_id"}
    if code is not None:
        assert error["code"] == code
    assert error["param"] == param


def test_limits_name_the_input_and_the_bound(uvicorn_server):
    long_input = post(uvicorn_server, "/tokenize", {"inputs": ["short", LONG_WORDS]}).json()["error"]
    assert (
        long_input["message"].startswith("Input 1 has 64005 characters") and "64000" in long_input["message"]
    )
    too_many = post(uvicorn_server, "/tokenize", {"inputs": ["word " * 10_000] * 4}).json()["error"]
    assert "more than 32768 tokens in all (inputs 0 to 3 have 40008)" in too_many["message"]
    outside = post(uvicorn_server, "/decode", {"ids": [[101], [7592, 30522]]}).json()["error"]
    assert outside["message"] == (
        "Sequence 1 has the token id 30522, outside this model's vocabulary [0, 30522)"
    )


def test_malformed_json_and_a_body_over_the_limit(uvicorn_server):
    malformed = httpx2.post(
        f"{uvicorn_server.base_url}/tokenize",
        content=b'{"inputs": ',
        headers={**uvicorn_server.headers, "Content-Type": "application/json"},
        timeout=30,
    )
    assert malformed.status_code == 400, malformed.text
    # A declared body over MAX_REQUEST_BODY_BYTES is refused before a byte of it is sent.
    host, port = uvicorn_server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        head = [
            "POST /decode HTTP/1.1",
            f"Host: {host}",
            f"Authorization: {uvicorn_server.headers['Authorization']}",
            "Content-Type: application/json",
            f"Content-Length: {settings.MAX_REQUEST_BODY_BYTES + 1}",
        ]
        connection.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        answer = connection.recv(65536).decode()
    assert answer.startswith("HTTP/1.1 413"), answer


@pytest.mark.parametrize("path", ["/tokenize", "/decode"])
def test_a_key_is_needed(uvicorn_server, path):
    response = httpx2.post(f"{uvicorn_server.base_url}{path}", json={"inputs": "a", "ids": [101]}, timeout=30)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "missing_api_key"


# --- In process: access, metering, the catalog ---------------------------------------------------


def usage_fields(tenant_id: int, endpoint: str) -> dict[tuple[str, str, str], int]:
    """The live usage counters of one tenant and endpoint: (key id, model, metric) -> value."""
    counters = {}
    for field, value in redis_sync().hgetall(LIVE_USAGE_KEY).items():
        bucket, metric = parse_usage_field(field.decode())
        if bucket.tenant_id == tenant_id and bucket.endpoint == endpoint:
            key = "" if bucket.api_key_id is None else str(bucket.api_key_id)
            counters[(key, bucket.model, metric)] = int(value)
    return counters


async def test_a_key_without_access_to_the_model_is_refused(client, alpha):
    gamma: TenantWithKey = await sync_to_async(tenant_with_key)("Gamma", allow_all_models=False)
    for path, body in [("/tokenize", {"inputs": "hello"}), ("/decode", {"ids": [7592]})]:
        response = await client.post(path, json=body, headers=gamma.headers)
        assert response.status_code == 403, response.text
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("model_not_allowed", "model")
        allowed = await client.post(path, json=body, headers=alpha.headers)
        assert allowed.status_code == 200, allowed.text
    assert usage_fields(gamma.tenant.pk, "tei_tokenize") == {}


async def test_metered_as_requests_with_usage_per_model_and_key(client, alpha):
    # Two requests a minute, and a token rate no embedding request could pass: tokenising reads no
    # model, so it is held to the request rate alone.
    await sync_to_async(quota_limits_update)(
        owner=alpha.tenant, limits={"requests_per_minute": 2, "request_burst": 2, "tokens_per_minute": 1}
    )
    caller_cache.clear()
    responses = [
        await client.post("/tokenize", json={"inputs": ["hello", "world"]}, headers=alpha.headers),
        await client.post("/decode", json={"ids": [[7592], [2088], [999]]}, headers=alpha.headers),
        await client.post("/tokenize", json={"inputs": "again"}, headers=alpha.headers),
    ]
    assert [r.status_code for r in responses] == [200, 200, 429], responses[-1].text
    assert [r.headers["x-ratelimit-remaining-requests"] for r in responses] == ["1", "0", "0"]
    refused = responses[2].json()["error"]
    assert (refused["code"], refused["type"]) == ("rate_limit_exceeded", "requests")
    assert "retry-after" in responses[2].headers
    embedding = await client.post(
        "/v1/embeddings", json={"model": MODEL, "input": "a"}, headers=alpha.headers
    )
    assert embedding.status_code == 429  # over the request rate as well as the token rate
    key = str(alpha.api_key.pk)
    tokenize = usage_fields(alpha.tenant.pk, "tei_tokenize")
    assert tokenize.pop((key, MODEL, "latency_ms_total"), 0) >= 0
    # Per model and key; the refused request's inputs are not counted, and no tokens at all.
    assert tokenize == {
        (key, MODEL, "requests"): 2,
        (key, MODEL, "succeeded"): 1,
        (key, MODEL, "rejected"): 1,
        (key, MODEL, "inputs"): 2,
    }
    decode = usage_fields(alpha.tenant.pk, "tei_decode")
    assert (decode[(key, MODEL, "requests")], decode[(key, MODEL, "inputs")]) == (1, 3)
    assert not [field for field in decode if field[2] == "tokens"]


async def test_requests_are_counted_by_endpoint_and_model(client, alpha):
    def answered(endpoint: str, status: str) -> float:
        labels = {"endpoint": endpoint, "model": MODEL, "status": status}
        return REGISTRY.get_sample_value("embedsite_requests_total", labels) or 0.0

    before = answered("tei_tokenize", "200"), answered("tei_decode", "422")
    await client.post("/tokenize", json={"inputs": "hello"}, headers=alpha.headers)
    await client.post("/decode", json={"ids": [30522]}, headers=alpha.headers)
    assert (answered("tei_tokenize", "200"), answered("tei_decode", "422")) == (before[0] + 1, before[1] + 1)


async def test_the_models_prompts_are_tokenised_with_the_text(client, alpha, model, settings):
    settings.MODEL_CACHE_SECONDS = 0
    model.prompts = {"query": "query: ", "passage": "passage: "}
    model.default_prompt_name = "passage"
    await model.asave(update_fields=["prompts", "default_prompt_name"])

    async def tokens(**body) -> list[tuple[str, int | None]]:
        response = await client.post("/tokenize", json={"inputs": "héllo", **body}, headers=alpha.headers)
        assert response.status_code == 200, response.text
        return [(token["text"], token["start"]) for token in response.json()[0]]

    # Offsets count from the prompt's start, as TEI's do.
    assert await tokens(prompt_name="query") == [
        ("[CLS]", None), ("query", 0), (":", 5), ("héllo", 7), ("[SEP]", None)
    ]  # fmt: skip
    assert await tokens() == [("[CLS]", None), ("passage", 0), (":", 7), ("héllo", 9), ("[SEP]", None)]


@pytest.fixture
def reranker(api_setup) -> EmbeddingModel:
    """A cross-encoder in the catalog whose export is not in this model repository."""
    return EmbeddingModel.objects.create(
        name="a-reranker", task="rerank", triton_model="a_reranker", dimensions=1, max_tokens=512
    )


async def test_a_model_whose_export_is_missing_is_not_served(client, alpha, reranker, settings):
    settings.MODEL_CACHE_SECONDS = 0
    for path, body in [("/tokenize", {"inputs": "a"}), ("/decode", {"ids": [101]})]:
        response = await client.post(path, json={**body, "model": "a-reranker"}, headers=alpha.headers)
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("model_not_loaded", "model")
        assert "a-reranker" in error["message"] and response.headers["retry-after"]
