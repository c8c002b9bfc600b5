"""Django app configuration for embeddings."""

from django.apps import AppConfig


class EmbeddingsConfig(AppConfig):
    name = "embeddings"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Registers the OpenAPI extensions with drf-spectacular (they register on import).
        from embeddings.api import schema  # noqa: F401
