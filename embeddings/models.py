"""Database models: the embedding models we serve, tenants, their API keys, quotas and usage."""

from __future__ import annotations

from datetime import datetime

from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models
from django.utils import timezone

from embeddings.model_tasks import ACTIVATIONS, INPUT_TYPES, OUTPUT_TYPES, TASK_EMBED, TASK_RERANK
from embeddings.result_dtypes import DEFAULT_RESULT_DTYPE, RESULT_DTYPE_CHOICES

TASK_CHOICES = [(TASK_EMBED, "Embedding"), (TASK_RERANK, "Rerank (cross-encoder)")]


class EmbeddingModel(models.Model):
    """A model clients can name, and the Triton model behind it."""

    name = models.CharField(max_length=200, unique=True, help_text="What clients send, e.g. all-MiniLM-L6-v2")
    aliases = models.JSONField(default=list, blank=True, help_text='Other names, e.g. ["minilm"]')
    triton_model = models.CharField(max_length=200)
    triton_version = models.CharField(max_length=20, blank=True, help_text="Blank: Triton's latest")
    dimensions = models.PositiveIntegerField()
    max_tokens = models.PositiveIntegerField(help_text="Inputs are truncated (or refused) above this")
    prompts = models.JSONField(
        default=dict,
        blank=True,
        help_text='Prompt name -> text prepended to inputs, e.g. {"query": "query: "}',
    )
    default_prompt_name = models.CharField(max_length=100, blank=True)
    input_types = models.JSONField(
        default=dict,
        blank=True,
        help_text="Input type (query, document, classification, clustering) -> the prompt a request's "
        'input_type picks, e.g. {"query": "query", "document": "passage"}; empty: every input type '
        "embeds alike",
    )
    max_inputs_per_request = models.PositiveIntegerField(
        null=True, blank=True, help_text="Blank: MAX_INPUTS_PER_REQUEST"
    )
    max_tokens_per_request = models.PositiveIntegerField(
        null=True, blank=True, help_text="Blank: MAX_TOKENS_PER_REQUEST"
    )
    owned_by = models.CharField(max_length=100, default="embedsite")
    enabled = models.BooleanField(default=True)
    result_dtype = models.CharField(
        max_length=10,
        choices=RESULT_DTYPE_CHOICES,
        default=DEFAULT_RESULT_DTYPE,
        help_text="How its jobs' results are stored unless a job asks otherwise: float16 takes half "
        "the job store's memory (cosine >= 0.9999 to float32); downloads are float32 either way",
    )
    task = models.CharField(
        max_length=10,
        choices=TASK_CHOICES,
        default=TASK_EMBED,
        help_text="What it answers: embeddings, or the relevance of documents to a query (rerank)",
    )
    rerank_by_similarity = models.BooleanField(
        default=False,
        help_text="An embedding model that also answers rerank requests: each document scored by the "
        "cosine similarity of its embedding to the query's, in [-1, 1] (a rerank model, where one is "
        "registered, is preferred)",
    )
    score_activation = models.CharField(
        max_length=10,
        blank=True,
        default="",
        choices=[("", "-")] + [(activation, activation) for activation in ACTIVATIONS],
        help_text="A rerank model's, from its export.json: applied to its raw scores (logits) unless a "
        "request asks for them raw (TEI's raw_scores); sigmoid gives scores in (0, 1)",
    )
    shared_embedding_cache = models.BooleanField(
        default=False,
        help_text="Every tenant's requests to this model share one embedding cache scope (when "
        "EMBEDDING_CACHE is on): a text one tenant embedded is a hit for all, and its speed tells "
        "them someone embedded it. Off: each tenant has its own, unless the tenant opts in",
    )
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def answers_to(self, name: str) -> bool:
        return name == self.name or name in (self.aliases or [])

    def clean(self) -> None:
        if self.rerank_by_similarity and self.task != TASK_EMBED:
            message = "Only an embedding model ranks by similarity; a rerank model ranks itself."
            raise ValidationError({"rerank_by_similarity": message})
        problem = input_types_problem(self.input_types, self.prompts)
        if problem:
            raise ValidationError({"input_types": problem})

    @property
    def ranks(self) -> bool:
        """Whether it answers rerank requests: a rerank model, or an embedding model allowed to."""
        return self.task == TASK_RERANK or self.rerank_by_similarity


