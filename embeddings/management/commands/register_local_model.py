"""Register the locally exported model so a first run can serve it (setup runs this)."""

from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from embeddings.services.catalog import embedding_model_register_local
from embeddings.services.model_export import ModelExportError, model_export_info


class Command(BaseCommand):
    help = (
        "Register model_repository/minilm (export.json) as the all-MiniLM-L6-v2 embedding model, "
        "after checking that model.onnx is the file export.json describes."
    )

    def handle(self, *args, **options):
        repository = Path(settings.TRITON_MODEL_REPOSITORY)
        try:
            # A model.onnx that is not the recorded export would be served under the wrong description.
            model_export_info(repository_dir=repository, name="minilm")
            model = embedding_model_register_local(repository=repository)
        except (FileNotFoundError, ModelExportError) as error:
            raise CommandError(str(error)) from error
        self.stdout.write(
            f"registered {model.name} -> Triton model {model.triton_model} ({model.dimensions}-d)"
        )
