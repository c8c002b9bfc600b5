"""Errors the services raise for a request they refuse; errors/answers.py maps each to an answer.

ServiceError
├── EmptyFile           (400) a batch input file without a line to run (at upload, or at batch creation)
├── InvalidRequest      (422) a well-formed request the model cannot serve as asked
│   └── UnsupportedByModel (422) valid for some model, not the one asked for (its dimensions, prompts)
├── ObjectNotFound      (404) an object of the tenant's that a request names (a list's cursor) is not there
├── LimitExceeded       (413) more inputs, tokens or bytes than allowed
├── Overloaded          (429) too many inference calls in flight in this process
├── InferenceTimeout    (504) the request's inference missed its deadline (EMBEDDING_TIMEOUT_S)
├── ModelNotLoaded      (503) the catalog model's Triton model (version) is not loaded in Triton
├── QuotaExceeded       (429) a tenant's or key's rate limit or budget (embeddings.services.quotas.limits)
├── QuotaUnavailable    (503) the quota store (Redis) failed and QUOTA_REDIS_FAILURE is "closed"
├── StorageBudgetExceeded (413/429) a job's bytes over its tenant's or the global job storage budget
├── JobConflict         (409) an Idempotency-Key reused for a different job request
├── JobNotFinished      (409) a job's results asked for before the job finished
├── JobExpired          (410) a job's results asked for after they expired or were deleted
├── JobActionRefused    (409) an operator's action on a job it does not apply to now (a retry of a
│                             job that did not fail, an expiry past the longest retention, ...)
├── BatchActionRefused  (409) an operator's action on a batch it does not apply to now (a cancel of a
│                             batch that has finished)
├── JobQueueUnavailable (503) the job queue (broker) refused a submission, which was undone
└── JobStoreUnavailable (503) the job store (JOB_STORE_URL) refused a job's inputs, or is down
Each class is defined here only: one table (ANSWERS in errors/answers.py) says how the API answers
each, and whether a worker retries it, as it does for tokenisation errors (embeddings.tokenization)
and Triton errors (embeddings.triton.errors).
"""

from __future__ import annotations

from embeddings.errors import EmbedsiteError


class ServiceError(EmbedsiteError):
    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class EmptyFile(ServiceError):
    pass


class InvalidRequest(ServiceError):
    pass


class UnsupportedByModel(InvalidRequest):
    """What only the model asked for refuses: more dimensions than it has, a prompt it lacks. The
    API's schema cannot say it (it is the same for every model), so the answer's code says it."""


class ObjectNotFound(ServiceError):
    """`code` names what was not found, as the API's own 404s do (`job_not_found`, ...)."""

    def __init__(self, message: str, *, param: str | None = None, code: str) -> None:
        super().__init__(message, param=param)
        self.code = code


class LimitExceeded(ServiceError):
    pass


class Overloaded(ServiceError):
    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class InferenceTimeout(ServiceError):
    """A request's inference did not finish by its deadline; what it had not sent was dropped."""


class ModelNotLoaded(ServiceError):
    """A registered model whose Triton model (pinned version) Triton does not serve now."""

    def __init__(self, *, model: str, triton_model: str, version: str) -> None:
        super().__init__(
            f"The model {model!r} is registered but not loaded on the model server (Triton model "
            f"{triton_model!r}, version {version or 'latest'}); retry later or use another model.",
            param="model",
        )
        self.model = model
        self.triton_model = triton_model
        self.version = version


class QuotaExceeded(ServiceError):
    """Refused by a quota: `reason` is "rate_limit_exceeded" (RPM, TPM, concurrency) or
    "insufficient_quota" (the daily or monthly budget); `kind` is "requests" or "tokens".
    `limit` names the limit the message names (a QuotaLimits field, e.g. "tokens_per_day") and
    `level` whose it is ("tenant" or "key"); both "" where no single limit refused."""

    def __init__(
        self,
        message: str,
        *,
        reason: str,
        kind: str,
        retry_after_s: int,
        headers: dict[str, str] | None = None,
        limit: str = "",
        level: str = "",
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.kind = kind
        self.retry_after_s = retry_after_s
        self.headers = headers or {}
        self.limit = limit
        self.level = level


class QuotaUnavailable(ServiceError):
    pass


class StorageBudgetExceeded(ServiceError):
    """A job would hold more bytes in the job store than a budget has room for (services/jobs/budget.py).

    `budget` is "tenant" or "global"; `fits_when_empty` says whether the job could ever fit (it
    is not larger than the budget itself), so waiting or deleting jobs can help.
    """

    def __init__(self, message: str, *, budget: str, fits_when_empty: bool) -> None:
        super().__init__(message, param="input")
        self.budget = budget
        self.fits_when_empty = fits_when_empty


class JobConflict(ServiceError):
    """An Idempotency-Key reused for a different job request (409 idempotency_key_reused)."""


class JobNotFinished(ServiceError):
    """A job's results asked for while the job still runs (409 job_not_finished)."""


class JobExpired(ServiceError):
    """A job's results asked for after they expired or the job was deleted (410 job_expired)."""


class JobActionRefused(ServiceError):
    """What an operator asked of a job (services/jobs/operator.py) does not apply to it now; the
    message says why, for the person who asked."""


class BatchActionRefused(ServiceError):
    """What an operator asked of a batch (services/openai_api/operator.py) does not apply to it now;
    the message says why, for the person who asked."""


class JobQueueUnavailable(ServiceError):
    """The broker refused a job's first chunks; the submission was undone (503)."""


class JobStoreUnavailable(ServiceError):
    """The job store refused a job's inputs (full) or did not answer; the submission was undone (503)."""