def input_types_problem(input_types: object, prompts: object) -> str | None:
    """What is wrong with a model's input type -> prompt name mapping, or None."""
    if not isinstance(input_types, dict):
        return 'a JSON object of input type -> prompt name, e.g. {"query": "query"}'
    prompts = prompts if isinstance(prompts, dict) else {}
    for input_type, prompt_name in input_types.items():
        if input_type not in INPUT_TYPES:
            return f"unknown input type {input_type!r}; input types: {', '.join(INPUT_TYPES)}"
        if prompt_name not in prompts:
            return f"{input_type!r} names the prompt {prompt_name!r}, which is not one of the model's prompts"
    return None


class QuotaLimits(models.Model):
    """Limits a tenant (or one of its keys) is held to; blank means no limit at that level.

    A tenant's limits count everything its keys do together; a key's own limits count that key
    alone, on top of its tenant's (see embeddings/services/quotas/limits.py). Request and token rates are
    smooth (a sustained rate and a burst); the daily and monthly budgets are UTC calendar windows.
    """

    requests_per_second = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)], help_text="Sustained request rate"
    )
    requests_per_minute = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Sustained request rate: RPM/60 a second",
    )
    request_burst = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Requests that may arrive at once. Blank: one second of the request rate",
    )
    tokens_per_minute = models.PositiveBigIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Sustained token rate: TPM/60 a second",
    )
    token_burst = models.PositiveBigIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Tokens that may arrive at once, and so the largest request. "
        "Blank: one minute of the token rate",
    )
    tokens_per_day = models.PositiveBigIntegerField(null=True, blank=True, help_text="UTC day")
    tokens_per_month = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="UTC calendar month: the budget"
    )
    max_inputs_per_request = models.PositiveIntegerField(null=True, blank=True)
    max_concurrent_requests = models.PositiveIntegerField(null=True, blank=True)
    max_concurrent_jobs = models.PositiveIntegerField(null=True, blank=True)
    max_inputs_per_job = models.PositiveIntegerField(null=True, blank=True)

    QUOTA_FIELDS = (
        "requests_per_second",
        "requests_per_minute",
        "request_burst",
        "tokens_per_minute",
        "token_burst",
        "tokens_per_day",
        "tokens_per_month",
        "max_inputs_per_request",
        "max_concurrent_requests",
        "max_concurrent_jobs",
        "max_inputs_per_job",
    )

    def clean(self) -> None:
        super().clean()
        errors = {}
        if (
            self.request_burst is not None
            and self.requests_per_second is None
            and self.requests_per_minute is None
        ):
            errors["request_burst"] = "A burst needs a request rate (per second or per minute)."
        if self.token_burst is not None and self.tokens_per_minute is None:
            errors["token_burst"] = "A burst needs a token rate (tokens per minute)."
        if errors:
            raise ValidationError(errors)

    class Meta:
        abstract = True


