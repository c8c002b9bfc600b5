"""Register the locally exported model so a first run can serve it (setup runs this)."""

from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from embeddings.services.catalog import embedding_model_register_local


class Command(BaseCommand):
    help = "Register model_repository/minilm (export.json) as the all-MiniLM-L6-v2 embedding model."

    def handle(self, *args, **options):
        try:
            model = embedding_model_register_local(repository=Path(settings.TRITON_MODEL_REPOSITORY))
        except FileNotFoundError as error:
            raise CommandError(str(error)) from error
        self.stdout.write(
            f"registered {model.name} -> Triton model {model.triton_model} ({model.dimensions}-d)"
        )
