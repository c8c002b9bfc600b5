"""The HTTP edge of the API: every method on every route, hosts, nosniff, charsets, multipart parts
and strict JSON types; in process, and the host check and OPTIONS through a real uvicorn on a socket.
Request bodies (size, framing, timeouts) are in test_intake.py."""

from __future__ import annotations

import json

import httpx2
import pytest

from tests.api.raw_http import upload_parts
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


# --- Charsets and UTF-8 ----------------------------------------------------------------------------


@pytest.mark.parametrize("charset", ["latin-1", "utf-16", "ISO-8859-1", "cp1252", "nonsense"])
async def test_json_in_another_charset_than_utf8_is_415(client, alpha, charset):
    response = await client.post(
        "/v1/embeddings",
        content=json.dumps({"model": MODEL, "input": "café"}).encode(),
        headers={**alpha.headers, "Content-Type": f"application/json; charset={charset}"},
    )
    error = assert_error(response, 415, code="unsupported_media_type")
    assert "UTF-8" in error["message"]


@pytest.mark.parametrize("charset", ["utf-8", "UTF-8", '"utf-8"', "us-ascii"])
async def test_json_declared_utf8_is_read(client, alpha, charset):
    response = await client.post(
        "/v1/embeddings",
        content=json.dumps({"model": MODEL, "input": "café"}, ensure_ascii=False).encode(),
        headers={**alpha.headers, "Content-Type": f"application/json; charset={charset}"},
    )
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "body",
    [b'{"model": "all-MiniLM-L6-v2", "input": "caf\xe9"}', b'{"model": "\xff\xfe", "input": "x"}', b"\xff"],
)
async def test_a_body_that_is_not_utf8_is_400(client, alpha, body):
    response = await client.post(
        "/v1/embeddings", content=body, headers={**alpha.headers, "Content-Type": "application/json"}
    )
    assert_error(response, 400)


FILE_PART = ("file", "texts.txt", b"first line\nsecond line\n", "text/plain")
MODEL_PART = ("model", None, MODEL.encode(), None)


async def post_upload(client, tenant, *parts, content_type_suffix: str = ""):
    body, content_type = upload_parts(*parts)
    return await client.post(
        "/v1/jobs",
        content=body,
        headers={**tenant.headers, "Content-Type": content_type + content_type_suffix},
    )


@pytest.mark.parametrize("charset", ["latin-1", "utf-16"])
async def test_an_uploaded_file_in_another_charset_is_415(client, alpha, charset):
    name, filename, content, _ = FILE_PART
    response = await post_upload(
        client,
        alpha,
        (name, filename, content.decode().encode(charset), f"text/plain; charset={charset}"),
        MODEL_PART,
    )
    assert_error(response, 415, code="unsupported_media_type", param="file")


async def test_a_multipart_form_in_another_charset_is_415(client, alpha):
    response = await post_upload(
        client, alpha, FILE_PART, MODEL_PART, content_type_suffix="; charset=latin-1"
    )
    assert_error(response, 415, code="unsupported_media_type")


async def test_an_uploaded_file_declared_utf8_is_taken(client, alpha):
    name, filename, content, _ = FILE_PART
    response = await post_upload(
        client, alpha, (name, filename, content, "text/plain; charset=utf-8"), MODEL_PART
    )
    assert response.status_code == 202, response.text
    assert response.json()["counts"]["total"] == 2


# --- Multipart parts -------------------------------------------------------------------------------


async def test_two_file_parts_are_refused_naming_the_field(client, alpha):
    second = ("file", "more.txt", b"third line\n", "text/plain")
    error = assert_error(await post_upload(client, alpha, FILE_PART, second, MODEL_PART), 422, param="file")
    assert "2 times" in error["message"]


@pytest.mark.parametrize("field", ["model", "dimensions", "metadata", "normalize"])
async def test_a_repeated_form_field_is_refused_naming_it(client, alpha, field):
    value = {"model": MODEL, "dimensions": "8", "metadata": "{}", "normalize": "true"}[field].encode()
    parts = [FILE_PART, (field, None, value, None), (field, None, value, None)]
    if field != "model":
        parts.append(MODEL_PART)
    assert_error(await post_upload(client, alpha, *parts), 422, param=field)


