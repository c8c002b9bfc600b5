"""Register an exported model in the catalog and load it into the running Triton."""

import argparse

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from embeddings.services.inference.catalog import (
    CatalogError,
    embedding_model_cache_clear,
    embedding_model_dtype,
    embedding_model_register,
)
from embeddings.services.inference.exports import DTYPE_FLOAT32, DTYPE_INT8, DTYPES
from embeddings.services.inference.serving import models_reconcile
from embeddings.triton import TritonError

# The Triton configuration whose backend (embedsite_torch) rebuilds BERT from float weights: it
# refuses to load an int8 export (embeddings/in_triton/backends/embedsite_torch/encoder.py).
GPU_TORCH_CONFIG_NAME = "bundled-gpu"


def prompt_pair(value: str) -> tuple[str, str]:
    name, separator, text = value.partition("=")
    if not separator or not name:
        raise ValueError(value)
    return name, text


class Command(BaseCommand):
    help = (
        "Add (or update) a catalog model for a finished export (dimensions and maximum tokens from its "
        "export.json), then load it into Triton. Triton not running: registered, loaded when the stack "
        "starts."
    )

    # Registering means "serve it": a model disabled before is enabled again unless --disable.
    enabled_unless_disabled: bool | None = True

    def create_parser(self, prog_name: str, subcommand: str, **kwargs) -> CommandParser:
        # --version is the export version here, not Django's own version flag.
        return super().create_parser(prog_name, subcommand, conflict_handler="resolve", **kwargs)

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--triton-model", required=True, help="The model folder's name in the repository")
        parser.add_argument(
            "--version",
            type=int,
            help="The export version to serve (default: the one the model serves now, else the latest)",
        )
        parser.add_argument(
            "--dtype",
            choices=DTYPES,
            help="Serve the newest export of this dtype (export_model --dtype int8 or float16 writes "
            "those); with --version, that version must be of it",
        )
        parser.add_argument(
            "--name",
            help="What clients send (default: the catalog model serving --triton-model, else its name)",
        )
        parser.add_argument("--alias", action="append", dest="aliases", help="Another name (repeatable)")
        parser.add_argument(
            "--prompt",
            action="append",
            type=prompt_pair,
            dest="prompts",
            metavar="NAME=TEXT",
            help='A prompt clients may name, e.g. --prompt "query=query: " (repeatable)',
        )
        parser.add_argument("--default-prompt", help="The prompt used when a request names none")
        parser.add_argument(
            "--input-type",
            action="append",
            type=prompt_pair,
            dest="input_types",
            metavar="TYPE=PROMPT",
            help="The prompt a request's input_type picks (query, document, classification, clustering), "
            "e.g. --input-type query=query --input-type document=passage (repeatable)",
        )
        parser.add_argument("--disable", action="store_true", help="Register it disabled (not loaded)")
        parser.add_argument(
            "--rerank-by-similarity",
            action=argparse.BooleanOptionalAction,
            help="Let an embedding model answer rerank requests by cosine similarity (default: as it was; "
            "off for a new model)",
        )

    def handle(
        self,
        *args,
        triton_model,
        version,
        name,
        aliases,
        dtype=None,
        prompts,
        default_prompt,
        disable,
        rerank_by_similarity=None,
        input_types=None,
        **options,
    ):
        try:
            model = embedding_model_register(
                triton_model=triton_model,
                version=version,
                dtype=dtype,
                name=name,
                aliases=aliases,
                prompts=dict(prompts) if prompts is not None else None,
                input_types=dict(input_types) if input_types is not None else None,
                default_prompt_name=default_prompt,
                enabled=False if disable else self.enabled_unless_disabled,
                rerank_by_similarity=rerank_by_similarity,
            )
        except CatalogError as error:
            raise CommandError(str(error)) from error
        ranks = ", ranks by similarity" if model.rerank_by_similarity else ""
        served = embedding_model_dtype(model=model)["dtype"]
        variant = f", {served}" if served not in (DTYPE_FLOAT32, None) else ""
        self.stdout.write(
            f"registered {model.name} -> Triton model {model.triton_model} version {model.triton_version} "
            f"({model.dimensions}-d, {model.max_tokens} tokens{variant}{ranks})"
            f"{'' if model.enabled else ', disabled'}"
        )
        if served == DTYPE_INT8 and settings.TRITON_MODEL_CONFIG_NAME == GPU_TORCH_CONFIG_NAME:
            self.stderr.write(
                self.style.WARNING(
                    f"warning: {model.triton_model} version {model.triton_version} is an int8 export and "
                    f"TRITON_MODEL_CONFIG_NAME={GPU_TORCH_CONFIG_NAME} loads it with embedsite_torch, "
                    "which runs float weights only: Triton will refuse it. Serve int8 with the CPU "
                    "config, or pin a float32 export for the GPU (--dtype float32)."
                )
            )
        self.load(model)

    def load(self, model) -> None:
        try:
            # Enabled, unload=False: a new version pinned serves next to the old until the periodic
            # reconcile (processes cache the catalog). Disabled: it leaves Triton now.
            states = models_reconcile(unload=not model.enabled, triton_models=[model.triton_model])
        except TritonError as error:
            self.stdout.write(
                f"Triton is not reachable ({type(error).__name__}): {model.name} loads when the stack starts"
            )
            return
        state = next(state for state in states if state.name == model.name)
        if not model.enabled:
            self.stdout.write(f"{model.name} is disabled: {'still loaded' if state.ready else 'not loaded'}")
        elif state.ready:
            self.stdout.write(self.style.SUCCESS(f"{model.name} is loaded in Triton and serving"))
        else:
            model.enabled = False
            model.save(update_fields=["enabled"])
            embedding_model_cache_clear()
            raise CommandError(
                f"Triton could not load {model.triton_model} version {model.triton_version or 'latest'}: "
                f"{state.reason or state.state or 'unknown reason'}. {model.name} is registered, disabled."
            )
