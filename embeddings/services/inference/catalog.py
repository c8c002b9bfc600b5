"""The embedding models clients can name: lookup (cached per process), listing, registration."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from asgiref.sync import sync_to_async
from django.conf import settings

from embeddings.errors import EmbedsiteError
from embeddings.model_tasks import ACTIVATION_IDENTITY
from embeddings.models import TASK_EMBED, TASK_RERANK, EmbeddingModel, input_types_problem
from embeddings.services.inference.exports import (
    DTYPE_FLOAT32,
    DTYPES,
    EXPORT_INFO_FILENAME,
    ModelExportError,
    dtype_with_article,
    model_export_dtype,
    model_export_info,
    model_export_latest_of_dtype,
    model_export_version_dir,
    model_export_versions,
)
from embeddings.single_flight import SingleFlight

if TYPE_CHECKING:
    from embeddings.callers import Caller

LOCAL_MODEL_NAME = "all-MiniLM-L6-v2"
LOCAL_MODEL_ALIASES = ["minilm", "sentence-transformers/all-MiniLM-L6-v2"]

_enabled_cache: tuple[float, tuple[EmbeddingModel, ...]] | None = None
_enabled_reads: SingleFlight[tuple[EmbeddingModel, ...]] = SingleFlight()


def embedding_models_enabled() -> tuple[EmbeddingModel, ...]:
    return tuple(EmbeddingModel.objects.filter(enabled=True).order_by("name"))


async def _enabled_cached() -> tuple[EmbeddingModel, ...]:
    # Every request names a model: read the few rows once every MODEL_CACHE_SECONDS, not per request
    # (and once for all the requests that find the cache expired together).
    now = time.monotonic()
    if _enabled_cache is None or now - _enabled_cache[0] > settings.MODEL_CACHE_SECONDS:
        return await _enabled_reads.run("enabled", _enabled_read)
    return _enabled_cache[1]


async def _enabled_read() -> tuple[EmbeddingModel, ...]:
    global _enabled_cache
    read_at = time.monotonic()
    models = await sync_to_async(_enabled_with_variants)()
    _enabled_cache = (read_at, models)
    return models


def _enabled_with_variants() -> tuple[EmbeddingModel, ...]:
    """The enabled models, each one's variant read with them (in this thread, off the event loop):
    the requests served from this read then find their variant remembered."""
    models = embedding_models_enabled()
    for model in models:
        _variant_read(model.triton_model, model.triton_version)
    return models


def embedding_model_cache_clear() -> None:
    global _enabled_cache
    _enabled_cache = None
    _variants.clear()


@dataclass(frozen=True)
class ModelVariant:
    """What serves a catalog model: its pinned export version and that export's dtype (float32,
    int8, ... as its export.json records it). Blank: not known (no version pinned, which Triton may
    answer from any version; an export.json gone or unreadable)."""

    version: str
    dtype: str


NO_VARIANT = ModelVariant("", "")
# A dtype as usage records it (a field of a Redis hash key part, a column): plain word characters.
RECORDABLE_DTYPE = re.compile(r"[A-Za-z0-9_]{1,32}")
# (Triton model, pinned version) -> (when read, its variant); read again after MODEL_CACHE_SECONDS,
# as the catalog rows are, since exporting a version again may change its dtype.
_variants: dict[tuple[str, str], tuple[float, ModelVariant]] = {}
_VARIANTS_KEPT = 256


def embedding_model_variant(*, model: EmbeddingModel) -> ModelVariant:
    """The variant serving `model`, for its usage to record: remembered per process, so a request
    reads no file (the catalog's read refreshes it for every enabled model); only what is not
    remembered, or older than MODEL_CACHE_SECONDS, reads the version's export.json (one small
    file; never model.onnx)."""
    remembered = _variants.get((model.triton_model, model.triton_version))
    if remembered is not None and time.monotonic() - remembered[0] <= settings.MODEL_CACHE_SECONDS:
        return remembered[1]
    return _variant_read(model.triton_model, model.triton_version)


def _variant_read(triton_model: str, triton_version: str) -> ModelVariant:
    read_at = time.monotonic()
    variant = _variant_of_export(triton_model, triton_version)
    if len(_variants) >= _VARIANTS_KEPT:
        _variants.clear()
    _variants[(triton_model, triton_version)] = (read_at, variant)
    return variant


def _variant_of_export(triton_model: str, triton_version: str) -> ModelVariant:
    if not (triton_version.isascii() and triton_version.isdigit()):
        return NO_VARIANT
    try:
        version_dir = model_export_version_dir(
            repository_dir=Path(settings.TRITON_MODEL_REPOSITORY), name=triton_model, version=triton_version
        )
        info = json.loads((version_dir / EXPORT_INFO_FILENAME).read_text(encoding="utf-8"))
        dtype = model_export_dtype(info)
    except (OSError, ValueError, AttributeError, ModelExportError):
        return ModelVariant(triton_version, "")
    recordable = isinstance(dtype, str) and RECORDABLE_DTYPE.fullmatch(dtype) is not None
    return ModelVariant(triton_version, dtype if recordable else "")


async def embedding_model_resolve(*, name: str) -> EmbeddingModel | None:
    """An enabled model by its name or one of its aliases, from the per-process cache."""
    return next((model for model in await _enabled_cached() if model.answers_to(name)), None)


async def embedding_models_enabled_cached() -> tuple[EmbeddingModel, ...]:
    """The enabled models, from the per-process cache (MODEL_CACHE_SECONDS)."""
    return await _enabled_cached()


async def embedding_models_for_caller(*, caller: Caller) -> list[EmbeddingModel]:
    return [model for model in await _enabled_cached() if caller.may_use(model)]


async def rerank_model_default(*, caller: Caller) -> EmbeddingModel | None:
    """The model that answers a rerank request naming none (TEI's /rerank): the caller's first
    rerank model (a cross-encoder ranks better than any similarity), else the default embedding
    model if it ranks, else the first other that does; None when the caller may use none."""
    usable = [model for model in await _enabled_cached() if model.ranks and caller.may_use(model)]
    preferred = sorted(
        usable,
        key=lambda model: (model.task != TASK_RERANK, not model.answers_to(settings.DEFAULT_EMBEDDING_MODEL)),
    )
    return preferred[0] if preferred else None


class CatalogError(EmbedsiteError):
    """A registration the catalog refuses: no such export, a name already taken, a bad prompt."""


def embedding_model_register(
    *,
    triton_model: str,
    version: int | None = None,
    dtype: str | None = None,
    name: str | None = None,
    aliases: Sequence[str] | None = None,
    prompts: Mapping[str, str] | None = None,
    input_types: Mapping[str, str] | None = None,
    default_prompt_name: str | None = None,
    enabled: bool | None = None,
    rerank_by_similarity: bool | None = None,
    repository: Path | None = None,
) -> EmbeddingModel:
    """Create or update the catalog row `name` for a finished export of `triton_model` (`version`):
    its dimensions and maximum tokens come from that version's export.json. Without a name: the one
    row serving `triton_model`, else the Triton model's name. Without a version: the row's pinned
    one, else the latest export. With a `dtype` (float32, int8, float16) and no version: the newest
    export of that dtype (an int8 or float16 export is a new version of the same Triton model); with
    both, the version must be of that dtype. Aliases, prompts, `enabled` and `rerank_by_similarity`
    given replace the row's; omitted, they are kept (a new row is enabled, and ranks only if it is a
    rerank model). Its task (embed or rerank) is the export's. Loading it into Triton is
    `models_reconcile`'s (services/inference/serving.py)."""
    repository = Path(repository or settings.TRITON_MODEL_REPOSITORY)
    if name is None:
        # The row already serving this Triton model, when there is exactly one.
        serving = list(EmbeddingModel.objects.filter(triton_model=triton_model)[:2])
        name = serving[0].name if len(serving) == 1 else triton_model
    existing = EmbeddingModel.objects.filter(name=name).first()
    versions = model_export_versions(repository_dir=repository, name=triton_model)
    pinned = existing.triton_version if existing and existing.triton_model == triton_model else ""
    if dtype is not None and dtype not in DTYPES:
        raise CatalogError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if version is None and dtype is not None:
        # Asking for a dtype is asking for a (possibly) different version than the pinned one.
        version = model_export_latest_of_dtype(repository_dir=repository, name=triton_model, dtype=dtype)
        if version is None:
            found = ", ".join(map(str, versions)) or "none"
            raise CatalogError(
                f"{triton_model} has no finished {dtype} export (finished versions: {found}); "
                f"export one first (manage.py export_model --name {triton_model} --dtype {dtype})"
            )
    if version is None and pinned.isdigit():
        # Registering again keeps the pin: a new export never changes a tenant's vectors unasked.
        version = int(pinned)
    if version is None:
        if not versions:
            raise CatalogError(
                f"{repository / triton_model} has no finished export: run manage.py export_model first"
            )
        version = versions[-1]
    elif version not in versions:
        found = ", ".join(map(str, versions)) or "none"
        raise CatalogError(
            f"{triton_model} has no finished export version {version} (finished: {found}); "
            "export it first (manage.py export_model)"
        )
    try:
        info = model_export_info(repository_dir=repository, name=triton_model, version=version)
    except ModelExportError as error:
        raise CatalogError(str(error)) from error
    if dtype is not None and model_export_dtype(info) != dtype:
        raise CatalogError(
            f"{triton_model} version {version} is "
            f"{dtype_with_article(model_export_dtype(info))} export, not {dtype}"
        )
    aliases = list(aliases) if aliases is not None else (existing.aliases if existing else [])
    prompts = dict(prompts) if prompts is not None else (existing.prompts if existing else {})
    input_types = dict(input_types) if input_types is not None else (existing.input_types if existing else {})
    problem = input_types_problem(input_types, prompts)
    if problem:
        raise CatalogError(f"input types: {problem}")
    if default_prompt_name is None:
        default_prompt_name = existing.default_prompt_name if existing else ""
    if default_prompt_name and default_prompt_name not in prompts:
        raise CatalogError(f"the default prompt {default_prompt_name!r} is not one of its prompts")
    if enabled is None:
        enabled = existing.enabled if existing else True
    task = info.get("task", TASK_EMBED)
    if rerank_by_similarity is None:
        rerank_by_similarity = existing.rerank_by_similarity if existing else False
    if rerank_by_similarity and task != TASK_EMBED:
        raise CatalogError(f"{name} is a {task} model: only an embedding model ranks by similarity")
    _check_names_free(name=name, aliases=aliases, exclude=existing)
    model, _ = EmbeddingModel.objects.update_or_create(
        name=name,
        defaults={
            "aliases": aliases,
            "triton_model": triton_model,
            "triton_version": str(version),
            "dimensions": int(info["dims"]),
            "max_tokens": int(info["max_tokens"]),
            "prompts": prompts,
            "input_types": input_types,
            "default_prompt_name": default_prompt_name,
            "enabled": enabled,
            "task": task,
            "rerank_by_similarity": rerank_by_similarity,
            # Exports from before activations were recorded: a cross-encoder's logit is the score.
            "score_activation": (info.get("activation") or ACTIVATION_IDENTITY)
            if task == TASK_RERANK
            else "",
        },
    )
    embedding_model_cache_clear()
    return model


