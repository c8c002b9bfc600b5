"""How the API answers each error the services, the tokenizer, Triton, Django and DRF raise."""

from __future__ import annotations

import pytest
from django.core.exceptions import RequestDataTooBig, SuspiciousOperation
from rest_framework import exceptions as drf

from embeddings.errors import service
from embeddings.errors.answers import ANSWERS, ApiError, Unauthorized, as_api_error
from embeddings.tokenization import InputTooLong, InvalidText, TokenizationError, TokenOutsideVocabulary
from embeddings.triton.errors import (
    TritonError,
    TritonInvalidInput,
    TritonModelLoadFailed,
    TritonModelNotLoaded,
    TritonTimeout,
    TritonUnavailable,
)

pytestmark = pytest.mark.unit


def answer(exc: Exception) -> tuple[int, dict, dict]:
    error = as_api_error(exc)
    return error.status, error.body()["error"], error.headers


def body(message: str, type_: str, code: str | None, param: str | None = None) -> dict:
    return {"message": message, "type": type_, "param": param, "code": code}


SERVICE_ANSWERS = [
    (
        service.InvalidRequest("dimensions: 9000 is more than 384", param="dimensions"),
        422,
        body("dimensions: 9000 is more than 384", "invalid_request_error", "invalid_value", "dimensions"),
        {},
    ),
    (
        service.UnsupportedByModel("dimensions 9000 is larger than the model's 384", param="dimensions"),
        422,
        body(
            "dimensions 9000 is larger than the model's 384",
            "invalid_request_error",
            "unsupported_by_model",
            "dimensions",
        ),
        {},
    ),
    (
        service.ObjectNotFound("You have no job 'job_1' to list after.", param="after", code="job_not_found"),
        404,
        body("You have no job 'job_1' to list after.", "invalid_request_error", "job_not_found", "after"),
        {},
    ),
    (
        service.EmptyFile("The file has no lines.", param="file"),
        400,
        body("The file has no lines.", "invalid_request_error", "empty_file", "file"),
        {},
    ),
    (
        service.ServiceError("refused", param="input"),
        422,
        body("refused", "invalid_request_error", "invalid_value", "input"),
        {},
    ),
    (
        service.LimitExceeded("too many inputs", param="input"),
        413,
        body("too many inputs", "invalid_request_error", "payload_too_large", "input"),
        {},
    ),
    (
        service.InferenceTimeout("not ready in 30 s"),
        504,
        body("not ready in 30 s", "server_error", "model_timeout"),
        {},
    ),
    (
        service.Overloaded("busy", retry_after_s=3),
        429,
        body("busy", "rate_limit_error", "rate_limit_exceeded"),
        {"Retry-After": "3"},
    ),
    (
        service.QuotaExceeded(
            "RPM reached",
            reason="rate_limit_exceeded",
            kind="requests",
            retry_after_s=12,
            headers={"x-a": "1"},
        ),
        429,
        body("RPM reached", "requests", "rate_limit_exceeded"),
        {"Retry-After": "12", "x-a": "1"},
    ),
    (
        service.QuotaExceeded("budget spent", reason="insufficient_quota", kind="tokens", retry_after_s=99),
        429,
        body("budget spent", "insufficient_quota", "insufficient_quota"),
        {"Retry-After": "99"},
    ),
    (
        service.QuotaUnavailable("Redis does not answer"),
        503,
        body("Redis does not answer", "server_error", "quota_unavailable"),
        {"Retry-After": "1"},
    ),
    (
        service.StorageBudgetExceeded("no room now", budget="tenant", fits_when_empty=True),
        429,
        body("no room now", "insufficient_quota", "job_storage_budget_exceeded", "input"),
        {"Retry-After": "60"},
    ),
    (
        service.StorageBudgetExceeded("never fits", budget="global", fits_when_empty=False),
        413,
        body("never fits", "invalid_request_error", "job_storage_budget_exceeded", "input"),
        {},
    ),
    (
        service.JobConflict("key reused", param="Idempotency-Key"),
        409,
        body("key reused", "invalid_request_error", "idempotency_key_reused", "Idempotency-Key"),
        {},
    ),
    (
        service.JobNotFinished("Job job_1 is running; download its results once it has finished."),
        409,
        body(
            "Job job_1 is running; download its results once it has finished.",
            "invalid_request_error",
            "job_not_finished",
        ),
        {},
    ),
    (
        service.JobExpired("The results of job job_1 have expired or were deleted."),
        410,
        body(
            "The results of job job_1 have expired or were deleted.", "invalid_request_error", "job_expired"
        ),
        {},
    ),
    (
        service.JobActionRefused("Job job_1 is completed: only a failed job's chunks can be retried."),
        409,
        body(
            "Job job_1 is completed: only a failed job's chunks can be retried.",
            "invalid_request_error",
            "job_action_refused",
        ),
        {},
    ),
    (
        service.BatchActionRefused("Batch batch_1 is completed: there is nothing to cancel."),
        409,
        body(
            "Batch batch_1 is completed: there is nothing to cancel.",
            "invalid_request_error",
            "batch_action_refused",
        ),
        {},
    ),
    (
        service.JobQueueUnavailable("broker down"),
        503,
        body("broker down", "server_error", "queue_unavailable"),
        {"Retry-After": "1"},
    ),
    (
        service.JobStoreUnavailable("store full"),
        503,
        body("store full", "server_error", "job_store_unavailable"),
        {"Retry-After": "30"},
    ),
    (
        service.ModelNotLoaded(model="bge", triton_model="bge_small", version=""),
        503,
        body(
            "The model 'bge' is registered but not loaded on the model server (Triton model 'bge_small', "
            "version latest); retry later or use another model.",
            "server_error",
            "model_not_loaded",
            "model",
        ),
        {"Retry-After": "30"},
    ),
]

