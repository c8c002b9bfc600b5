"""The databases the live stacks start on (tests/database_backend.py): each a copy of a template
migrated once per test process, which must be a correct migrated database of the run's backend and
a database of its own."""

from __future__ import annotations

import os
import sqlite3
import subprocess

import psycopg
import pytest

from tests.database_backend import database_execute, migrated_database_url, no_transaction_open
from tests.processes import run_python


def migrate_check(url: str, workdir) -> subprocess.CompletedProcess:
    """`manage.py migrate --check` on the database at `url`: non-zero while a migration is unapplied."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "embedsite.settings",
        "DATABASE_URL": url,
        "EMBEDSITE_RUN_DIR": str(workdir),
    }
    return run_python(["manage.py", "migrate", "--check", "--noinput"], env)


@pytest.mark.integration
def test_a_stack_database_is_migrated_and_its_own(tmp_path):
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    first_dir.mkdir()
    second_dir.mkdir()
    first = migrated_database_url(first_dir)
    assert migrate_check(first, first_dir).returncode == 0, "a copy of the template lacks a migration"

    # The check can fail: with the record of the project's migrations gone, this copy is unmigrated.
    database_execute(first, "DELETE FROM django_migrations WHERE app = %s", "embeddings")
    unmigrated = migrate_check(first, first_dir)
    assert unmigrated.returncode != 0, unmigrated.stdout + unmigrated.stderr

    # A copy made after is whole: the first one's change reached neither the template nor it.
    second = migrated_database_url(second_dir)
    assert second != first
    assert migrate_check(second, second_dir).returncode == 0


@pytest.mark.integration
def test_a_transaction_open_elsewhere_is_seen(tmp_path):
    """no_transaction_open, which tests pause a worker by (processes.py): a connection inside a
    writing or a reading transaction is seen on either backend, and none once it has ended."""
    url = migrated_database_url(tmp_path)
    assert no_transaction_open(url)
    for statement in ("UPDATE embeddings_tenant SET name = name", "SELECT count(*) FROM embeddings_tenant"):
        if url.startswith("sqlite:///"):
            other = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
            other.execute("BEGIN")
        else:
            other = psycopg.connect(url)
        cursor = other.execute(statement)
        if statement.startswith("SELECT"):
            cursor.fetchall()
        assert not no_transaction_open(url), statement
        other.execute("ROLLBACK") if url.startswith("sqlite:///") else other.rollback()
        assert no_transaction_open(url), statement
        other.close()
