"""The Django admin (keys shown once, actions through services) and the management commands."""

from __future__ import annotations

import io
import json
import re
from datetime import timedelta

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from django.core.management import CommandError, call_command
from django.urls import reverse
from django.utils import timezone

from embeddings.models import ApiKey, EmbeddingModel, Tenant
from embeddings.services.accounts.api_keys import (
    api_key_create,
    api_key_for_secret,
    api_key_revoke,
    parse_api_key,
)
from embeddings.services.jobs.budget import StorageNeed, job_storage_admit
from embeddings.tooling.triton_server import free_port
from tests.conftest import write_finished_export

pytestmark = pytest.mark.django_db


def full_keys_in(text: str) -> list[str]:
    return re.findall(r"emb_[a-z0-9]{12}_[A-Za-z0-9_-]{20,100}", text)


def test_add_form_asks_only_for_tenant_name_and_expiry(admin_client, alpha):
    response = admin_client.get(reverse("admin:embeddings_apikey_add") + f"?tenant={alpha.pk}")

    assert response.status_code == 200
    assert list(response.context["adminform"].form.fields) == ["tenant", "name", "expires_at"]


def test_creating_a_key_shows_it_once_and_stores_only_the_hash(admin_client, alpha, caplog):
    caplog.set_level("DEBUG")
    response = admin_client.post(
        reverse("admin:embeddings_apikey_add"),
        {"tenant": alpha.pk, "name": "ci key", "expires_at_0": "", "expires_at_1": ""},
    )

    assert response.status_code == 200
    body = response.content.decode()
    (full_key,) = full_keys_in(body)  # on the page, exactly once
    assert "shown only this once" in body
    assert "no-store" in response["Cache-Control"]
    # Nothing carries it to a later request: no redirect, no message cookie, no session.
    assert not any(full_key in morsel.value for morsel in response.cookies.values())
    assert full_key not in str(admin_client.session.items())
    assert full_key not in caplog.text

    api_key = ApiKey.objects.get()
    assert (api_key.tenant, api_key.name) == (alpha, "ci key")
    assert api_key_for_secret(key=full_key) == api_key
    secret = parse_api_key(full_key)[1]
    assert secret not in json.dumps(ApiKey.objects.values().get(), default=str)

    # The history entry names the key without its secret.
    entry = LogEntry.objects.get()
    assert secret not in entry.object_repr and secret not in entry.change_message


def test_the_key_is_never_shown_again(admin_client, alpha):
    response = admin_client.post(
        reverse("admin:embeddings_apikey_add"), {"tenant": alpha.pk, "name": "ci key"}
    )
    (full_key,) = full_keys_in(response.content.decode())
    secret = parse_api_key(full_key)[1]
    api_key = ApiKey.objects.get()

    pages = [
        reverse("admin:embeddings_apikey_change", args=[api_key.pk]),
        reverse("admin:embeddings_apikey_changelist"),
        reverse("admin:embeddings_tenant_change", args=[alpha.pk]),
        reverse("admin:embeddings_apikey_history", args=[api_key.pk]),
        reverse("admin:index"),
    ]
    for url in pages:
        page = admin_client.get(url)
        assert page.status_code == 200, url
        assert secret not in page.content.decode(), url
    # The change page does show what is stored: the public id and the hash, read-only.
    change_page = admin_client.get(pages[0]).content.decode()
    assert api_key.public_id in change_page and api_key.secret_hash in change_page
    assert 'name="secret_hash"' not in change_page and 'name="public_id"' not in change_page


def test_editing_a_key_keeps_its_secret(admin_client, alpha):
    api_key, full_key = api_key_create(tenant=alpha, name="old name")

    response = admin_client.post(
        reverse("admin:embeddings_apikey_change", args=[api_key.pk]),
        {"name": "new name", "expires_at_0": "", "expires_at_1": ""},
    )

    assert response.status_code == 302
    api_key.refresh_from_db()
    assert api_key.name == "new name"
    assert api_key_for_secret(key=full_key) == api_key
    assert ApiKey.objects.count() == 1


