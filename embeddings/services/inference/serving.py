"""Which catalog models Triton serves: loads, unloads and version pins reconciled with the catalog.

The catalog (EmbeddingModel rows) says what should be served; Triton runs with explicit model
control, so nothing is served until it is loaded. `models_reconcile` makes Triton match the
catalog: each Triton model named by an enabled row is loaded with exactly the pinned versions
(a config override with `version_policy { specific }`), one no enabled row names is unloaded.
Triton models the catalog does not name (the tokenizer, the text ensemble) are never touched.

`embedding_model_engine` says which engine answers a served model (ONNX Runtime on CPU or CUDA,
TensorRT, PyTorch) and in what precision, from the configuration Triton loaded it with.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import DatabaseError
from google.protobuf import json_format, text_format

from embeddings.models import EmbeddingModel
from embeddings.services.inference.catalog import embedding_model_dtype
from embeddings.services.inference.clients import triton_async_client, triton_sync_client
from embeddings.services.inference.exports import model_export_versions
from embeddings.triton import (
    AsyncTritonClient,
    ModelSpec,
    RepositoryModel,
    TritonClient,
    TritonError,
    TritonModelError,
)
from embeddings.triton.protocol import model_config_pb2

logger = logging.getLogger(__name__)

READY = "READY"
# Triton's states of a version that holds (or will hold) resources: an unload is needed.
_LOADED_STATES = {"READY", "LOADING"}


@dataclass(frozen=True)
class ModelServingState:
    """What Triton says of one catalog row's model version."""

    name: str
    triton_model: str
    # The pinned version; "" for Triton's latest.
    version: str
    # Triton's state: "READY", "UNAVAILABLE", "LOADING", "UNLOADING"; "" when never loaded.
    state: str
    reason: str

    @property
    def ready(self) -> bool:
        return self.state == READY


class ModelConfigMissing(TritonModelError):
    """The model folder has no configuration file for TRITON_MODEL_CONFIG_NAME."""


def model_config_path(*, triton_model: str) -> Path:
    """The config file Triton reads for `triton_model` (TRITON_MODEL_CONFIG_NAME picks it)."""
    model_dir = Path(settings.TRITON_MODEL_REPOSITORY) / triton_model
    config_name = settings.TRITON_MODEL_CONFIG_NAME
    return model_dir / "configs" / f"{config_name}.pbtxt" if config_name else model_dir / "config.pbtxt"


def model_config_override(*, triton_model: str, versions: Iterable[str]) -> str:
    """The model's own configuration as JSON, serving exactly `versions`: a load's "config"."""
    path = model_config_path(triton_model=triton_model)
    if not path.is_file():
        raise ModelConfigMissing(
            f"{path} is missing: export the model first (manage.py export_model)", model=triton_model
        )
    config = text_format.Parse(path.read_text(encoding="utf-8"), model_config_pb2.ModelConfig())
    config.version_policy.specific.versions[:] = sorted(int(version) for version in versions)
    return json_format.MessageToJson(config)


def _latest_export(triton_model: str) -> str:
    versions = model_export_versions(repository_dir=Path(settings.TRITON_MODEL_REPOSITORY), name=triton_model)
    return str(versions[-1]) if versions else ""


def _desired_versions(rows: Sequence[EmbeddingModel]) -> set[str] | None:
    """The versions the enabled `rows` pin; None when all leave it to Triton (plain load).

    A blank pin next to explicit ones stands for the latest finished export on disk.
    """
    pinned = {row.triton_version for row in rows}
    if pinned == {""}:
        return None
    if "" in pinned:
        pinned.discard("")
        latest = _latest_export(rows[0].triton_model)
        if latest:
            pinned.add(latest)
    return pinned


def _loaded_versions(index: Sequence[RepositoryModel], triton_model: str, states: set[str]) -> set[str]:
    return {entry.version for entry in index if entry.name == triton_model and entry.state in states}