class Tenant(QuotaLimits):
    name = models.CharField(max_length=200)
    slug = models.SlugField(max_length=100, unique=True)
    is_active = models.BooleanField(default=True)
    allow_all_models = models.BooleanField(default=True, help_text="Off: only the models listed below")
    allowed_models = models.ManyToManyField(EmbeddingModel, blank=True, related_name="tenants")
    created_at = models.DateTimeField(default=timezone.now)
    # Signs the tenant's job callbacks (services/accounts/tenants.py): Fernet ciphertext, never the plaintext.
    # The previous secret signs too until its overlap window ends, so receivers can switch over.
    webhook_secret_encrypted = models.TextField(blank=True, editable=False)
    webhook_secret_created_at = models.DateTimeField(null=True, blank=True, editable=False)
    webhook_previous_secret_encrypted = models.TextField(blank=True, editable=False)
    webhook_previous_secret_expires_at = models.DateTimeField(null=True, blank=True, editable=False)
    # Bytes its jobs may hold in the job store at once (services/jobs/budget.py).
    job_storage_budget_bytes = models.PositiveBigIntegerField(
        null=True,
        blank=True,
        help_text="Bytes this tenant's jobs may hold in the job store at once. "
        "Blank: JOB_STORAGE_TENANT_BUDGET_BYTES",
    )
    shared_embedding_cache = models.BooleanField(
        default=False,
        help_text="Its requests use the embedding cache scope shared by every tenant that opts in "
        "(when EMBEDDING_CACHE is on): more hits, and a fast answer tells it that another tenant "
        "embedded the same text. Off: its own scope, never read by another tenant",
    )

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class ApiKey(QuotaLimits):
    """A tenant's key. Only the public id and an HMAC of the secret are stored."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=200)
    public_id = models.CharField(max_length=32, unique=True, editable=False)
    secret_hash = models.CharField(max_length=64, editable=False)
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True, editable=False)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.name} (emb_{self.public_id}_…)"

    @property
    def prefix(self) -> str:
        return f"emb_{self.public_id}_"

    def is_revoked(self) -> bool:
        return self.revoked_at is not None

    def is_expired(self, now: datetime | None = None) -> bool:
        return self.expires_at is not None and self.expires_at <= (now or timezone.now())


class UsageBucket(models.Model):
    """What one key did with one model variant (its pinned export version and dtype) through one
    endpoint in one UTC hour.

    Written only by the usage fold (embeddings/services/quotas/usage.py), which adds Redis's counters here.
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="usage_buckets")
    # Null for work without a key (none yet) or whose key was deleted since.
    api_key = models.ForeignKey(
        ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="usage_buckets"
    )
    model = models.CharField(max_length=200, help_text="The catalog model's name")
    # The variant that served: traffic before and after a switch (float32 to int8, version 2 to 3)
    # lands in separate rows. Blank: not recorded (rows from before, or a model with no pinned version).
    model_version = models.CharField(
        max_length=20, blank=True, default="", help_text="The pinned export version that served"
    )
    model_dtype = models.CharField(
        max_length=32, blank=True, default="", help_text="That export's dtype (export.json): float32, int8, …"
    )
    endpoint = models.CharField(max_length=50)
    hour = models.DateTimeField(help_text="Start of the UTC hour")
    requests = models.PositiveBigIntegerField(default=0)
    succeeded = models.PositiveBigIntegerField(default=0)
    rejected = models.PositiveBigIntegerField(default=0, help_text="Refused by a quota or rate limit")
    failed = models.PositiveBigIntegerField(default=0, help_text="Accepted, then failed (e.g. Triton down)")
    inputs = models.PositiveBigIntegerField(default=0)
    tokens = models.PositiveBigIntegerField(default=0)
    # Of inputs and tokens, those answered from the embedding cache (services/inference/vector_cache.py).
    cached_inputs = models.PositiveBigIntegerField(default=0, help_text="Of inputs, answered from the cache")
    cached_tokens = models.PositiveBigIntegerField(default=0, help_text="Of tokens, answered from the cache")
    latency_ms_total = models.PositiveBigIntegerField(default=0, help_text="Sum, for the mean")

    class Meta:
        ordering = ["-hour"]
        # Two partial constraints rather than nulls_distinct=False, which SQLite lacks.
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "api_key", "model", "model_version", "model_dtype", "endpoint", "hour"],
                condition=models.Q(api_key__isnull=False),
                name="usage_bucket_unique_per_key_variant",
            ),
            models.UniqueConstraint(
                fields=["tenant", "model", "model_version", "model_dtype", "endpoint", "hour"],
                condition=models.Q(api_key__isnull=True),
                name="usage_bucket_unique_without_key_variant",
            ),
        ]
        indexes = [
            models.Index(fields=["tenant", "hour"]),
            # Every tenant's usage since an hour (the operations overview's tokens today): the
            # day's rows, not the table, whatever months of history it keeps.
            models.Index(fields=["hour"], name="usage_bucket_hour"),
        ]

    def __str__(self) -> str:
        model = self.model
        if self.model_version or self.model_dtype:
            model += f" ({self.model_version or '?'}, {self.model_dtype or '?'})"
        return f"{self.tenant_id}/{self.api_key_id}/{model}/{self.endpoint} @ {self.hour:%Y-%m-%d %H}:00"