async def test_form_fields_are_text(client, alpha, model):
    response = await post_upload(
        client,
        alpha,
        FILE_PART,
        MODEL_PART,
        ("dimensions", None, b"null", None),
        ("normalize", None, b"false", None),
        ("encoding_format", None, b"base64", None),
    )
    assert response.status_code == 202, response.text
    job = response.json()
    assert job["dimensions"] == model.dimensions and job["encoding_format"] == "base64"
    response = await post_upload(client, alpha, FILE_PART, MODEL_PART, ("dimensions", None, b"16", None))
    assert response.status_code == 202, response.text
    assert response.json()["dimensions"] == 16


async def test_a_null_form_field_is_null(client, alpha):
    """A form cannot send JSON null: "null" (as Schemathesis writes it) or "" for a nullable field."""
    for value in (b"null", b""):
        response = await post_upload(
            client,
            alpha,
            FILE_PART,
            MODEL_PART,
            ("result_dtype", None, value, None),
            ("dimensions", None, value, None),
        )
        assert response.status_code == 202, response.text
        assert response.json()["result_dtype"] == "float32"


async def test_a_repeated_unknown_form_field_is_ignored_as_any_unknown_field(client, alpha):
    extra = ("x-extra", None, b"1", None)
    response = await post_upload(client, alpha, FILE_PART, MODEL_PART, extra, extra, extra)
    assert response.status_code == 202, response.text


def test_forms_and_strings_as_the_schema_writes_them_through_uvicorn(edge_server):
    body, content_type = upload_parts(FILE_PART, MODEL_PART, ("result_dtype", None, b"null", None))
    with httpx2.Client(base_url=edge_server.base_url, headers=edge_server.headers, timeout=30) as http:
        response = http.post("/v1/jobs", content=body, headers={"Content-Type": content_type})
        assert response.status_code == 202, response.text
        for model in ("mini\x00lm", f" {MODEL}"):
            response = http.post("/v1/embeddings", json={"model": model, "input": "x"})
            assert_error(response, 404, "model_not_found", "model")
        response = http.get("/v1/usage", params={"start": "2026-06-10", "end": "2026-06-09"})
        assert_error(response, 422, "invalid_range", "end")


# --- Strict JSON types -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/embeddings", {"model": MODEL, "input": "x", "user": 0}, "user"),
        ("/v1/embeddings", {"model": 7, "input": "x"}, "model"),
        ("/v1/embeddings", {"model": MODEL, "input": "x", "dimensions": "64"}, "dimensions"),
        ("/v1/embeddings", {"model": MODEL, "input": "x", "dimensions": True}, "dimensions"),
        ("/v1/embeddings", {"model": MODEL, "input": "x", "dimensions": 8.5}, "dimensions"),
        ("/api/v1/embed", {"inputs": "x", "normalize": 0}, "normalize"),
        ("/api/v1/embed", {"inputs": "x", "normalize": "false"}, "normalize"),
        ("/api/v1/embed", {"inputs": "x", "truncate": 1}, "truncate"),
        ("/api/v1/embed", {"inputs": "x", "prompt_name": 0}, "prompt_name"),
        ("/api/v1/embed", {"inputs": "x", "model": False}, "model"),
        ("/v1/jobs", {"model": MODEL, "input": ["x"], "normalize": 1}, "normalize"),
        ("/v1/jobs", {"model": MODEL, "input": ["x"], "dimensions": "8"}, "dimensions"),
        ("/v1/jobs", {"model": 1, "input": ["x"]}, "model"),
    ],
)
async def test_json_values_of_the_wrong_type_are_422(client, alpha, path, body, param):
    assert_error(await client.post(path, json=body, headers=alpha.headers), 422, param=param)


