"""Schemathesis hooks of tests/reliability/test_schemathesis.py: the few answers to schema-valid
requests that are right although they refuse the request, because what refuses it cannot be written
in the OpenAPI 3.0 schema. Each is dropped only on its operations, with its status and error code
(or field), so any other refusal of valid data still fails the run.

- `unsupported_by_model` (422): `dimensions` above the model's, a `prompt_name` it lacks, token ids
  outside its vocabulary (to embed, or for TEI's /decode). The schema is one for every model; these
  bounds are each model's.
- `invalid_range` (422) on GET /v1/usage: a range that ends before it starts, spans more than 366
  days, or lies outside 1970-01-01 to 9999-01-01. Each bound alone is a date or date-time; how two
  parameters relate, and a year range, are not something a schema says.
- `callback_url` (422) on POST /v1/jobs: whether its host resolves, and to a public address, is
  decided by DNS at submission (here, by the loopback-only guard, which resolves nothing).
- `file` (422) on POST /v1/jobs and `empty_file` (400) on POST /v1/files: what an uploaded file's
  bytes hold (UTF-8 lines, JSONL records, a line that is not blank) is not described by a binary
  part's schema, and Schemathesis fills one with image samples and random bytes.
- `metadata` keys (422): over 64 characters or with a NUL. OpenAPI 3.0 cannot bound an object's
  keys (`propertyNames` is 3.1's); the values' bounds are in the schema.
- one of two fields (422): Cohere's /v2/embed takes `texts` or `inputs`, exactly one; /v1/embeddings
  takes `dimensions` and Voyage's `output_dimension` only when they agree; `long_inputs` (on
  /v1/embeddings and TEI's /embed) only when `truncation`/`truncate` agrees with it, and `chunk`
  only for texts, not token ids. How two optional fields relate is not something this schema says.

Each dropped failure is counted (the JSON report's `filtered`) and written to the file named by
DROPPED_LOG_ENV, one JSON line each, so the test can report what was dropped and why.
"""

from __future__ import annotations

import json
import os

import schemathesis
from schemathesis.openapi.checks import RejectedPositiveData

DROPPED_LOG_ENV = "EMBEDSITE_SCHEMATHESIS_DROPPED"
# Why a refusal may be dropped (the module docstring's list, in its order).
REASONS = (
    "unsupported_by_model",
    "invalid_range",
    "callback_url",
    "file content",
    "empty_file",
    "metadata keys",
    "one of two fields",
)
# The operations whose fields a model may refuse: the embedding ones and TEI's tokenizer routes.
MODEL_OPERATIONS = {
    "POST /v1/embeddings",
    "POST /api/v1/embed",
    "POST /embed",
    "POST /v2/embed",
    "POST /v1/jobs",
    "POST /tokenize",
    "POST /decode",
}
METADATA_OPERATIONS = {"POST /v1/jobs", "POST /v1/batches"}


def _error(response) -> dict:
    try:
        body = response.json()
    except ValueError:
        return {}
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else {}


def expected_refusal(operation: str, status: int, error: dict) -> str | None:
    """Why this refusal of schema-valid data is right (one of REASONS), or None."""
    code, param, message = error.get("code"), error.get("param"), error.get("message") or ""
    if status == 422 and code == "unsupported_by_model" and operation in MODEL_OPERATIONS:
        return "unsupported_by_model"
    if status == 422 and (operation, param) in {
        ("POST /v2/embed", "texts"),
        ("POST /v1/embeddings", "output_dimension"),
        ("POST /v1/embeddings", "long_inputs"),
        ("POST /embed", "long_inputs"),
        ("POST /api/v1/embed", "long_inputs"),
    }:
        return "one of two fields"
    if status == 422 and code == "invalid_range" and operation == "GET /v1/usage":
        return "invalid_range"
    if status == 422 and param == "callback_url" and operation == "POST /v1/jobs":
        return "callback_url"
    if status == 422 and param == "file" and operation == "POST /v1/jobs":
        return "file content"
    if status == 400 and code == "empty_file" and operation == "POST /v1/files":
        return "empty_file"
    if (
        status == 422
        and param == "metadata"
        and message.startswith("metadata: keys")
        and operation in METADATA_OPERATIONS
    ):
        return "metadata keys"
    return None


@schemathesis.hook
def filter_failure(context, failure, case, response) -> bool:
    if not isinstance(failure, RejectedPositiveData):
        return True
    operation = case.operation.label
    reason = expected_refusal(operation, response.status_code, _error(response))
    if reason is None:
        return True
    path = os.environ.get(DROPPED_LOG_ENV)
    if path:
        entry = {"operation": operation, "status": response.status_code, "reason": reason}
        with open(path, "a") as log:
            log.write(json.dumps({**entry, "param": _error(response).get("param")}) + "\n")
    return False
