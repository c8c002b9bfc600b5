"""The OpenAPI schema (generated without warnings, complete) and its offline Swagger UI and ReDoc."""

from __future__ import annotations

import io
import re

import pytest
import yaml
from django.core.management import call_command

API_OPERATIONS = {
    "/v1/embeddings": {"post"},
    "/v1/embedding": {"post"},
    "/api/v1/embed": {"post"},
    "/embed": {"post"},
    "/v2/embed": {"post"},
    "/v2/rerank": {"post"},
    "/v1/rerank": {"post"},
    "/rerank": {"post"},
    "/tokenize": {"post"},
    "/decode": {"post"},
    "/v1/models": {"get"},
    "/v1/models/{model_id}": {"get"},
    "/v1/usage": {"get"},
    "/v1/jobs": {"get", "post"},
    "/v1/jobs/{job_id}": {"get", "delete"},
    "/v1/jobs/{job_id}/cancel": {"post"},
    "/v1/jobs/{job_id}/results": {"get"},
    "/v1/files": {"get", "post"},
    "/v1/files/{file_id}": {"get", "delete"},
    "/v1/files/{file_id}/content": {"get"},
    "/v1/batches": {"get", "post"},
    "/v1/batches/{batch_id}": {"get"},
    "/v1/batches/{batch_id}/cancel": {"post"},
}
EMBEDDING_ERRORS = {"400", "401", "403", "404", "413", "422", "429", "503", "504"}


@pytest.fixture(scope="module")
def schema() -> dict:
    out, err = io.StringIO(), io.StringIO()
    # --fail-on-warn raises on any warning or error; stderr must not even mention one.
    call_command("spectacular", "--fail-on-warn", "--validate", stdout=out, stderr=err)
    assert "warning" not in err.getvalue().lower(), err.getvalue()
    assert "error" not in err.getvalue().lower(), err.getvalue()
    return yaml.safe_load(out.getvalue())


def test_every_api_path_and_method_is_documented(schema):
    paths = schema["paths"]
    assert {path: set(operations) for path, operations in paths.items()} == API_OPERATIONS
    operation_ids = [op["operationId"] for ops in paths.values() for op in ops.values()]
    assert len(operation_ids) == len(set(operation_ids))
    for path, operations in paths.items():
        for method, operation in operations.items():
            assert operation.get("summary"), (path, method)
            assert operation["security"] == [{"ApiKeyBearer": []}], (path, method)
            assert "200" in operation["responses"], (path, method)


MODEL_PATHS = (
    "/v1/embeddings",
    "/v1/embedding",
    "/api/v1/embed",
    "/embed",
    "/v2/embed",
    "/v2/rerank",
    "/v1/rerank",
    "/rerank",
)
# TEI's tokenizer routes: a model's tokenizer, never the model, so never its deadline (504).
TOKENIZER_PATHS = ("/tokenize", "/decode")


def test_errors_are_documented_in_openai_shape(schema):
    for path in MODEL_PATHS + TOKENIZER_PATHS:
        responses = schema["paths"][path]["post"]["responses"]
        expected = EMBEDDING_ERRORS - {"504"} if path in TOKENIZER_PATHS else EMBEDDING_ERRORS
        assert set(responses) >= expected and ("504" in responses) == ("504" in expected), path
        for status in expected:
            content = responses[status]["content"]["application/json"]
            assert content["schema"] == {"$ref": "#/components/schemas/Error"}
            assert content["examples"], (path, status)
            for example in content["examples"].values():
                assert set(example["value"]["error"]) == {"message", "type", "param", "code"}
        too_many = responses["429"]["content"]["application/json"]["examples"].values()
        codes = {example["value"]["error"]["code"] for example in too_many}
        assert codes == {"rate_limit_exceeded", "insufficient_quota"}, path
        assert "Retry-After" in responses["429"]["headers"]
        for status in ("200", "429", "503"):
            assert "x-ratelimit-remaining-tokens" in responses[status]["headers"], (path, status)
    for path in ("/v1/models", "/v1/models/{model_id}"):
        assert {"401", "403"} <= set(schema["paths"][path]["get"]["responses"])
    assert "404" in schema["paths"]["/v1/models/{model_id}"]["get"]["responses"]
    error_detail = schema["components"]["schemas"]["ErrorDetail"]
    assert set(error_detail["required"]) == {"message", "type", "param", "code"}


