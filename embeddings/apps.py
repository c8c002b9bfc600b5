"""Django app configuration for embeddings."""

from django.apps import AppConfig


class EmbeddingsConfig(AppConfig):
    name = "embeddings"
    default_auto_field = "django.db.models.BigAutoField"