def test_revoke_action(admin_client, alpha, beta):
    first, _ = api_key_create(tenant=alpha, name="first")
    second, _ = api_key_create(tenant=alpha, name="second")
    kept, _ = api_key_create(tenant=beta, name="kept")

    response = admin_client.post(
        reverse("admin:embeddings_apikey_changelist"),
        {"action": "revoke_keys", "_selected_action": [first.pk, second.pk]},
        follow=True,
    )

    assert response.status_code == 200
    assert "Revoked 2 key(s)." in response.content.decode()
    for api_key in (first, second, kept):
        api_key.refresh_from_db()
    assert first.is_revoked() and second.is_revoked()
    assert not kept.is_revoked()


def test_deactivate_action(admin_client, alpha, beta):
    response = admin_client.post(
        reverse("admin:embeddings_tenant_changelist"),
        {"action": "deactivate_tenants", "_selected_action": [alpha.pk]},
        follow=True,
    )

    assert "Deactivated 1 tenant(s)." in response.content.decode()
    alpha.refresh_from_db()
    beta.refresh_from_db()
    assert not alpha.is_active
    assert beta.is_active


def test_tenant_page_lists_its_keys_read_only(admin_client, alpha, beta):
    alpha_key, _ = api_key_create(tenant=alpha, name="alpha-ci")
    api_key_create(tenant=beta, name="beta-ci")

    page = admin_client.get(reverse("admin:embeddings_tenant_change", args=[alpha.pk])).content.decode()

    assert "alpha-ci" in page and alpha_key.prefix in page
    assert "beta-ci" not in page
    assert reverse("admin:embeddings_apikey_add") + f"?tenant={alpha.pk}" in page


def test_changelists_search_and_filter(admin_client, alpha, beta):
    api_key_create(tenant=alpha, name="alpha-ci")
    revoked, _ = api_key_create(tenant=beta, name="beta-ci")
    revoked.revoked_at = revoked.created_at
    revoked.save(update_fields=["revoked_at"])
    changelist = reverse("admin:embeddings_apikey_changelist")

    found = admin_client.get(changelist, {"q": "alpha"})
    assert [key.name for key in found.context["cl"].result_list] == ["alpha-ci"]
    not_revoked = admin_client.get(changelist, {"status": "active"})
    assert [key.name for key in not_revoked.context["cl"].result_list] == ["alpha-ci"]
    tenants = admin_client.get(reverse("admin:embeddings_tenant_changelist"), {"q": "bet"})
    assert [tenant.slug for tenant in tenants.context["cl"].result_list] == ["beta"]
    models = admin_client.get(reverse("admin:embeddings_embeddingmodel_changelist"))
    assert models.status_code == 200


def test_status_filter_tells_active_revoked_and_expired_apart(admin_client, alpha):
    now = timezone.now()
    api_key_create(tenant=alpha, name="forever")
    api_key_create(tenant=alpha, name="next-year", expires_at=now + timedelta(days=365))
    api_key_create(tenant=alpha, name="lapsed", expires_at=now - timedelta(seconds=1))
    revoked, _ = api_key_create(tenant=alpha, name="revoked-and-lapsed", expires_at=now - timedelta(days=1))
    api_key_revoke(api_key=revoked)
    changelist = reverse("admin:embeddings_apikey_changelist")

    def names(status: str) -> set[str]:
        response = admin_client.get(changelist, {"status": status})
        assert response.status_code == 200
        return {key.name for key in response.context["cl"].result_list}

    assert names("active") == {"forever", "next-year"}
    assert names("expired") == {"lapsed"}
    assert names("revoked") == {"revoked-and-lapsed"}  # as the status column says: revoked wins
    page = admin_client.get(changelist).content.decode()
    assert "?status=expired" in page