def test_bodies_and_examples(schema):
    operations = {path: next(iter(ops.values())) for path, ops in schema["paths"].items()}
    for path in MODEL_PATHS + TOKENIZER_PATHS:
        body = operations[path]["requestBody"]["content"]["application/json"]
        assert body["schema"] and body["examples"], path
        assert operations[path]["responses"]["200"]["content"]["application/json"]["examples"], path
    seed = operations["/v1/embedding"]["requestBody"]["content"]["application/json"]["schema"]
    assert seed["type"] == "array"
    openai_request = schema["components"]["schemas"]["OpenAIEmbeddingsRequestRequest"]
    assert set(openai_request["required"]) == {"model", "input"}
    encoding_format = openai_request["properties"]["encoding_format"]["allOf"][0]["$ref"].split("/")[-1]
    assert schema["components"]["schemas"][encoding_format]["enum"] == ["float", "base64"]


def test_tokenizer_routes_document_teis_shapes(schema):
    components = schema["components"]["schemas"]
    tokenize = components["TeiTokenizeRequestRequest"]
    assert tokenize["required"] == ["inputs"]
    assert tokenize["properties"]["add_special_tokens"] == {
        "type": "boolean",
        "default": True,
        "description": tokenize["properties"]["add_special_tokens"]["description"],
    }
    assert tokenize["properties"]["prompt_name"]["nullable"] is True
    answer = schema["paths"]["/tokenize"]["post"]["responses"]["200"]["content"]["application/json"]
    assert answer["schema"] == {
        "type": "array",
        "items": {"type": "array", "items": {"$ref": "#/components/schemas/TeiToken"}},
    }
    token = components["TeiToken"]
    assert set(token["required"]) == {"id", "text", "special", "start", "stop"}
    assert token["properties"]["start"]["nullable"] and token["properties"]["stop"]["nullable"]
    # The example is an answer: a list of each input's tokens.
    [example] = answer["examples"].values()
    assert isinstance(example["value"][0], list) and example["value"][0][0]["text"] == "[CLS]"
    decode = components["TeiDecodeRequestRequest"]
    assert decode["required"] == ["ids"] and decode["properties"]["skip_special_tokens"]["default"] is True
    ids = decode["properties"]["ids"]["oneOf"]
    assert ids[0] == {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1},
        "minItems": 1,
    }
    assert ids[1]["items"]["minItems"] == 1 and ids[1]["minItems"] == 1
    decoded = schema["paths"]["/decode"]["post"]["responses"]["200"]["content"]["application/json"]
    assert decoded["schema"] == {"type": "array", "items": {"type": "string"}}


def test_bearer_security_scheme(schema):
    scheme = schema["components"]["securitySchemes"]["ApiKeyBearer"]
    assert scheme["type"] == "http" and scheme["scheme"] == "bearer"


async def test_schema_is_served(client):
    response = await client.get("/api/schema/", headers={"Accept": "application/vnd.oai.openapi+json"})
    assert response.status_code == 200
    served = response.json()
    assert set(served["paths"]) == set(API_OPERATIONS)
    assert served["info"]["title"] == "embedsite"


@pytest.mark.parametrize("path", ["/explorer/", "/redoc/"])
async def test_docs_pages_use_only_local_assets(client, path):
    response = await client.get(path)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    html = response.text
    assets = re.findall(r"""(?:src|href)=["']([^"']+)["']""", html)
    assert any("drf_spectacular_sidecar" in asset for asset in assets), assets
    assert not [asset for asset in assets if re.match(r"(https?:)?//", asset)], assets
    # Nor a script's: no URL naming a host (a CDN, Google's fonts) anywhere in the page. Not a
    # search for "cdn" in the text: the page carries random tokens, which once held those letters.
    assert not re.findall(r"(?:https?:)?//[\w-]+(?:\.[\w-]+)+", html), html
    assert "/api/schema/" in html


def test_jobs_are_documented(schema):
    paths = schema["paths"]
    create = paths["/v1/jobs"]["post"]
    assert set(create["requestBody"]["content"]) == {"application/json", "multipart/form-data"}
    assert {"202", "200", "409", "413", "415", "422", "429"} <= set(create["responses"])
    assert create["responses"]["202"]["content"]["application/json"]["examples"]
    assert [parameter["name"] for parameter in create["parameters"]] == ["Idempotency-Key"]
    results = paths["/v1/jobs/{job_id}/results"]["get"]
    assert set(results["responses"]["200"]["content"]) == {
        "application/json",
        "application/jsonl",
        "application/x-npy",
    }
    codes = {
        status: [
            example["value"]["error"]["code"]
            for example in response["content"]["application/json"]["examples"].values()
        ]
        for status, response in results["responses"].items()
        if status in {"404", "409", "410"}
    }
    assert codes == {"404": ["job_not_found"], "409": ["job_not_finished"], "410": ["job_expired"]}
    for path, method in [
        ("/v1/jobs/{job_id}", "get"),
        ("/v1/jobs/{job_id}", "delete"),
        ("/v1/jobs/{job_id}/cancel", "post"),
    ]:
        assert "404" in paths[path][method]["responses"], (path, method)


