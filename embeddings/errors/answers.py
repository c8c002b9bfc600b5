"""What every error is answered with, in OpenAI's error shape, and whether a worker retries it.

API errors are declarative classes, rendered by one handler.

    {"error": {"message": ..., "type": ..., "param": ..., "code": ..., "request_id": ...}}

(`request_id`, the response's X-Request-Id, in every error answered within a request.)

ApiError (500 server_error)
├── BadRequest (400 invalid_request_error)            malformed JSON, unparsable body, a Host not
│                                                     in ALLOWED_HOSTS (code invalid_host)
├── Unauthorized (401 invalid_api_key)                missing, unknown, revoked or expired key
├── Forbidden (403 permission_denied)                 inactive tenant
│   └── ModelForbidden (403 model_not_allowed)        a model the tenant may not use
├── NotFound (404 not_found)
│   └── ModelNotFound (404 model_not_found)
├── MethodNotAllowed (405 method_not_allowed)
├── RequestTimeout (408 request_timeout)              the body stalled or arrived too slowly
├── Conflict (409 conflict)                           code job_not_finished: results asked for before
│   │                                                 the job finished; job_action_refused,
│   │                                                 batch_action_refused: an operator's action
│   │                                                 that does not apply now
│   └── IdempotencyKeyReused (409 idempotency_key_reused)  an Idempotency-Key sent with another request
├── Gone (410 gone)                                   code job_expired: a job's results, expired or deleted
├── PayloadTooLarge (413 payload_too_large)           body, inputs or tokens over a limit
│   └── JobLargerThanStorageBudget (413 job_storage_budget_exceeded)  a job larger than a whole
│                                                     job storage budget: it can never fit
├── UnsupportedMediaType (415 unsupported_media_type) a body that is not JSON, or not UTF-8
├── ValidationFailed (422 invalid_request_error)      well-formed JSON with wrong fields; code
│                                                     unsupported_by_model: right for some model, not
│                                                     the one asked for (dimensions, prompt, token ids)
├── RateLimited (429 rate_limit_exceeded)             overloaded, or a rate limit (type "requests" or
│   │                                                 "tokens"); carries Retry-After
│   └── InsufficientQuota (429 insufficient_quota)    the daily or monthly token budget is spent
│       └── StorageBudgetFull (429 job_storage_budget_exceeded)  a job's bytes do not fit what its
│                                                     tenant's (or the global) job storage budget has free
├── UpstreamUnavailable (503 model_unavailable)       Triton down or the model not ready
├── ServiceUnavailable (503, Retry-After)             a store or queue the request needs failed; its
│                                                     code names which (see ANSWERS): model_not_loaded,
│                                                     quota_unavailable, queue_unavailable,
│                                                     job_store_unavailable
├── ShuttingDown (503 shutting_down)                  still unfinished SHUTDOWN_TIMEOUT_S after SIGTERM
└── UpstreamTimeout (504 model_timeout)               Triton or the request missed its deadline

Services raise their own tree (embeddings.errors.service), the tokenizer and the Triton client
theirs; `ANSWERS` maps each of those classes to its answer and its `Retry` in one table, and
`as_api_error` (the API) and `retry_for` (the Celery tasks) pick the row of the most specific
class, so the order of the rows does not matter.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar, NamedTuple

import orjson
import redis
from django.core.exceptions import RequestDataTooBig, SuspiciousOperation
from django.http import HttpRequest, HttpResponse
from rest_framework import exceptions as drf

from embeddings.errors import EmbedsiteError
from embeddings.errors.service import (
    BatchActionRefused,
    EmptyFile,
    InferenceTimeout,
    InvalidRequest,
    JobActionRefused,
    JobConflict,
    JobExpired,
    JobNotFinished,
    JobQueueUnavailable,
    JobStoreUnavailable,
    LimitExceeded,
    ModelNotLoaded,
    ObjectNotFound,
    Overloaded,
    QuotaExceeded,
    QuotaUnavailable,
    ServiceError,
    StorageBudgetExceeded,
    UnsupportedByModel,
)
from embeddings.observability.context import current_request_id
from embeddings.result_dtypes import ResultOutOfRange
from embeddings.tokenization import InputTooLong, TokenizationError, TokenOutsideVocabulary
from embeddings.triton.errors import (
    TritonError,
    TritonInvalidInput,
    TritonModelError,
    TritonModelMismatch,
    TritonModelNotLoaded,
    TritonTimeout,
    TritonUnavailable,
)


class ApiError(EmbedsiteError):
    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    code: ClassVar[str | None] = "internal_error"
    default_message: ClassVar[str] = "The server failed to process the request."

    def __init__(
        self,
        message: str | None = None,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.message = message or self.default_message
        self.param = param
        self.error_code = code or self.code
        self.headers = headers or {}
        super().__init__(self.message)

    def body(self, *, with_request_id: bool = True) -> dict[str, Any]:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.error_code}
        # Served within a request: its id (X-Request-Id), for a tenant to quote and us to find.
        request_id = current_request_id() if with_request_id else None
        if request_id is not None:
            error["request_id"] = request_id
        return {"error": error}


class BadRequest(ApiError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"
    default_message = "The request could not be parsed."


class Unauthorized(ApiError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"
    default_message = "Incorrect API key provided."


class Forbidden(ApiError):
    status = 403
    type = "invalid_request_error"
    code = "permission_denied"
    default_message = "This API key may not perform this request."


class ModelForbidden(Forbidden):
    code = "model_not_allowed"
    default_message = "This API key may not use this model."


class NotFound(ApiError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"
    default_message = "Not found."


class ModelNotFound(NotFound):
    code = "model_not_found"
    default_message = "The model does not exist or you do not have access to it."


class Conflict(ApiError):
    status = 409
    type = "invalid_request_error"
    code = "conflict"
    default_message = "The request conflicts with the state of the resource."


class IdempotencyKeyReused(Conflict):
    code = "idempotency_key_reused"
    default_message = "This Idempotency-Key was already used with a different request."


class RequestTimeout(ApiError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"
    default_message = "The request body did not arrive in time."


class Gone(ApiError):
    status = 410
    type = "invalid_request_error"
    code = "gone"
    default_message = "The resource no longer exists."


class PayloadTooLarge(ApiError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"
    default_message = "The request is too large."


class ValidationFailed(ApiError):
    status = 422
    type = "invalid_request_error"
    code = "invalid_value"
    default_message = "The request has invalid fields."


class RateLimited(ApiError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"
    default_message = "The server is busy; retry after the time in Retry-After."

    def __init__(
        self,
        message: str | None = None,
        *,
        retry_after_s: int = 1,
        limit_type: str | None = None,
        **kwargs: Any,
    ) -> None:
        headers = {"Retry-After": str(max(1, int(retry_after_s))), **kwargs.pop("headers", {})}
        super().__init__(message, headers=headers, **kwargs)
        # OpenAI's rate-limit errors say which limit in `type`: "requests" or "tokens".
        self.limit_type = limit_type

    def body(self, *, with_request_id: bool = True) -> dict[str, Any]:
        body = super().body(with_request_id=with_request_id)
        if self.limit_type:
            body["error"]["type"] = self.limit_type
        return body


class InsufficientQuota(RateLimited):
    type = "insufficient_quota"
    code = "insufficient_quota"
    default_message = "You exceeded your current quota of tokens; it resets at the start of the next period."


class StorageBudgetFull(InsufficientQuota):
    code = "job_storage_budget_exceeded"
    default_message = "The job does not fit the job storage budget's free bytes now."
    # Bytes come back as jobs end (their inputs), are deleted or expire: minutes to days.
    retry_after_s = 60


class JobLargerThanStorageBudget(PayloadTooLarge):
    code = "job_storage_budget_exceeded"
    default_message = "The job is larger than the whole job storage budget; split it into smaller jobs."


class ServiceUnavailable(ApiError):
    """A store or queue the request needs failed (nothing was kept); `code` says which one."""

    status = 503
    type = "server_error"
    code = "service_unavailable"
    default_message = "A service this request needs is unavailable, so it was not served; retry shortly."

    def __init__(self, message: str | None = None, *, retry_after_s: int = 1, **kwargs: Any) -> None:
        headers = {"Retry-After": str(retry_after_s), **kwargs.pop("headers", {})}
        super().__init__(message, headers=headers, **kwargs)


class ShuttingDown(ApiError):
    status = 503
    type = "server_error"
    code = "shutting_down"
    default_message = "The server shut down before the request finished; retry it."

    def __init__(self, message: str | None = None, **kwargs: Any) -> None:
        headers = {"Retry-After": "1", "Connection": "close", **kwargs.pop("headers", {})}
        super().__init__(message, headers=headers, **kwargs)


class UpstreamUnavailable(ApiError):
    status = 503
    type = "server_error"
    code = "model_unavailable"
    default_message = "The model server is unavailable; retry shortly."


class UpstreamTimeout(ApiError):
    status = 504
    type = "server_error"
    code = "model_timeout"
    default_message = "The model server did not answer in time."


# --- Rendering every failure in the one shape -----------------------------------------------------

logger = logging.getLogger(__name__)


class MethodNotAllowed(ApiError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class UnsupportedMediaType(ApiError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


def _first_validation_error(detail: object, path: str = "") -> tuple[str | None, str]:
    """The first message in a DRF ValidationError detail tree, and the field path it belongs to."""
    if isinstance(detail, dict):
        for key, value in detail.items():
            field = key if key != "non_field_errors" else ""
            return _first_validation_error(value, f"{path}.{field}".strip(".") if field else path)
    if isinstance(detail, list) and detail:
        for index, value in enumerate(detail):
            if value:
                nested = isinstance(value, dict | list)
                return _first_validation_error(value, f"{path}[{index}]" if nested else path)
    return (path or None), str(detail)


def _service_answer(api_error: Callable[..., ApiError]) -> Callable[[ServiceError], ApiError]:
    """A service error answered as `api_error`, with the service's message and param."""
    return lambda exc: api_error(exc.message, param=exc.param)