class UsageFold(models.Model):
    """A batch of Redis counters already added to UsageBucket: the fold's record against counting twice."""

    batch_id = models.CharField(max_length=64, unique=True)
    folded_at = models.DateTimeField(default=timezone.now)
    rows = models.PositiveIntegerField(default=0)


# Every id job submission draws (services/jobs/submission.py _new_public_id).
JOB_ID_PATTERN = r"job_[a-z0-9]{24}"


class EmbeddingJob(models.Model):
    """An asynchronous embedding job: its inputs and results live in Redis (services/jobs/store.py),
    its state here. Status moves queued -> running -> completed | failed | cancelled, with
    cancelling between running and cancelled, and expired once its results are gone."""

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        COMPLETED = "completed"
        FAILED = "failed"
        CANCELLING = "cancelling"
        CANCELLED = "cancelled"
        EXPIRED = "expired"

    FINISHED = (Status.COMPLETED, Status.FAILED, Status.CANCELLED, Status.EXPIRED)
    # Its chunks may still run: the engine works on it.
    ACTIVE = (Status.QUEUED, Status.RUNNING, Status.CANCELLING)

    public_id = models.CharField(max_length=40, unique=True, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="jobs")
    kind = models.CharField(
        max_length=32,
        default="embeddings",
        editable=False,
        help_text="How its chunks are embedded (settings.JOB_KINDS): embeddings, or a batch's lines",
    )
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs")
    model = models.ForeignKey(EmbeddingModel, on_delete=models.PROTECT, related_name="jobs")
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.QUEUED)
    # How the job was asked for.
    encoding_format = models.CharField(max_length=10, default="float")
    dimensions = models.PositiveIntegerField(null=True, blank=True)
    normalize = models.BooleanField(default=True)
    metadata = models.JSONField(default=dict, blank=True)
    callback_url = models.URLField(max_length=2000, blank=True)
    idempotency_key = models.CharField(max_length=255, blank=True)
    request_fingerprint = models.CharField(max_length=64, blank=True, help_text="SHA-256 of the request")
    # Its shape: inputs in `chunks` chunks of `chunk_size` (the last may be shorter).
    total = models.PositiveIntegerField(default=0)
    chunk_size = models.PositiveIntegerField(default=0)
    chunks = models.PositiveIntegerField(default=0)
    dims = models.PositiveIntegerField(default=0, help_text="Width of the stored vectors")
    result_dtype = models.CharField(
        max_length=10,
        choices=RESULT_DTYPE_CHOICES,
        default=DEFAULT_RESULT_DTYPE,
        help_text="How the stored vectors are encoded (the request's, else the model's)",
    )
    output_type = models.CharField(
        max_length=10,
        choices=[(name, name) for name in OUTPUT_TYPES],
        default="float",
        help_text="The vectors' type (the request's output_dtype): float (stored as result_dtype), or "
        "int8/uint8/binary/ubinary, stored and downloaded in that type",
    )
    input_type = models.CharField(
        max_length=20, blank=True, help_text="What the inputs are for (picks the model's prompt); blank: none"
    )
    has_ids = models.BooleanField(default=False, help_text="The upload gave ids, kept in results")
    # Progress, mirrored from Redis.
    completed = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    # Of prompt_tokens, those the embedding cache answered.
    cached_tokens = models.PositiveBigIntegerField(default=0)
    reserved_tokens = models.PositiveBigIntegerField(default=0, help_text="Held against quotas until settled")
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    error_code = models.CharField(max_length=100, blank=True)
    error_message = models.TextField(blank=True)
    callback_attempts = models.PositiveIntegerField(default=0)
    callback_delivered_at = models.DateTimeField(null=True, blank=True)
    callback_error = models.CharField(
        max_length=500, blank=True, help_text="Why the last callback attempt failed or was refused"
    )

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "idempotency_key"],
                condition=~models.Q(idempotency_key=""),
                name="job_idempotency_key_unique_per_tenant",
            )
        ]
        indexes = [
            models.Index(fields=["tenant", "-created_at"]),
            models.Index(fields=["status"]),
            # The admin's jobs list, newest first across tenants: read from the index, not sorted.
            models.Index(fields=["-created_at", "-id"], name="job_newest_first"),
        ]

    def __str__(self) -> str:
        return f"{self.public_id} ({self.status})"

    @property
    def is_finished(self) -> bool:
        return self.status in self.FINISHED