OTHER_ANSWERS = [
    (
        InputTooLong(index=0, tokens=600, max_tokens=512),
        413,
        body(
            "Input 0 has 600 tokens, more than the model's maximum of 512; shorten it or allow truncation.",
            "invalid_request_error",
            "context_length_exceeded",
            "input",
        ),
        {},
    ),
    (
        TokenOutsideVocabulary("Input 0 has token ids outside the vocabulary [0, 30522)"),
        422,
        body(
            "Input 0 has token ids outside the vocabulary [0, 30522)",
            "invalid_request_error",
            "unsupported_by_model",
            "input",
        ),
        {},
    ),
    (
        InvalidText("not text"),
        422,
        body("not text", "invalid_request_error", "invalid_value", "input"),
        {},
    ),
    (
        TritonUnavailable("down"),
        503,
        body("The model server is unavailable; retry shortly.", "server_error", "model_unavailable"),
        {},
    ),
    (
        TritonTimeout("late"),
        504,
        body("The model server did not answer in time.", "server_error", "model_timeout"),
        {},
    ),
    (
        TritonModelNotLoaded("gone", model="minilm", version="2"),
        503,
        body(
            "The model server has not loaded the model 'minilm' (version 2).",
            "server_error",
            "model_not_loaded",
        ),
        {"Retry-After": "30"},
    ),
    (
        TritonInvalidInput("wrong shape"),
        422,
        body("The model refused the input: wrong shape", "invalid_request_error", "invalid_value", "input"),
        {},
    ),
    (
        TritonModelLoadFailed("bad config", model="minilm"),
        503,
        body("The model is not available on the model server.", "server_error", "model_unavailable"),
        {},
    ),
    (
        TritonError("unexpected answer"),
        503,
        body("The model is not available on the model server.", "server_error", "model_unavailable"),
        {},
    ),
    (
        RequestDataTooBig("big"),
        413,
        body(
            "The request body is larger than this server accepts.",
            "invalid_request_error",
            "payload_too_large",
        ),
        {},
    ),
    (
        SuspiciousOperation("too many fields"),
        400,
        body("too many fields", "invalid_request_error", "invalid_request"),
        {},
    ),
    (
        drf.ValidationError({"input": ["This field is required."]}),
        422,
        body("input: This field is required.", "invalid_request_error", "invalid_value", "input"),
        {},
    ),
    (
        drf.ParseError("bad JSON"),
        400,
        body("bad JSON", "invalid_request_error", "invalid_request"),
        {},
    ),
    (
        drf.NotAuthenticated("no key"),
        401,
        body("no key", "invalid_request_error", "invalid_api_key"),
        {},
    ),
    (
        drf.PermissionDenied("no"),
        403,
        body("no", "invalid_request_error", "permission_denied"),
        {},
    ),
    (
        drf.MethodNotAllowed("PUT"),
        405,
        body('Method "PUT" not allowed.', "invalid_request_error", "method_not_allowed"),
        {},
    ),
    (
        drf.Throttled(wait=7),
        429,
        body(
            "Request was throttled. Expected available in 7 seconds.",
            "rate_limit_error",
            "rate_limit_exceeded",
        ),
        {"Retry-After": "7"},
    ),
]


@pytest.mark.parametrize(
    ("exc", "status", "error_body", "headers"),
    SERVICE_ANSWERS + OTHER_ANSWERS,
    ids=lambda value: type(value).__name__ if isinstance(value, Exception) else "",
)
def test_each_error_gets_its_answer(exc, status, error_body, headers):
    assert answer(exc) == (status, error_body, headers)


def test_every_class_of_the_service_tree_has_a_row():
    """A new class in errors/service.py must be answered on purpose, not by its base class's row
    (subclasses elsewhere, such as job_inputs.JobInputTooLarge, share their base's answer)."""
    tree = {
        value
        for value in vars(service).values()
        if isinstance(value, type) and issubclass(value, service.ServiceError)
    }
    assert len(tree) >= 10
    assert tree - set(ANSWERS) == set()


def test_the_most_specific_row_wins():
    # InputTooLong is a TokenizationError; TritonModelNotLoaded a TritonError: each has its own row.
    assert as_api_error(InputTooLong(index=0, tokens=2, max_tokens=1)).status == 413
    assert as_api_error(TokenizationError("x")).status == 422
    assert as_api_error(TritonModelNotLoaded("x", model="m")).error_code == "model_not_loaded"


def test_api_errors_pass_through_and_unknown_errors_are_500():
    refused = Unauthorized("nope")
    assert as_api_error(refused) is refused
    unknown = as_api_error(RuntimeError("secret detail"))
    assert type(unknown) is ApiError
    assert (
        unknown.status == 500
        and unknown.body()["error"]["message"] == "The server failed to process the request."
    )