def _drf_answer(api_error: type[ApiError]) -> Callable[[drf.APIException], ApiError]:
    return lambda exc: api_error(str(exc.detail))


def _quota_exceeded(exc: QuotaExceeded) -> ApiError:
    if exc.reason == "insufficient_quota":
        return InsufficientQuota(exc.message, retry_after_s=exc.retry_after_s, headers=exc.headers)
    return RateLimited(exc.message, retry_after_s=exc.retry_after_s, limit_type=exc.kind, headers=exc.headers)


def _storage_budget_exceeded(exc: StorageBudgetExceeded) -> ApiError:
    if exc.fits_when_empty:
        return StorageBudgetFull(exc.message, param=exc.param, retry_after_s=StorageBudgetFull.retry_after_s)
    return JobLargerThanStorageBudget(exc.message, param=exc.param)


def _drf_validation(exc: drf.ValidationError) -> ApiError:
    param, message = _first_validation_error(exc.detail)
    return ValidationFailed(f"{param}: {message}" if param else message, param=param)


# A 422 for what only the model asked for refuses (embeddings.errors.service.UnsupportedByModel).
UNSUPPORTED_BY_MODEL = "unsupported_by_model"
# The catalog's models are reloaded within MODEL_RECONCILE_INTERVAL_S of Triton coming back.
_model_not_loaded = partial(ServiceUnavailable, code="model_not_loaded", retry_after_s=30)