class JobStorageHold(models.Model):
    """The bytes one job holds in the job store, as admission counted them (services/jobs/budget.py).

    Made before the job's inputs are stored, lowered when they are freed, deleted with the job's
    data: a tenant's stored bytes are the sum of its holds, and everyone's the sum of all.
    """

    public_id = models.CharField(max_length=40, unique=True, help_text="The job's")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="job_storage_holds")
    stored_bytes = models.PositiveBigIntegerField(help_text="Held now")
    input_bytes = models.PositiveBigIntegerField(help_text="The inputs' part, freed when the job ends")
    kept_bytes = models.PositiveBigIntegerField(help_text="Ids and bookkeeping, kept until expiry")
    result_bytes = models.PositiveBigIntegerField(help_text="The results' part if every input succeeds")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [models.Index(fields=["tenant", "stored_bytes"])]

    def __str__(self) -> str:
        return f"{self.public_id}: {self.stored_bytes} bytes"


class StoredFile(models.Model):
    """A file of OpenAI's Files API (/v1/files): its bytes in the "files" storage, its facts here."""

    class Purpose(models.TextChoices):
        BATCH = "batch"
        BATCH_OUTPUT = "batch_output"

    public_id = models.CharField(max_length=40, unique=True, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="files")
    purpose = models.CharField(max_length=20, choices=Purpose.choices)
    filename = models.CharField(max_length=255)
    bytes = models.PositiveBigIntegerField(default=0)
    storage_name = models.CharField(max_length=255, help_text="Its name in the files storage")
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name = "file"  # what the API and an operator call it
        indexes = [
            models.Index(fields=["tenant", "created_at"]),
            models.Index(fields=["expires_at"]),
            # The admin's files list, newest first across tenants.
            models.Index(fields=["-created_at", "-id"], name="file_newest_first"),
        ]

    def __str__(self) -> str:
        return f"{self.public_id} ({self.filename})"


class Batch(models.Model):
    """A batch of OpenAI's Batch API (/v1/batches), run as an EmbeddingJob whose inputs are its lines."""

    class Status(models.TextChoices):
        VALIDATING = "validating"
        FAILED = "failed"
        IN_PROGRESS = "in_progress"
        FINALIZING = "finalizing"
        COMPLETED = "completed"
        EXPIRED = "expired"
        CANCELLING = "cancelling"
        CANCELLED = "cancelled"

    public_id = models.CharField(max_length=40, unique=True, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="batches")
    api_key = models.ForeignKey(
        ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="batches"
    )
    job = models.OneToOneField(
        EmbeddingJob, null=True, blank=True, on_delete=models.SET_NULL, related_name="batch"
    )
    input_file_public_id = models.CharField(max_length=40)
    input_file = models.ForeignKey(
        StoredFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    output_file = models.ForeignKey(
        StoredFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    error_file = models.ForeignKey(
        StoredFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    endpoint = models.CharField(max_length=64)
    completion_window = models.CharField(max_length=16)
    metadata = models.JSONField(null=True, blank=True)
    model = models.CharField(max_length=200, blank=True, help_text="The first line's model")
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.VALIDATING)
    # Per-line problems found while validating (OpenAI's errors.data[]), at most BATCH_MAX_ERRORS_KEPT.
    errors = models.JSONField(default=list, blank=True)
    total = models.PositiveIntegerField(default=0)
    completed = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    invalid_lines = models.PositiveIntegerField(default=0, help_text="Lines refused while validating")
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)
    in_progress_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    # When a worker last took the batch's validation or finalisation (the watchdog re-sends stale ones).
    handed_out_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name_plural = "batches"
        indexes = [
            models.Index(fields=["tenant", "-created_at"]),
            models.Index(fields=["status"]),
            # The admin's batches list, newest first across tenants.
            models.Index(fields=["-created_at", "-id"], name="batch_newest_first"),
        ]

    def __str__(self) -> str:
        return f"{self.public_id}: {self.status}"