async def test_an_integral_float_is_an_integer(client, alpha):
    body = {"model": MODEL, "input": "x", "dimensions": 8.0}
    response = await client.post("/v1/embeddings", json=body, headers=alpha.headers)
    assert response.status_code == 200, response.text
    assert len(response.json()["data"][0]["embedding"]) == 8


async def test_a_nul_names_no_model_and_is_recorded_as_a_user(client, alpha):
    response = await client.post(
        "/v1/embeddings", json={"model": "mini\x00lm", "input": "x"}, headers=alpha.headers
    )
    assert_error(response, 404, "model_not_found", "model")
    response = await client.post(
        "/v1/embeddings", json={"model": MODEL, "input": "x", "user": "a\x00b"}, headers=alpha.headers
    )
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("body", [[], [[]], [{"text": "no query"}], [{"query": 1}]])
async def test_seed_bodies_the_schema_refuses_are_422(client, alpha, body):
    assert_error(await client.post("/v1/embedding", json=body, headers=alpha.headers), 422)


@pytest.mark.parametrize("query", ["limit=0", "limit=101", "limit=x"])
async def test_job_list_limits_are_422(client, alpha, query):
    assert_error(await client.get(f"/v1/jobs?{query}", headers=alpha.headers), 422, param="limit")


async def test_an_empty_cursor_is_the_first_page(client, alpha):
    response = await client.get("/v1/jobs?after=", headers=alpha.headers)
    assert response.status_code == 200, response.text


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


# --- Integers in a query: decimal digits, under their bound ----------------------------------------

RESULTS = f"/v1/jobs/{JOB_ID}/results"
# Every integer query parameter and its documented maximum.
QUERY_INTEGERS = [
    ("/v1/jobs", "limit", 100),
    ("/v1/files", "limit", 10000),
    ("/v1/batches", "limit", 100),
    (RESULTS, "limit", 1000),
    (RESULTS, "offset", 2**31 - 1),
]
NOT_DECIMAL_INTEGERS = ["1.0", "+1", " 1", "1 ", "1e3", "0x10", "1_0", "\u0661", ""]


@pytest.mark.parametrize(("path", "param", "bound"), QUERY_INTEGERS)
async def test_query_integers_are_decimal_digits_only(client, alpha, path, param, bound):
    """int() reads all of these (DRF "1.0" too); the schema's integer is none of them."""
    for value in NOT_DECIMAL_INTEGERS:
        response = await client.get(path, params={param: value, "format": "json"}, headers=alpha.headers)
        error = assert_error(response, 422, param=param)
        assert "decimal digits only" in error["message"], (value, error)


@pytest.mark.parametrize(("path", "param", "bound"), QUERY_INTEGERS)
async def test_query_integers_over_their_bound_are_422_naming_it(client, alpha, path, param, bound):
    for value in (bound + 1, 2**64, 10**400):
        response = await client.get(path, params={param: str(value), "format": "json"}, headers=alpha.headers)
        error = assert_error(response, 422, param=param)
        assert f"less than or equal to {bound}" in error["message"], error
    response = await client.get(path, params={param: str(bound), "format": "json"}, headers=alpha.headers)
    assert response.status_code in (200, 404), response.text  # 404: the made-up job id


def test_an_offset_past_64_bits_is_422_through_uvicorn(edge_server):
    """It was echoed back in the page, which orjson cannot render: a 500."""
    with httpx2.Client(base_url=edge_server.base_url, headers=edge_server.headers, timeout=30) as http:
        for offset in ("18446744073709551616", "4983466071047531.0"):
            response = http.get(RESULTS, params={"format": "json", "offset": offset})
            error = assert_error(response, 422, param="offset")
            assert offset.endswith(".0") or "less than or equal to 2147483647" in error["message"], error


# --- Ids in a path, and cursors ---------------------------------------------------------------------

