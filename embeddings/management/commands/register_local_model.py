"""Register the locally exported MiniLM (version 1) so a first run can serve it (setup runs this)."""

from embeddings.management.commands.register_model import Command as RegisterModelCommand
from embeddings.services.inference.catalog import LOCAL_MODEL_ALIASES, LOCAL_MODEL_NAME, local_model_ranks


class Command(RegisterModelCommand):
    # Setup and every `docker compose up` run this: a MiniLM an admin disabled stays disabled.
    enabled_unless_disabled = None
    help = (
        "Register model_repository/minilm version 1 as the all-MiniLM-L6-v2 embedding model (ranking by "
        "similarity unless turned off since), after checking that model.onnx is the file export.json "
        "describes; load it when Triton runs."
    )

    def add_arguments(self, parser) -> None:
        pass

    def handle(self, *args, **options):
        super().handle(
            triton_model="minilm",
            version=1,
            name=LOCAL_MODEL_NAME,
            aliases=LOCAL_MODEL_ALIASES,
            prompts=None,
            default_prompt=None,
            disable=False,
            rerank_by_similarity=local_model_ranks(),
        )
