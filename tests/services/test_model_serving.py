"""Catalog registration and reconciling the catalog with a real Triton in explicit model-control mode."""

from __future__ import annotations

import time

import numpy as np
import pytest
from google.protobuf import json_format

from embeddings.models import EmbeddingModel
from embeddings.services.inference.catalog import CatalogError, embedding_model_register
from embeddings.services.inference.clients import triton_sync_client
from embeddings.services.inference.serving import (
    ModelConfigMissing,
    model_config_override,
    models_reconcile,
    models_serving_states_sync,
)
from embeddings.tooling.triton_server import free_port
from embeddings.triton import TritonClient, TritonModelNotLoaded, TritonUnavailable
from embeddings.triton.protocol import model_config_pb2
from tests.conftest import serving_model_folder

TOKENS = np.array([[101, 7592, 2088, 102]], dtype=np.int64)
MASK = np.ones_like(TOKENS)


def ready_versions(name: str) -> set[str]:
    return {
        m.version for m in triton_sync_client().repository_index() if m.name == name and m.state == "READY"
    }


def wait_until_unloaded(name: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while any(m.name == name and m.state != "UNAVAILABLE" for m in triton_sync_client().repository_index()):
        assert time.monotonic() < deadline, f"{name} was not unloaded within {timeout_s} s"
        time.sleep(0.1)


def state_of(states, name: str):
    return next(state for state in states if state.name == name)


# --- Registration (no Triton) ----------------------------------------------------------------------


@pytest.fixture
def repository(tmp_path, settings):
    """TRITON_MODEL_REPOSITORY with minilm (versions 1 and 2) and minilm_copy, no Triton."""
    serving_model_folder(tmp_path, "minilm", versions=(1, 2))
    serving_model_folder(tmp_path, "minilm_copy")
    settings.TRITON_MODEL_REPOSITORY = tmp_path
    return tmp_path


@pytest.mark.django_db
def test_register_reads_the_export_and_defaults_to_the_latest_version(repository):
    model = embedding_model_register(triton_model="minilm", aliases=["mini"], prompts={"query": "q: "})
    assert (model.name, model.triton_version, model.dimensions, model.max_tokens) == ("minilm", "2", 384, 256)
    assert model.aliases == ["mini"] and model.enabled

    # Updated in place: a pinned version; aliases and prompts not given are kept.
    again = embedding_model_register(triton_model="minilm", version=1)
    assert again.pk == model.pk and again.triton_version == "1"
    assert again.aliases == ["mini"] and again.prompts == {"query": "q: "}


@pytest.mark.django_db
def test_register_refuses_what_cannot_be_served(repository):
    with pytest.raises(CatalogError, match="no finished export version 7"):
        embedding_model_register(triton_model="minilm", version=7)
    with pytest.raises(CatalogError, match="no finished export"):
        embedding_model_register(triton_model="nothing_here")
    with pytest.raises(CatalogError, match="default prompt 'doc'"):
        embedding_model_register(triton_model="minilm", prompts={"query": "q: "}, default_prompt_name="doc")
    embedding_model_register(triton_model="minilm", aliases=["shared"])
    # A name another model answers to would make requests for it ambiguous.
    with pytest.raises(CatalogError, match="'shared' already names the model 'minilm'"):
        embedding_model_register(triton_model="minilm_copy", aliases=["shared"])
    with pytest.raises(CatalogError, match="'minilm' already names"):
        embedding_model_register(triton_model="minilm_copy", name="copy", aliases=["minilm"])
    assert list(EmbeddingModel.objects.values_list("name", flat=True)) == ["minilm"]


@pytest.mark.unit
def test_config_override_pins_versions_in_the_configuration_triton_reads(repository, settings):
    config = json_format.Parse(
        model_config_override(triton_model="minilm", versions=["2", "1"]), model_config_pb2.ModelConfig()
    )
    assert config.name == "minilm" and list(config.version_policy.specific.versions) == [1, 2]
    assert config.max_batch_size == 64 and config.output[0].dims == [384]

    settings.TRITON_MODEL_CONFIG_NAME = "gpu"  # configs/gpu.pbtxt, which this folder lacks
    with pytest.raises(ModelConfigMissing, match=r"configs/gpu\.pbtxt is missing"):
        model_config_override(triton_model="minilm", versions=["1"])


@pytest.mark.unit
def test_config_override_keeps_the_tensorrt_accelerator_of_the_official_containers_config(settings):
    # The shipped folder: the load sends what configs/gpu-tensorrt.pbtxt says, TensorRT included.
    settings.TRITON_MODEL_CONFIG_NAME = "gpu-tensorrt"
    config = json_format.Parse(
        model_config_override(triton_model="minilm", versions=["1"]), model_config_pb2.ModelConfig()
    )
    (accelerator,) = config.optimization.execution_accelerators.gpu_execution_accelerator
    assert accelerator.name == "tensorrt" and accelerator.parameters["precision_mode"] == "FP16"
    assert accelerator.parameters["trt_engine_cache_path"] == "/engines/minilm"


# --- Reconciling with Triton -----------------------------------------------------------------------


@pytest.mark.django_db
def test_reconcile_loads_the_pinned_version_of_enabled_models_only(explicit_triton):
    embedding_model_register(triton_model="minilm_copy", name="copy")
    embedding_model_register(triton_model="minilm", version=1, enabled=False)

    states = models_reconcile()

    assert state_of(states, "copy").ready and state_of(states, "copy").version == "1"
    # Disabled: not loaded ("" if this Triton never loaded it, UNAVAILABLE once unloaded).
    assert state_of(states, "minilm").state in {"", "UNAVAILABLE"}
    assert ready_versions("minilm_copy") == {"1"} and ready_versions("minilm") == set()
    vectors = triton_sync_client().embed_tokens("minilm_copy", TOKENS, MASK, version="1")
    assert vectors.shape == (1, 384) and abs(float(np.linalg.norm(vectors)) - 1) < 1e-5
    # Nothing left to do: a second run loads nothing again (the index is unchanged).
    assert models_reconcile() == states


@pytest.mark.django_db
def test_a_version_switch_serves_both_until_the_full_reconcile(explicit_triton):
    model = embedding_model_register(triton_model="minilm", version=1)
    models_reconcile()
    assert ready_versions("minilm") == {"1"}

    model.triton_version = "2"
    model.save(update_fields=["triton_version"])
    states = models_reconcile(unload=False)
    # Processes that still cache version 1 keep being served while they catch up.
    assert ready_versions("minilm") == {"1", "2"}
    assert state_of(states, "minilm").ready and state_of(states, "minilm").version == "2"
    client = triton_sync_client()
    np.testing.assert_allclose(
        client.embed_tokens("minilm", TOKENS, MASK, version="1"),
        client.embed_tokens("minilm", TOKENS, MASK, version="2"),
        atol=1e-6,
    )

    models_reconcile()
    assert ready_versions("minilm") == {"2"}


@pytest.mark.django_db
def test_disabling_unloads_and_requests_then_fail_at_once(explicit_triton, monkeypatch):
    model = embedding_model_register(triton_model="minilm_copy", name="copy")
    models_reconcile()
    client = triton_sync_client()
    client.embed_tokens("minilm_copy", TOKENS, MASK)

    model.enabled = False
    model.save(update_fields=["enabled"])
    states = models_reconcile()

    # Triton answers an unload at once and ends the model's instances after.
    assert state_of(states, "copy").state in {"UNLOADING", "UNAVAILABLE"}
    wait_until_unloaded("minilm_copy")
    # Not retried as if Triton were down: no backoff, the first answer is the error.
    retry_delays = []
    decide = client._retry_delay

    def retry_delay(*arguments, **options):
        retry_delays.append(decide(*arguments, **options))
        return retry_delays[-1]

    monkeypatch.setattr(client, "_retry_delay", retry_delay)
    with pytest.raises(TritonModelNotLoaded, match="minilm_copy"):
        client.embed_tokens("minilm_copy", TOKENS, MASK)
    assert retry_delays == []


@pytest.mark.django_db
def test_models_outside_the_catalog_are_never_touched(explicit_triton):
    client = triton_sync_client()
    client.model_load("minilm_copy")  # as TRITON_STARTUP_MODELS would
    embedding_model_register(triton_model="minilm", version=1, enabled=False)
    models_reconcile()
    assert ready_versions("minilm_copy") == {"1"}


@pytest.mark.django_db
def test_a_failed_load_is_reported_and_the_others_still_load(explicit_triton):
    EmbeddingModel.objects.create(
        name="broken", triton_model="broken", triton_version="1", dimensions=8, max_tokens=8
    )
    embedding_model_register(triton_model="minilm_copy", name="copy")

    states = models_reconcile()

    broken = state_of(states, "broken")
    assert not broken.ready and "no_such_backend" in broken.reason
    assert state_of(states, "copy").ready
    assert [state.name for state in models_serving_states_sync()] == ["broken", "copy"]


@pytest.mark.django_db
def test_triton_unreachable_raises_our_error(settings):
    client = TritonClient(f"127.0.0.1:{free_port()}", timeout_s=2, retries=0)
    EmbeddingModel.objects.create(name="m", triton_model="m", dimensions=8, max_tokens=8)
    with pytest.raises(TritonUnavailable):
        models_reconcile(client=client)
    client.close()


# --- Celery beat and the commands that start Triton ------------------------------------------------

RECONCILE_TASK = "embeddings.tasks.models_reconcile_task"


@pytest.mark.unit
def test_the_reconcile_is_in_the_beat_schedule_and_registered(settings):
    from embedsite.celery import app

    app.loader.import_default_modules()
    entry = app.conf.beat_schedule["reconcile-models"]
    assert entry["task"] == RECONCILE_TASK and entry["schedule"] == settings.MODEL_RECONCILE_INTERVAL_S
    assert app.tasks[RECONCILE_TASK].acks_late


@pytest.mark.django_db
def test_the_task_loads_what_triton_lost(explicit_triton):
    from embeddings.tasks import models_reconcile_task

    embedding_model_register(triton_model="minilm_copy", name="copy")
    # Nothing loaded, as after a Triton restart: the next beat run brings the model back.
    assert models_reconcile_task() == {"copy": "READY"}
    assert models_reconcile_task() == {"copy": "READY"}  # and a redelivery finds nothing to do


@pytest.mark.django_db
def test_the_task_survives_triton_being_down(settings):
    from embeddings.services.inference.clients import reset_clients
    from embeddings.tasks import models_reconcile_task

    settings.TRITON_GRPC_TARGET = f"127.0.0.1:{free_port()}"
    settings.TRITON_RETRIES = 0
    reset_clients()
    row = EmbeddingModel.objects.create(name="m", triton_model="m", dimensions=8, max_tokens=8)
    assert models_reconcile_task() == {}
    assert row.enabled  # nothing changed in the catalog
    reset_clients()


@pytest.mark.django_db
def test_write_serving_states_prints_each_model(explicit_triton):
    import io

    from embeddings.services.inference.serving import write_serving_states

    embedding_model_register(triton_model="minilm_copy", name="copy")
    EmbeddingModel.objects.create(
        name="broken", triton_model="broken", triton_version="1", dimensions=8, max_tokens=8
    )
    out = io.StringIO()
    write_serving_states(out)
    lines = out.getvalue().splitlines()
    assert "  model copy: Triton minilm_copy v1 READY" in lines
    assert any(
        line.startswith("  model broken: Triton broken v1 ") and "no_such_backend" in line for line in lines
    )