ID_ROUTES = [
    ("GET", "/v1/jobs/{}", "job"),
    ("DELETE", "/v1/jobs/{}", "job"),
    ("POST", "/v1/jobs/{}/cancel", "job"),
    ("GET", "/v1/jobs/{}/results", "job"),
    ("GET", "/v1/files/{}", "file"),
    ("DELETE", "/v1/files/{}", "file"),
    ("GET", "/v1/files/{}/content", "file"),
    ("GET", "/v1/batches/{}", "batch"),
    ("POST", "/v1/batches/{}/cancel", "batch"),
]
# Strings that cannot be ids: a NUL made PostgreSQL fail the lookup (a 500).
NOT_IDS = ["%00", "job_%00", "file-%00%00", "x" * 300, "job_000000000000000000000000%0A", "%C3%A9"]


def test_a_string_that_cannot_be_an_id_is_404_through_uvicorn(raw):
    for method, route, what in ID_ROUTES:
        for value in NOT_IDS:
            raw.head(method, route.format(value), {"Content-Length": "0"})
            status, _, body = raw.answer()
            assert status == 404, (method, route, value, body)
            assert json.loads(body)["error"]["code"] == f"{what}_not_found", body


CURSORS = [
    ("/v1/jobs", "job", JOB_ID),
    ("/v1/files", "file", "file-" + "0" * 24),
    ("/v1/batches", "batch", "batch_" + "0" * 24),
]


async def test_files_are_listed_by_a_purpose_they_can_have(client, alpha):
    assert (
        await client.get("/v1/files", params={"purpose": "batch"}, headers=alpha.headers)
    ).status_code == 200
    assert_error(
        await client.get("/v1/files", params={"purpose": "fine-tune"}, headers=alpha.headers),
        422,
        param="purpose",
    )


@pytest.mark.parametrize(("path", "what", "unknown"), CURSORS)
async def test_a_cursor_is_an_id_and_an_unknown_one_is_404(client, alpha, path, what, unknown):
    for malformed in ("x", unknown[:-1], unknown + "\n", unknown.upper(), "a\x00"):
        assert_error(
            await client.get(path, params={"after": malformed}, headers=alpha.headers), 422, param="after"
        )
    error = assert_error(
        await client.get(path, params={"after": unknown}, headers=alpha.headers),
        404,
        f"{what}_not_found",
        "after",
    )
    assert unknown in error["message"]
    assert (await client.get(path, params={"after": ""}, headers=alpha.headers)).status_code == 200


async def test_another_tenants_job_is_no_cursor(client, alpha, beta):
    job_id = (await client.post("/v1/jobs", json=ROUTES["/v1/jobs"]["POST"], headers=alpha.headers)).json()[
        "id"
    ]
    assert (await client.get("/v1/jobs", params={"after": job_id}, headers=alpha.headers)).status_code == 200
    response = await client.get("/v1/jobs", params={"after": job_id}, headers=beta.headers)
    assert_error(response, 404, "job_not_found", "after")


def test_cursors_through_uvicorn(edge_server):
    with httpx2.Client(base_url=edge_server.base_url, headers=edge_server.headers, timeout=30) as http:
        for path, what, unknown in CURSORS:
            assert_error(http.get(path, params={"after": unknown}), 404, f"{what}_not_found", "after")
            assert_error(http.get(path, params={"after": "nope"}), 422, param="after")


# --- Forms: what the schema writes, and nothing else ------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("normalize", b"0"),
        ("normalize", b"True"),
        ("normalize", b"yes"),
        ("dimensions", b"+16"),
        ("dimensions", b"16.0"),
    ],
)
async def test_form_values_are_read_as_the_schema_writes_them(client, alpha, field, value):
    response = await post_upload(client, alpha, FILE_PART, MODEL_PART, (field, None, value, None))
    assert_error(response, 422, param=field)


async def test_an_idempotency_key_is_measured_as_sent(client, alpha):
    key = " " * 200 + "k" * 56
    response = await client.post(
        "/v1/jobs", json=ROUTES["/v1/jobs"]["POST"], headers={**alpha.headers, "Idempotency-Key": key}
    )
    assert_error(response, 422, param="Idempotency-Key")