def test_every_operation_documents_the_edge_errors(schema):
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            for status in ("400", "408", "413", "415"):
                content = operation["responses"][status]["content"]["application/json"]
                assert content["schema"] == {"$ref": "#/components/schemas/Error"}, (path, method, status)
    for path in ("/v1/embeddings", "/v1/embedding", "/api/v1/embed", "/embed", "/v1/jobs"):
        assert "415" in schema["paths"][path]["post"]["responses"], path


def parameter(operation: dict, name: str) -> dict:
    return next(p for p in operation["parameters"] if p["name"] == name)["schema"]


def test_query_parameters_carry_their_bounds(schema):
    """What the views refuse, the schema says: limit=0 is documented invalid, and every integer has
    its maximum (the one the refusal names)."""
    jobs = schema["paths"]["/v1/jobs"]["get"]
    assert parameter(jobs, "limit") == {"type": "integer", "maximum": 100, "minimum": 1, "default": 20}
    results = schema["paths"]["/v1/jobs/{job_id}/results"]["get"]
    assert parameter(results, "limit")["minimum"] == 1 and parameter(results, "limit")["maximum"] == 1000
    assert (
        parameter(results, "offset")["minimum"] == 0 and parameter(results, "offset")["maximum"] == 2**31 - 1
    )
    assert parameter(schema["paths"]["/v1/files"]["get"], "limit")["maximum"] == 10000
    assert parameter(schema["paths"]["/v1/batches"]["get"], "limit")["maximum"] == 100
    integers = [
        (path, p["name"])
        for path, operations in schema["paths"].items()
        for operation in operations.values()
        for p in operation.get("parameters", [])
        if p["schema"].get("type") == "integer"
    ]
    assert len(integers) == 5 and all(
        "maximum" in parameter(schema["paths"][path]["get"], name) for path, name in integers
    ), integers
    assert parameter(results, "format")["enum"] == ["jsonl", "json", "npy"]
    usage = schema["paths"]["/v1/usage"]["get"]
    assert parameter(usage, "group_by")["enum"] == ["day", "model", "variant", "key"]
    # A variant row says which export served; null where it was not recorded.
    row = schema["components"]["schemas"]["UsageRow"]["properties"]
    assert all(row[field]["nullable"] and "not recorded" in row[field]["description"]
               for field in ("model_version", "model_dtype"))  # fmt: skip


ID_PATTERNS = {
    "job_id": "^job_[a-z0-9]{24}$",
    "file_id": "^file-[A-Za-z0-9]{24}$",
    "batch_id": "^batch_[a-z0-9]{24}$",
}


def test_ids_and_cursors_have_their_format(schema):
    """Ids as the services draw them: any other string is 404 (a path) or 422 (a cursor)."""
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            for p in operation.get("parameters", []):
                if p["in"] == "path" and p["name"] in ID_PATTERNS:
                    assert p["schema"] == {"type": "string", "pattern": ID_PATTERNS[p["name"]]}, path
    for path, name in (("/v1/jobs", "job_id"), ("/v1/files", "file_id"), ("/v1/batches", "batch_id")):
        after = parameter(schema["paths"][path]["get"], "after")
        assert after["oneOf"] == [
            {"type": "string", "pattern": ID_PATTERNS[name]},
            {"type": "string", "maxLength": 0},
        ], path
        assert "404" in schema["paths"][path]["get"]["responses"], path
    usage_key = parameter(schema["paths"]["/v1/usage"]["get"], "key")
    assert usage_key["oneOf"][0]["pattern"].startswith("^(?:emb_)?[a-z0-9]{12}")