def test_staff_who_may_only_view_cannot_revoke_or_deactivate(client, alpha):
    api_key, full_key = api_key_create(tenant=alpha, name="ci")
    viewer = User.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.set(
        Permission.objects.filter(
            codename__in=["view_apikey", "view_tenant"], content_type__app_label="embeddings"
        )
    )
    client.force_login(viewer)

    keys = client.get(reverse("admin:embeddings_apikey_changelist"))
    assert keys.status_code == 200 and "revoke_keys" not in keys.content.decode()
    client.post(
        reverse("admin:embeddings_apikey_changelist"),
        {"action": "revoke_keys", "_selected_action": [api_key.pk]},
    )
    client.post(
        reverse("admin:embeddings_tenant_changelist"),
        {"action": "deactivate_tenants", "_selected_action": [alpha.pk]},
    )

    api_key.refresh_from_db()
    alpha.refresh_from_db()
    assert not api_key.is_revoked() and alpha.is_active
    assert api_key_for_secret(key=full_key) == api_key


# --- Management commands ---------------------------------------------------------------------------


@pytest.fixture
def no_triton(settings):
    """The service's Triton target a free port nobody listens on."""
    from embeddings.services.inference.clients import reset_clients

    settings.TRITON_GRPC_TARGET = f"127.0.0.1:{free_port()}"
    reset_clients()
    yield
    reset_clients()


def test_register_local_model_is_idempotent(settings, tmp_path, no_triton):
    settings.TRITON_MODEL_REPOSITORY = tmp_path
    write_finished_export(tmp_path)

    call_command("register_local_model", stdout=io.StringIO())
    call_command("register_local_model", stdout=io.StringIO())

    model = EmbeddingModel.objects.get()
    assert (model.name, model.triton_model, model.dimensions, model.max_tokens) == (
        "all-MiniLM-L6-v2",
        "minilm",
        384,
        256,
    )
    assert "minilm" in model.aliases

    model.result_dtype = "float16"  # an operator's choice, which registering again keeps
    model.save(update_fields=["result_dtype"])
    write_finished_export(tmp_path, max_tokens=512)  # a re-export updates the row, never duplicates it
    call_command("register_local_model", stdout=io.StringIO())
    assert (EmbeddingModel.objects.get().max_tokens, EmbeddingModel.objects.get().result_dtype) == (
        512,
        "float16",
    )


def test_register_local_model_without_an_export_fails_clearly(settings, tmp_path, no_triton):
    settings.TRITON_MODEL_REPOSITORY = tmp_path
    with pytest.raises(CommandError, match="export_model"):
        call_command("register_local_model")


def test_create_tenant_and_key_commands():
    out = io.StringIO()
    call_command("create_tenant", "--name", "Acme Corp", stdout=out)
    assert out.getvalue().strip() == "acme-corp"

    out, err = io.StringIO(), io.StringIO()
    call_command("create_api_key", "--tenant", "acme-corp", "--expires-in-days", "30", stdout=out, stderr=err)

    full_key = out.getvalue().strip()  # stdout is the key alone, for scripts
    assert out.getvalue().count("\n") == 1
    api_key = api_key_for_secret(key=full_key)
    assert api_key is not None and api_key.tenant.slug == "acme-corp"
    assert api_key.expires_at is not None
    assert full_key not in err.getvalue()


def test_create_api_key_for_an_unknown_tenant_fails():
    with pytest.raises(CommandError, match="create_tenant"):
        call_command("create_api_key", "--tenant", "nobody")


def test_create_tenant_twice_fails_clearly():
    call_command("create_tenant", "--name", "Acme", stdout=io.StringIO())
    with pytest.raises(CommandError, match="Cannot create tenant"):
        call_command("create_tenant", "--name", "Acme", stdout=io.StringIO())