def serving_states(
    rows: Iterable[EmbeddingModel], index: Sequence[RepositoryModel]
) -> list[ModelServingState]:
    """Each catalog row with what Triton's repository `index` says of its model version."""
    states = []
    for row in rows:
        entries = [entry for entry in index if entry.name == row.triton_model]
        if row.triton_version:
            # A model never loaded is listed once, without a version.
            entries = [entry for entry in entries if entry.version in (row.triton_version, "")]
        # Blank pin: the ready version Triton serves as its latest, else whatever it says.
        ready = sorted((e for e in entries if e.state == READY), key=lambda e: int(e.version or 0))
        entry = ready[-1] if ready else (entries[0] if entries else None)
        states.append(
            ModelServingState(
                name=row.name,
                triton_model=row.triton_model,
                version=row.triton_version,
                state=entry.state if entry else "",
                reason=(entry.reason if entry else "") or ("" if entry else "not in Triton's repository"),
            )
        )
    return states


def _reconcile_model(
    client: TritonClient,
    triton_model: str,
    rows: Sequence[EmbeddingModel],
    index: Sequence[RepositoryModel],
    *,
    unload: bool,
) -> None:
    """Make Triton serve what the enabled `rows` of `triton_model` ask (TritonError if it cannot)."""
    enabled = [row for row in rows if row.enabled]
    if not enabled:
        if unload and _loaded_versions(index, triton_model, _LOADED_STATES):
            logger.info("unloading Triton model %s: no enabled catalog model uses it", triton_model)
            client.model_unload(triton_model)
        return
    desired = _desired_versions(enabled)
    ready = _loaded_versions(index, triton_model, {READY})
    if desired is None:
        if ready:
            return
        logger.info("loading Triton model %s (its latest version)", triton_model)
        client.model_load(triton_model)
        return
    if not unload:
        # A switch: the old version serves on until the next full reconcile, as processes that
        # cached the catalog (MODEL_CACHE_SECONDS) may still ask for it.
        desired |= ready
    if desired == ready:
        return
    logger.info("loading Triton model %s version(s) %s", triton_model, ", ".join(sorted(desired)))
    client.model_load(triton_model, config=model_config_override(triton_model=triton_model, versions=desired))


def models_reconcile(
    *,
    unload: bool = True,
    client: TritonClient | None = None,
    triton_models: Collection[str] | None = None,
) -> list[ModelServingState]:
    """Load and unload Triton models until Triton serves what the catalog says; each row's state.

    unload=False keeps versions already loaded (a version switch) and unloads nothing.
    triton_models: reconcile only these (all the catalog's when None). A load Triton refuses is
    logged and shows in the returned states (its reason); Triton unreachable raises TritonError.
    """
    client = client or triton_sync_client()
    rows = list(EmbeddingModel.objects.order_by("name"))
    index = client.repository_index()
    by_model: dict[str, list[EmbeddingModel]] = {}
    for row in rows:
        by_model.setdefault(row.triton_model, []).append(row)
    failures: dict[str, str] = {}
    for triton_model, model_rows in by_model.items():
        if triton_models is not None and triton_model not in triton_models:
            continue
        try:
            _reconcile_model(client, triton_model, model_rows, index, unload=unload)
        except TritonModelError as error:
            # One model that cannot load must not keep the others from loading.
            logger.warning("Triton model %s: %s", triton_model, error)
            failures[triton_model] = error.details or str(error)
    states = serving_states(rows, client.repository_index())
    return [
        state
        if state.ready or state.triton_model not in failures
        else ModelServingState(
            state.name,
            state.triton_model,
            state.version,
            state.state,
            state.reason or failures[state.triton_model],
        )
        for state in states
        if triton_models is None or state.triton_model in triton_models
    ]


def models_serving_states_sync(
    *, models: Iterable[EmbeddingModel] | None = None, client: TritonClient | None = None
) -> list[ModelServingState]:
    """Each catalog row's (or each of `models`') state in Triton, from one repository index."""
    index = (client or triton_sync_client()).repository_index()
    return serving_states(EmbeddingModel.objects.order_by("name") if models is None else models, index)