AGREEMENT_FIELDS = ("min_cosine", "mean_cosine", "recall_at_10", "text_count")


def embedding_model_dtype(*, model: EmbeddingModel, repository: Path | None = None) -> dict:
    """What the model's pinned export runs (GET /v1/models, /ready): {"dtype": "float32" | "int8" |
    "float16", "agreement": null for float32, else the variant's recorded agreement with its float32
    graph ({"reference": "float32", min and mean cosine, recall@10, over how many held-out texts})}.
    dtype is null when the export cannot be read (gone, or not the model.onnx its export.json
    describes). Read through model_export_info, which hashes model.onnx once per file version: a few
    small reads, never on the embedding path."""
    repository = Path(repository or settings.TRITON_MODEL_REPOSITORY)
    try:
        info = model_export_info(
            repository_dir=repository, name=model.triton_model, version=model.triton_version or None
        )
    except (OSError, ValueError, ModelExportError):
        return {"dtype": None, "agreement": None}
    dtype = model_export_dtype(info)
    record = info.get(dtype) if dtype != DTYPE_FLOAT32 else None
    if not isinstance(record, dict):
        return {"dtype": dtype, "agreement": None}
    return {
        "dtype": dtype,
        "agreement": {"reference": DTYPE_FLOAT32, **{field: record.get(field) for field in AGREEMENT_FIELDS}},
    }


