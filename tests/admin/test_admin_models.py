"""The catalog in the admin: load and unload actions, the Triton state column, the pinned version
chosen among the exports on disk, and Triton's failures shown as messages (never a 500)."""

from __future__ import annotations

import pytest
from django.urls import reverse

from embeddings.models import EmbeddingModel
from embeddings.services.inference.catalog import embedding_model_register
from embeddings.services.inference.clients import reset_clients, triton_sync_client
from embeddings.tooling.triton_server import free_port
from tests.conftest import write_finished_export

CHANGELIST = "admin:embeddings_embeddingmodel_changelist"

pytestmark = pytest.mark.django_db


def ready_versions(name: str) -> set[str]:
    return {
        m.version for m in triton_sync_client().repository_index() if m.name == name and m.state == "READY"
    }


def run_action(admin_client, action: str, *models: EmbeddingModel):
    return admin_client.post(
        reverse(CHANGELIST),
        {"action": action, "_selected_action": [model.pk for model in models]},
        follow=True,
    )


def page_messages(response) -> list[str]:
    return [str(message) for message in response.context["messages"]]


def change_data(model: EmbeddingModel, **changes) -> dict:
    data = {
        "name": model.name,
        "aliases": "[]",
        "triton_model": model.triton_model,
        "triton_version": model.triton_version,
        "dimensions": model.dimensions,
        "max_tokens": model.max_tokens,
        "prompts": "{}",
        "default_prompt_name": "",
        "owned_by": model.owned_by,
        "enabled": "on" if model.enabled else "",
        "result_dtype": model.result_dtype,
        "created_at_0": "2026-01-01",
        "created_at_1": "00:00:00",
    }
    data.update(changes)
    return {key: value for key, value in data.items() if value is not None}


def test_load_and_unload_actions_and_the_state_column(admin_client, explicit_triton):
    copy = embedding_model_register(triton_model="minilm_copy", name="copy", enabled=False)

    page = admin_client.get(reverse(CHANGELIST))
    # "not loaded", or UNAVAILABLE where this shared Triton unloaded it in an earlier test.
    assert page.status_code == 200 and "Triton state" in page.text
    assert '<td class="field-triton_state">READY</td>' not in page.text

    response = run_action(admin_client, "load_into_triton", copy)
    assert response.status_code == 200
    assert "copy: Triton model minilm_copy version 1 is loaded and serving." in page_messages(response)
    assert EmbeddingModel.objects.get(pk=copy.pk).enabled and ready_versions("minilm_copy") == {"1"}
    assert '<td class="field-triton_state">READY</td>' in response.text

    response = run_action(admin_client, "unload_from_triton", copy)
    assert "copy: disabled; Triton model minilm_copy version 1 unloaded." in page_messages(response)
    assert not EmbeddingModel.objects.get(pk=copy.pk).enabled and ready_versions("minilm_copy") == set()


def test_a_failed_load_is_a_message_and_the_reason(admin_client, explicit_triton):
    broken = EmbeddingModel.objects.create(
        name="broken", triton_model="broken", triton_version="1", dimensions=8, max_tokens=8, enabled=False
    )
    response = run_action(admin_client, "load_into_triton", broken)
    assert response.status_code == 200
    [message] = page_messages(response)
    assert (
        message.startswith("broken: Triton model broken version 1 did not load:")
        and "no_such_backend" in message
    )
    assert "no_such_backend" in response.text  # the state column's tooltip says why


def test_an_int8_exports_version_is_labelled_with_its_dtype_and_can_be_pinned(
    admin_client, tmp_path, settings
):
    settings.TRITON_MODEL_REPOSITORY = str(tmp_path)
    settings.TRITON_GRPC_TARGET = f"127.0.0.1:{free_port()}"  # the pin is the point, not the load
    reset_clients()
    write_finished_export(tmp_path, version=1)
    write_finished_export(tmp_path, version=2, extra={"dtype": "int8"})
    model = embedding_model_register(triton_model="minilm", version=1)
    url = reverse("admin:embeddings_embeddingmodel_change", args=[model.pk])
    assert admin_client.get(url).context["adminform"].form.fields["triton_version"].choices == [
        ("", "Triton's latest"),
        ("2", "version 2 (int8)"),
        ("1", "version 1"),
    ]
    admin_client.post(url, change_data(model, triton_version="2"), follow=True)
    assert EmbeddingModel.objects.get(pk=model.pk).triton_version == "2"
    reset_clients()


def test_the_version_is_chosen_among_the_exports_and_a_switch_keeps_the_old_one(
    admin_client, explicit_triton
):
    model = embedding_model_register(triton_model="minilm", version=1)
    run_action(admin_client, "load_into_triton", model)
    url = reverse("admin:embeddings_embeddingmodel_change", args=[model.pk])

    form = admin_client.get(url)
    assert form.context["adminform"].form.fields["triton_version"].choices == [
        ("", "Triton's latest"),
        ("2", "version 2"),
        ("1", "version 1"),
    ]
    refused = admin_client.post(url, change_data(model, triton_version="7"))
    assert refused.status_code == 200 and "Select a valid choice" in refused.text

    response = admin_client.post(url, change_data(model, triton_version="2"), follow=True)
    assert "minilm: Triton model minilm version 2 is loaded and serving." in page_messages(response)
    assert EmbeddingModel.objects.get(pk=model.pk).triton_version == "2"
    # Processes that cached the catalog still ask for version 1 until the next full reconcile.
    assert ready_versions("minilm") == {"1", "2"}


def test_triton_down_shows_a_dash_and_a_warning_not_a_500(admin_client, settings):
    settings.TRITON_GRPC_TARGET = f"127.0.0.1:{free_port()}"
    reset_clients()
    model = EmbeddingModel.objects.create(name="m", triton_model="m", dimensions=8, max_tokens=8)

    page = admin_client.get(reverse(CHANGELIST))
    assert page.status_code == 200 and '<td class="field-triton_state">—</td>' in page.text

    response = run_action(admin_client, "unload_from_triton", model)
    assert response.status_code == 200
    [message] = page_messages(response)
    assert message.startswith("Saved, but Triton did not answer (TritonUnavailable)")
    assert not EmbeddingModel.objects.get(pk=model.pk).enabled
    reset_clients()