async def models_serving_states(
    *, models: Iterable[EmbeddingModel] | None = None, client: AsyncTritonClient | None = None
) -> list[ModelServingState]:
    """`models_serving_states_sync` for the request path (/ready)."""
    if models is None:
        models = await sync_to_async(list)(EmbeddingModel.objects.order_by("name"))
    index = await (client or triton_async_client()).repository_index()
    return serving_states(models, index)


# embedsite_onnx's execution_provider -> the engine that runs the graph.
ONNX_RUNTIME_ENGINES = {"cpu": "onnxruntime-cpu", "cuda": "onnxruntime-cuda", "tensorrt": "tensorrt"}
# The onnxruntime backend's (official container) TensorRT precision_mode -> our precision's name.
TENSORRT_PRECISION_MODES = {"FP16": "float16", "BF16": "bfloat16", "INT8": "int8"}


def model_engine(spec: ModelSpec, *, export_dtype: str | None) -> dict:
    """{"name", "precision"} of what runs the model Triton describes as `spec`: "onnxruntime-cpu",
    "onnxruntime-cuda", "tensorrt" or "pytorch" (another backend: its name), and the precision it
    computes in (a backend's own `precision` parameter, else the export's dtype)."""
    if spec.backend == "embedsite_torch":
        return {"name": "pytorch", "precision": spec.parameter("precision", "float16")}
    if spec.backend == "embedsite_onnx":
        provider = spec.parameter("execution_provider", "cpu")
        precision = spec.parameter("precision", "float16") if provider == "tensorrt" else export_dtype
        return {"name": ONNX_RUNTIME_ENGINES.get(provider, provider), "precision": precision}
    if spec.backend == "onnxruntime" or spec.platform == "onnxruntime_onnx":
        on_gpu = "KIND_GPU" in spec.instance_kinds
        tensorrt = dict(spec.gpu_accelerators).get("tensorrt")
        if on_gpu and tensorrt is not None:
            mode = dict(tensorrt).get("precision_mode", "")
            return {"name": "tensorrt", "precision": TENSORRT_PRECISION_MODES.get(mode, export_dtype)}
        return {"name": "onnxruntime-cuda" if on_gpu else "onnxruntime-cpu", "precision": export_dtype}
    return {"name": spec.backend or spec.platform or None, "precision": export_dtype}


async def embedding_model_engine(
    *, model: EmbeddingModel, client: AsyncTritonClient | None = None
) -> dict | None:
    """The engine answering `model` (model_engine), from the configuration Triton serves its pinned
    version with; None when Triton cannot say within READY_CHECK_TIMEOUT_S (down, or the version
    not loaded). The configuration is read once per process and model (the client keeps it)."""
    try:
        async with asyncio.timeout(settings.READY_CHECK_TIMEOUT_S):
            spec = await (client or triton_async_client()).model_metadata(
                model.triton_model, model.triton_version
            )
    except (TritonError, TimeoutError) as error:
        logger.info("the engine of model %s is unknown: %s", model.name, type(error).__name__)
        return None
    return model_engine(spec, export_dtype=embedding_model_dtype(model=model)["dtype"])


def write_serving_states(out: TextIO) -> list[ModelServingState]:
    """Reconcile once (runstack and runtriton, right after Triton is ready) and print each catalog
    model's state to `out`; a model that failed to load is reported, not fatal."""
    try:
        states = models_reconcile()
    except TritonError as error:
        out.write(f"Catalog models not loaded: Triton did not answer ({type(error).__name__})\n")
        return []
    except DatabaseError as error:
        out.write(f"Catalog models not loaded: the database did not answer ({type(error).__name__})\n")
        return []
    for state in states:
        where = f"Triton {state.triton_model} v{state.version or 'latest'}"
        reason = f" ({state.reason})" if state.reason and not state.ready else ""
        out.write(f"  model {state.name}: {where} {state.state or 'NOT LOADED'}{reason}\n")
    return states
