"""Database models: the embedding models we serve, tenants and their API keys."""

from __future__ import annotations

from datetime import datetime

from django.db import models
from django.utils import timezone


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
    max_inputs_per_request = models.PositiveIntegerField(
        null=True, blank=True, help_text="Blank: MAX_INPUTS_PER_REQUEST"
    )
    max_tokens_per_request = models.PositiveIntegerField(
        null=True, blank=True, help_text="Blank: MAX_TOKENS_PER_REQUEST"
    )
    owned_by = models.CharField(max_length=100, default="embedsite")
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def answers_to(self, name: str) -> bool:
        return name == self.name or name in (self.aliases or [])


class Tenant(models.Model):
    name = models.CharField(max_length=200)
    slug = models.SlugField(max_length=100, unique=True)
    is_active = models.BooleanField(default=True)
    allow_all_models = models.BooleanField(default=True, help_text="Off: only the models listed below")
    allowed_models = models.ManyToManyField(EmbeddingModel, blank=True, related_name="tenants")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class ApiKey(models.Model):
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