def _check_names_free(*, name: str, aliases: Sequence[str], exclude: EmbeddingModel | None) -> None:
    """Every name a client may send must pick one model: refuse one another row answers to."""
    others = (
        EmbeddingModel.objects.all() if exclude is None else EmbeddingModel.objects.exclude(pk=exclude.pk)
    )
    for other in others:
        for wanted in (name, *aliases):
            if other.answers_to(wanted):
                raise CatalogError(f"{wanted!r} already names the model {other.name!r}")


def embedding_model_register_local(*, repository: Path, triton_model: str = "minilm") -> EmbeddingModel:
    """Register (idempotently) the model `export_model` wrote, version 1, so a first run can serve it
    (and rank by similarity, unless an operator has turned that off since)."""
    return embedding_model_register(
        triton_model=triton_model,
        version=1,
        name=LOCAL_MODEL_NAME,
        aliases=LOCAL_MODEL_ALIASES,
        rerank_by_similarity=local_model_ranks(),
        repository=repository,
    )


def local_model_ranks() -> bool | None:
    """The bundled model ranks by similarity from its first registration (so `make run` serves
    rerank); None once registered, so an operator who turned that off keeps it off."""
    return None if EmbeddingModel.objects.filter(name=LOCAL_MODEL_NAME).exists() else True