def test_array_bodies_document_what_is_refused(schema):
    seed = schema["paths"]["/v1/embedding"]["post"]["requestBody"]["content"]["application/json"]
    assert seed["schema"]["minItems"] == 1 and seed["schema"]["items"]["$ref"].endswith("/SeedQueryRequest")
    # The documented example is a valid body (drf-spectacular lists a many=True example itself).
    assert [example["value"] for example in seed["examples"].values()] == [[{"query": "hello"}]]
    token_ids = schema["components"]["schemas"]["OpenAIEmbeddingsRequestRequest"]["properties"]["input"]
    nested = token_ids["oneOf"][3]
    assert nested["minItems"] == 1 and nested["items"]["minItems"] == 1
    assert nested["items"]["items"] == {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
    # An empty text is refused, alone or in an array, on every route that takes texts.
    assert token_ids["oneOf"][0] == {"type": "string", "minLength": 1}
    assert token_ids["oneOf"][1]["items"] == {"type": "string", "minLength": 1}
    seed_query = schema["components"]["schemas"]["SeedQueryRequest"]["properties"]["query"]
    assert seed_query["minLength"] == 1
    job_input = schema["components"]["schemas"]["JobCreateRequestRequest"]["properties"]["input"]
    assert job_input["items"] == {"type": "string", "minLength": 1}


def test_jobs_link_to_their_operations(schema):
    create = schema["paths"]["/v1/jobs"]["post"]["responses"]
    for status in ("200", "202"):
        links = create[status]["links"]
        assert {link["operationId"] for link in links.values()} == {
            "retrieve_job", "cancel_job", "retrieve_job_results", "delete_job"
        }  # fmt: skip
        assert all(link["parameters"] == {"job_id": "$response.body#/id"} for link in links.values())
    retrieve = schema["paths"]["/v1/jobs/{job_id}"]["get"]["responses"]["200"]["links"]
    assert {link["operationId"] for link in retrieve.values()} == {
        "cancel_job",
        "retrieve_job_results",
        "delete_job",
    }


def test_forms_document_what_they_take(schema):
    upload = schema["components"]["schemas"]["FileUploadRequestRequest"]
    assert upload["additionalProperties"] is False
    assert upload["properties"]["expires_after"]["properties"]["seconds"] == {
        "type": "integer",
        "minimum": 3600,
        "maximum": 30 * 24 * 3600,
    }
    assert upload["properties"]["file"]["minLength"] == 1
    form = schema["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]["multipart/form-data"]
    assert form["encoding"]["file"]["contentType"].startswith("text/plain, ")
    assert form["examples"], "a multipart example, which Schemathesis sends as a file"
    metadata = schema["components"]["schemas"]["JobCreateRequestRequest"]["properties"]["metadata"]
    assert metadata["additionalProperties"]["pattern"] == "^[^\\u0000]*$"


def test_files_and_batches_link_to_their_operations(schema):
    """So that the stateful phase creates a batch from an uploaded file, and follows it."""
    uploaded = schema["paths"]["/v1/files"]["post"]["responses"]["200"]["links"]
    assert {link["operationId"] for link in uploaded.values()} == {
        "retrieve_file", "download_file", "delete_file", "create_batch"
    }  # fmt: skip
    assert uploaded["CreateBatch"]["requestBody"] == {"input_file_id": "$response.body#/id"}
    created = schema["paths"]["/v1/batches"]["post"]["responses"]["200"]["links"]
    assert {link["operationId"] for link in created.values()} == {"retrieve_batch", "cancel_batch"}


async def test_documented_request_examples_are_accepted(client, alpha):
    """Every request example of the schema, sent as documented, is answered 200 or 202."""
    served = (await client.get("/api/schema/", headers={"Accept": "application/vnd.oai.openapi+json"})).json()
    sent = 0
    for path, operations in served["paths"].items():
        for method, operation in operations.items():
            content = operation.get("requestBody", {}).get("content", {}).get("application/json", {})
            for example in content.get("examples", {}).values():
                response = await client.request(method, path, json=example["value"], headers=alpha.headers)
                assert response.status_code in (200, 202), (path, example, response.text)
                sent += 1
    assert sent >= 6


def test_a_models_dtype_and_its_agreement_with_float32_are_described(schema):
    components = schema["components"]["schemas"]
    model = components["ModelObject"]["properties"]
    assert components["DtypeEnum"]["enum"] == ["float32", "int8", "float16"]
    assert model["agreement"]["nullable"] and "int8_agreement" not in model
    assert model["agreement"]["allOf"] == [{"$ref": "#/components/schemas/Agreement"}]
    assert set(components["Agreement"]["required"]) == {
        "reference",
        "min_cosine",
        "mean_cosine",
        "recall_at_10",
        "text_count",
    }