def test_create_tenant_sets_rates_and_bursts_and_refuses_a_burst_without_its_rate():
    call_command(
        "create_tenant", "--name", "Rated", "--requests-per-second", "80", "--request-burst", "50",
        "--tokens-per-minute", "150000", stdout=io.StringIO(),
    )  # fmt: skip
    rated = Tenant.objects.get(slug="rated")
    assert (rated.requests_per_second, rated.request_burst, rated.tokens_per_minute) == (80, 50, 150_000)
    assert rated.token_burst is None  # the documented default: a minute of the rate
    with pytest.raises(CommandError, match="A burst needs a token rate"):
        call_command("create_tenant", "--name", "Burst only", "--token-burst", "10", stdout=io.StringIO())
    with pytest.raises(CommandError, match="greater than or equal to 1"):
        call_command("create_tenant", "--name", "Zero", "--requests-per-second", "0", stdout=io.StringIO())
    assert not Tenant.objects.filter(name__in=["Burst only", "Zero"]).exists()


def test_a_models_result_dtype_is_set_and_filtered_in_the_admin(admin_client):
    model = EmbeddingModel.objects.create(
        name="minilm-admin", triton_model="minilm", dimensions=384, max_tokens=256
    )
    assert model.result_dtype == "float32"
    change = reverse("admin:embeddings_embeddingmodel_change", args=[model.pk])
    page = admin_client.get(change)
    assert page.status_code == 200
    assert '<option value="float16">' in page.content.decode()
    form = {
        "name": model.name,
        "aliases": "[]",
        "triton_model": "minilm",
        "triton_version": "",
        "dimensions": "384",
        "max_tokens": "256",
        "prompts": "{}",
        "default_prompt_name": "",
        "owned_by": "embedsite",
        "enabled": "on",
        "created_at_0": "2026-11-23",
        "created_at_1": "12:00:00",
    }
    refused = admin_client.post(change, {**form, "result_dtype": "float64"})
    assert refused.status_code == 200 and "result_dtype" in refused.context["adminform"].form.errors
    saved = admin_client.post(change, {**form, "result_dtype": "float16"})
    assert saved.status_code == 302, saved.content.decode()[:2000]
    model.refresh_from_db()
    assert model.result_dtype == "float16"
    changelist = reverse("admin:embeddings_embeddingmodel_changelist")
    halves = admin_client.get(changelist, {"result_dtype__exact": "float16"})
    assert [found.name for found in halves.context["cl"].result_list] == ["minilm-admin"]
    assert (
        admin_client.get(changelist, {"result_dtype__exact": "float32"}).context["cl"].result_list.count()
        == 0
    )


def test_tenant_page_shows_its_job_storage_against_its_budget(admin_client, alpha, beta, settings):
    settings.JOB_STORAGE_TENANT_BUDGET_BYTES = 4 << 20
    need = StorageNeed(input_bytes=600_000, kept_bytes=48_576, result_bytes=400_000)
    job_storage_admit(tenant=alpha, public_id="job_alphaholds0000000000000", need=need)
    job_storage_admit(tenant=beta, public_id="job_betaholds00000000000000", need=need)
    job_storage_admit(tenant=beta, public_id="job_betaholdsmore0000000000", need=need)

    page = admin_client.get(reverse("admin:embeddings_tenant_change", args=[alpha.pk])).content.decode()

    assert "1.0 MiB (1,048,576 bytes) of 4.0 MiB: 25.0% of the budget" in page
    assert 'name="job_storage_budget_bytes"' in page


def test_create_tenant_sets_a_job_storage_budget():
    call_command(
        "create_tenant", "--name", "Big", "--job-storage-budget-bytes", "8589934592", stdout=io.StringIO()
    )
    call_command("create_tenant", "--name", "Default", stdout=io.StringIO())
    assert Tenant.objects.get(slug="big").job_storage_budget_bytes == 8 << 30
    assert Tenant.objects.get(slug="default").job_storage_budget_bytes is None
    with pytest.raises(CommandError, match="at least 0 bytes"):
        call_command("create_tenant", "--name", "Negative", "--job-storage-budget-bytes", "-1")