class Retry(enum.Enum):
    """Whether the same work may succeed later: what a worker does with the failure."""

    # The inputs' or the request's own fault: it fails the same way again (a job's chunk counts
    # its inputs failed and the job goes on; a request is answered and that is all).
    NEVER = "never"
    # The model server, for a moment: retried with backoff (a chunk: JOB_CHUNK_RETRIES times,
    # then its job stops).
    BACKOFF = "backoff"
    # A store or the queue: tried again later, never given up for it (a batch's validation is
    # retried; a chunk is left to the job watchdog, which re-sends it).
    LATER = "later"


class Answer(NamedTuple):
    """A row of the table: the ApiError an exception is answered with, and whether to retry it."""

    render: Callable[[Any], ApiError]
    retry: Retry


def _unhandled(exc: Exception) -> ApiError:
    logger.error("Unhandled error in an API request", exc_info=exc)
    return ApiError()


# Every exception a request or a worker can meet that is not an ApiError: the answer it gets, and
# whether it is retried; the row of the exception's most specific class in this table applies
# (see answer_for).
ANSWERS: dict[type[Exception], Answer] = {
    # The services' tree (embeddings.errors.service).
    ServiceError: Answer(_service_answer(ValidationFailed), Retry.NEVER),
    # As OpenAI answers a file it cannot use, and as the Files API's other upload errors (400).
    EmptyFile: Answer(_service_answer(partial(BadRequest, code="empty_file")), Retry.NEVER),
    InvalidRequest: Answer(_service_answer(ValidationFailed), Retry.NEVER),
    ObjectNotFound: Answer(lambda exc: NotFound(exc.message, param=exc.param, code=exc.code), Retry.NEVER),
    UnsupportedByModel: Answer(
        _service_answer(partial(ValidationFailed, code=UNSUPPORTED_BY_MODEL)), Retry.NEVER
    ),
    LimitExceeded: Answer(_service_answer(PayloadTooLarge), Retry.NEVER),
    InferenceTimeout: Answer(_service_answer(UpstreamTimeout), Retry.LATER),
    Overloaded: Answer(lambda exc: RateLimited(exc.message, retry_after_s=exc.retry_after_s), Retry.LATER),
    QuotaExceeded: Answer(_quota_exceeded, Retry.NEVER),
    QuotaUnavailable: Answer(
        _service_answer(partial(ServiceUnavailable, code="quota_unavailable")), Retry.LATER
    ),
    StorageBudgetExceeded: Answer(_storage_budget_exceeded, Retry.NEVER),
    JobConflict: Answer(_service_answer(IdempotencyKeyReused), Retry.NEVER),
    JobNotFinished: Answer(_service_answer(partial(Conflict, code="job_not_finished")), Retry.NEVER),
    JobExpired: Answer(_service_answer(partial(Gone, code="job_expired")), Retry.NEVER),
    JobActionRefused: Answer(_service_answer(partial(Conflict, code="job_action_refused")), Retry.NEVER),
    BatchActionRefused: Answer(_service_answer(partial(Conflict, code="batch_action_refused")), Retry.NEVER),
    JobQueueUnavailable: Answer(
        _service_answer(partial(ServiceUnavailable, code="queue_unavailable")), Retry.LATER
    ),
    JobStoreUnavailable: Answer(
        _service_answer(partial(ServiceUnavailable, code="job_store_unavailable", retry_after_s=30)),
        Retry.LATER,
    ),
    ModelNotLoaded: Answer(_service_answer(_model_not_loaded), Retry.BACKOFF),
    # The tokenizer's (embeddings.tokenization).
    TokenizationError: Answer(lambda exc: ValidationFailed(str(exc), param=exc.param), Retry.NEVER),
    TokenOutsideVocabulary: Answer(
        lambda exc: ValidationFailed(str(exc), param=exc.param, code=UNSUPPORTED_BY_MODEL), Retry.NEVER
    ),
    InputTooLong: Answer(
        lambda exc: PayloadTooLarge(str(exc), param=exc.param, code="context_length_exceeded"), Retry.NEVER
    ),
    # The Triton client's (embeddings.triton.errors).
    TritonError: Answer(
        lambda exc: UpstreamUnavailable("The model is not available on the model server."), Retry.LATER
    ),
    TritonUnavailable: Answer(lambda exc: UpstreamUnavailable(), Retry.BACKOFF),
    # The model answered wrongly (a bad output, a failed load): the same inputs would meet it again.
    TritonModelError: Answer(
        lambda exc: UpstreamUnavailable("The model is not available on the model server."), Retry.NEVER
    ),
    TritonTimeout: Answer(lambda exc: UpstreamTimeout(), Retry.BACKOFF),
    TritonModelNotLoaded: Answer(
        lambda exc: _model_not_loaded(
            f"The model server has not loaded the model {exc.model!r} (version {exc.version or 'latest'})."
        ),
        Retry.NEVER,
    ),
    TritonInvalidInput: Answer(
        lambda exc: ValidationFailed(f"The model refused the input: {exc}", param="input"), Retry.NEVER
    ),
    # Says which replicas disagree and how (no secret: what Triton's metadata says of the model).
    TritonModelMismatch: Answer(
        lambda exc: UpstreamUnavailable(str(exc), code="model_replicas_disagree"), Retry.NEVER
    ),
    # Django's.
    RequestDataTooBig: Answer(
        lambda exc: PayloadTooLarge("The request body is larger than this server accepts."), Retry.NEVER
    ),
    # Django's multipart parser: too many fields or files (DATA_UPLOAD_MAX_NUMBER_*).
    SuspiciousOperation: Answer(lambda exc: BadRequest(str(exc) or BadRequest.default_message), Retry.NEVER),
    # DRF's.
    drf.ValidationError: Answer(_drf_validation, Retry.NEVER),
    drf.ParseError: Answer(_drf_answer(BadRequest), Retry.NEVER),
    drf.NotAuthenticated: Answer(_drf_answer(Unauthorized), Retry.NEVER),
    drf.AuthenticationFailed: Answer(_drf_answer(Unauthorized), Retry.NEVER),
    drf.PermissionDenied: Answer(_drf_answer(Forbidden), Retry.NEVER),
    drf.NotFound: Answer(_drf_answer(NotFound), Retry.NEVER),
    drf.MethodNotAllowed: Answer(_drf_answer(MethodNotAllowed), Retry.NEVER),
    drf.UnsupportedMediaType: Answer(_drf_answer(UnsupportedMediaType), Retry.NEVER),
    drf.Throttled: Answer(
        lambda exc: RateLimited(str(exc.detail), retry_after_s=int(exc.wait or 1)), Retry.NEVER
    ),
    # A vector value beyond float16's range in a job stored as float16 (jobs only).
    ResultOutOfRange: Answer(_unhandled, Retry.NEVER),
    # A Redis the work needs (a store, the queue's): a request answers 500 as for any failure it
    # did not expect (the quota's Redis is QuotaUnavailable above); work is tried again later.
    redis.RedisError: Answer(_unhandled, Retry.LATER),
}


