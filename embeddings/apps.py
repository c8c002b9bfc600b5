"""Django app configuration for embeddings."""

from django.apps import AppConfig


class EmbeddingsConfig(AppConfig):
    name = "embeddings"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from embedsite import process_start

        process_start.end()  # Django is set up: what start-up built is frozen, collecting resumes
