"""The models and their migrations agree: a model change without its migration fails here, not in
production's `migrate`."""

import io

import pytest
from django.core.management import call_command


@pytest.mark.django_db
def test_every_model_change_has_its_migration():
    out = io.StringIO()
    try:
        call_command("makemigrations", "--check", "--dry-run", stdout=out)
    except SystemExit as missing:
        pytest.fail(
            f"makemigrations found changes without a migration (exit {missing.code}):\n{out.getvalue()}"
        )