def answer_for(exc: Exception) -> Answer | None:
    """The row of the exception's most specific class; None for an exception no row names."""
    for exception_class in type(exc).__mro__:
        row = ANSWERS.get(exception_class)
        if row is not None:
            return row
    return None


def retry_for(exc: Exception) -> Retry | None:
    """Whether the work that raised `exc` may succeed later; None for an unexpected exception."""
    row = answer_for(exc)
    return None if row is None else row.retry


def as_api_error(exc: Exception) -> ApiError:
    """Map any exception a request can raise to the ApiError that describes it to the client."""
    if isinstance(exc, ApiError):
        return exc
    row = answer_for(exc)
    return _unhandled(exc) if row is None else row.render(exc)


# --- Answers given outside a DRF view (middleware, the ASGI edge, Django's 404 and 500 hooks) ---


def json_error_response(error: ApiError) -> HttpResponse:
    """An error as a plain Django response, for answers given outside a DRF view."""
    response = HttpResponse(orjson.dumps(error.body()), status=error.status, content_type="application/json")
    for name, value in error.headers.items():
        response[name] = value
    return response


def json_not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    """Unknown URLs answer in the API's error shape, not an HTML page."""
    return json_error_response(NotFound(f"No route for {request.method} {request.path}."))


def json_server_error(request: HttpRequest) -> HttpResponse:
    return json_error_response(ApiError())
