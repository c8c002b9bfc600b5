"""The database the tests run on: `--database postgresql` (the default: a real PostgreSQL the run
starts itself) or `--database sqlite` (the embedded default of `make run`), and a fresh database of
that kind for each live stack (uvicorn, Celery workers) a test starts: a copy of a template this
process migrated once with `manage.py migrate` (`migrated_database_url`), or an empty one.

A pytest plugin (pyproject's addopts load it with `-p`): it must choose DATABASE_URL before
pytest-django imports the settings, earlier than any conftest is read.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import secrets
import shutil
import sqlite3
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from embeddings.tooling.triton_server import free_port
from tests.postgres_server import PostgresServer
from tests.shared_services import SharedServices

POSTGRESQL, SQLITE = "postgresql", "sqlite"
# The database pytest-django creates its test database (test_embedsite) beside.
MAIN_DATABASE = "embedsite"
# Migrated once per test process; every stack's migrated database is a copy of it. Its name ends in
# a token of the process's own, so no two processes' templates meet even on one cluster.
TEMPLATE_DATABASE_PREFIX = "stack_template_"


class RunDatabases:
    """The run's backend; for PostgreSQL its server, started at the first test that needs it."""

    def __init__(self, backend: str):
        self.backend = backend
        self.server: PostgresServer | None = None
        self._started = False
        self._lock = threading.Lock()
        self._numbers = itertools.count(1)
        # The migrated templates' URLs once made (key: on PostgreSQL); SQLite's in its own directory.
        self._template_urls: dict[bool, str] = {}
        self._template_name = TEMPLATE_DATABASE_PREFIX + secrets.token_hex(4)
        self._template_lock = threading.Lock()
        self._template_directory: Path | None = None
        # Stack databases are named per process; on a cluster `make test-services` keeps up, per run too.
        self._run_prefix = ""
        if backend == POSTGRESQL:
            try:
                shared = SharedServices.from_environment()
            except RuntimeError as error:
                raise pytest.UsageError(str(error)) from error
            if shared is None:
                self.server = PostgresServer(port=free_port())
            else:
                self.server = PostgresServer(port=shared.postgresql["port"])
                self.server.password = shared.postgresql["password"]
                self._started = True
                self._run_prefix = f"{secrets.token_hex(3)}_"

    @property
    def url(self) -> str | None:
        """DATABASE_URL of the test process itself; None: the settings' default, SQLite (never
        opened: pytest-django's SQLite test database lives in memory)."""
        return None if self.server is None else self.server.url(MAIN_DATABASE)

    def ensure_started(self) -> None:
        with self._lock:
            if self.server is not None and not self._started:
                self.server.start()
                self.server.wait_until_ready()
                self.server.create_database(MAIN_DATABASE)
                self._started = True

    def fresh_url(self, workdir: Path) -> str:
        """A new, empty database for one stack: a file in `workdir`, or a database on the server."""
        if self.server is None:
            return f"sqlite:///{workdir / 'db.sqlite3'}"
        self.ensure_started()
        return self.server.create_database(self._stack_database_name(workdir))

    def migrated_url(self, workdir: Path) -> str:
        """A new database for one stack with every migration applied: a copy of this process's
        template (SQLite: the file copied into `workdir`; PostgreSQL: CREATE DATABASE ... TEMPLATE)."""
        if self.server is None:
            return self.migrated_sqlite_url(workdir)
        from psycopg import sql

        self._migrated_template(postgresql=True)
        name = self._stack_database_name(workdir)
        self._execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(self._template_name)
            )
        )
        return self.server.url(name)

    def migrated_sqlite_url(self, workdir: Path) -> str:
        """A migrated SQLite file in `workdir` whatever the run's backend (runstack's stacks run on
        SQLite as `make run` does): a copy of this process's SQLite template."""
        template = self._migrated_template(postgresql=False).removeprefix("sqlite:///")
        path = workdir / "db.sqlite3"
        # SQLite's backup copies a consistent database whatever its journal mode.
        with (
            contextlib.closing(sqlite3.connect(template)) as source,
            contextlib.closing(sqlite3.connect(path)) as copy,
        ):
            source.backup(copy)
        return f"sqlite:///{path}"

    def _migrated_template(self, *, postgresql: bool) -> str:
        """The SQLite or PostgreSQL template's URL, migrated by `manage.py migrate` (as a stack
        would) the first time it is asked for."""
        from tests.processes import manage

        with self._template_lock:
            if postgresql not in self._template_urls:
                if self._template_directory is None:
                    self._template_directory = Path(tempfile.mkdtemp(prefix="embedsite-template-"))
                if not postgresql:
                    path = self._template_directory / "db.sqlite3"
                    path.unlink(missing_ok=True)  # what a failed attempt left
                    url = f"sqlite:///{path}"
                else:
                    from psycopg import sql

                    self.ensure_started()
                    # What a failed attempt left.
                    self._execute(
                        sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(self._template_name))
                    )
                    url = self.server.create_database(self._template_name)
                env = {
                    **os.environ,
                    "DJANGO_SETTINGS_MODULE": "embedsite.settings",
                    "DATABASE_URL": url,
                    "EMBEDSITE_RUN_DIR": str(self._template_directory),
                }
                env.pop("PROMETHEUS_MULTIPROC_DIR", None)
                manage(env, "migrate", "--noinput")
                if postgresql:
                    self._close_template()
                self._template_urls[postgresql] = url
            return self._template_urls[postgresql]

    def _close_template(self) -> None:
        """No session may open the template again: CREATE DATABASE ... TEMPLATE refuses to copy a
        database someone is connected to."""
        from psycopg import sql

        self._execute(
            sql.SQL("ALTER DATABASE {} WITH IS_TEMPLATE true ALLOW_CONNECTIONS false").format(
                sql.Identifier(self._template_name)
            )
        )

    def _execute(self, statement) -> None:
        """One statement on the server's `postgres` database, outside any transaction."""
        import psycopg

        with psycopg.connect(self.server.url("postgres"), autocommit=True) as connection:
            connection.execute(statement)

    def _stack_database_name(self, workdir: Path) -> str:
        name = re.sub(r"[^a-z0-9]+", "_", workdir.name.lower()).strip("_")[:40]
        return f"stack_{self._run_prefix}{next(self._numbers)}_{name}"

    def end_sessions(self, database: str) -> None:
        if self.server is not None and self._started:
            self.server.end_sessions(database)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self._template_directory is not None:
            shutil.rmtree(self._template_directory, ignore_errors=True)


_databases: RunDatabases | None = None


def run_databases() -> RunDatabases:
    assert _databases is not None, "tests.database_backend is not loaded (pyproject addopts: -p)"
    return _databases


def fresh_database_url(workdir: Path) -> str:
    """DATABASE_URL of a new, empty database on this run's backend, for a stack a test starts that
    migrates it itself."""
    return run_databases().fresh_url(workdir)


def migrated_sqlite_url(workdir: Path) -> str:
    """DATABASE_URL of a migrated SQLite file in `workdir`, whatever the run's backend."""
    return run_databases().migrated_sqlite_url(workdir)


def migrated_database_url(workdir: Path) -> str:
    """DATABASE_URL of a new database on this run's backend with every migration applied, for a
    stack a test starts: a copy of the run's template (`manage.py migrate` runs once per process)."""
    return run_databases().migrated_url(workdir)


def is_postgresql() -> bool:
    return run_databases().backend == POSTGRESQL


def database_rows(url: str, query: str, *params: Any) -> list[dict[str, Any]]:
    """Rows of `query` (placeholders `%s`) read straight from the database at `url`, outside Django:
    what a stack's processes have committed, seen by the test."""
    if url.startswith("sqlite:///"):
        with contextlib.closing(sqlite3.connect(url.removeprefix("sqlite:///"), timeout=10)) as connection:
            connection.row_factory = sqlite3.Row
            return [dict(row) for row in connection.execute(query.replace("%s", "?"), params)]
    import psycopg
    from psycopg.rows import dict_row

    with psycopg.connect(url, row_factory=dict_row, autocommit=True) as connection:
        return connection.execute(query, params).fetchall()


class DatabaseReader:
    """database_rows on one connection, kept until close(): for a test that polls a stack's database.
    A PostgreSQL connection per query forks and authenticates a server process, ~20 ms of CPU: at
    ten polls a second, more than the waiting test spends on anything else."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._connection = None

    def rows(self, query: str, *params: Any) -> list[dict[str, Any]]:
        if self.url.startswith("sqlite:///"):
            return database_rows(self.url, query, *params)  # a file opened, no process started
        if self._connection is None:
            import psycopg
            from psycopg.rows import dict_row

            # Autocommit: each query a transaction of its own, so each sees what was committed.
            self._connection = psycopg.connect(self.url, row_factory=dict_row, autocommit=True)
        return self._connection.execute(query, params).fetchall()

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


def database_execute(url: str, query: str, *params: Any) -> None:
    """Run one statement (placeholders `%s`) on the database at `url`, committed."""
    if url.startswith("sqlite:///"):
        with contextlib.closing(sqlite3.connect(url.removeprefix("sqlite:///"), timeout=10)) as connection:
            connection.execute(query.replace("%s", "?"), params)
            connection.commit()
        return
    import psycopg

    with psycopg.connect(url, autocommit=True) as connection:
        connection.execute(query, params)


def no_transaction_open(url: str) -> bool:
    """Whether no other connection to the database at `url` is inside a transaction (so none holds
    a lock a write could wait on): on SQLite, an exclusive lock is free at once; on PostgreSQL, no
    other session is active or idle in a transaction."""
    if url.startswith("sqlite:///"):
        with contextlib.closing(
            sqlite3.connect(url.removeprefix("sqlite:///"), timeout=0, isolation_level=None)
        ) as connection:
            try:
                connection.execute("BEGIN EXCLUSIVE")
            except sqlite3.OperationalError:
                return False
            connection.execute("ROLLBACK")
            return True
    (row,) = database_rows(
        url,
        "SELECT count(*) AS open FROM pg_stat_activity WHERE datname = current_database() "
        "AND pid <> pg_backend_pid() AND state IN ('active', 'idle in transaction', "
        "'idle in transaction (aborted)')",
    )
    return row["open"] == 0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--database",
        choices=(POSTGRESQL, SQLITE),
        default=os.environ.get("EMBEDSITE_TEST_DATABASE", POSTGRESQL),
        help="run the tests on a PostgreSQL they start (default) or on SQLite, the embedded default "
        "(environment: EMBEDSITE_TEST_DATABASE)",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser, args) -> None:
    """Before pytest-django loads the settings: DATABASE_URL names this run's backend (the server
    itself starts only when a test needs a database)."""
    global _databases
    # Before gRPC loads (no module imported so far loads it): the test processes hold gRPC channels
    # and fork children that exec servers at once. gRPC's fork handlers, on by default, run in
    # such a child between fork and exec and can leave it hung there (seen: a Celery worker that
    # never started, its log only "epoll_wait error: Bad file descriptor", the parent's "Other
    # threads are currently calling into gRPC, skipping fork() handlers"). No child uses gRPC
    # state it inherits (the client opens channels again after a fork), so they buy nothing here.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    _databases = RunDatabases(early_config.known_args_namespace.database)
    if _databases.url is None:
        os.environ.pop("DATABASE_URL", None)
    else:
        os.environ["DATABASE_URL"] = _databases.url


def pytest_report_header(config: pytest.Config) -> str:
    backend = run_databases().backend
    return f"database: {backend}" + (
        " (a PostgreSQL cluster of the run's own)" if backend == POSTGRESQL else ""
    )


def pytest_unconfigure(config: pytest.Config) -> None:
    if _databases is not None:
        _databases.stop()


def flush_restoring_content_types() -> None:
    """After each transactional test Django flushes every table, then its post_migrate signal makes
    the content types and permissions again, querying every installed app's: 25 s of the pytest
    processes' time a PostgreSQL pass. Here the first flush of each database runs as Django's, and
    its content types and permissions are kept; every later flush skips the signal and puts those
    rows back as they were, two INSERTs. On PostgreSQL those later flushes DELETE every table's rows
    (constraints deferred to the commit, as Django makes its foreign keys) rather than TRUNCATE
    them: a TRUNCATE gives each table and index new files, 120 ms for the emptied test database
    against 2 ms; the sequences are not reset either way. Tests that set `available_apps` or a
    serialized rollback keep Django's own teardown."""
    from django.contrib.auth.models import Permission
    from django.contrib.contenttypes.models import ContentType
    from django.core.management import call_command
    from django.db import connections, transaction
    from django.test import testcases

    djangos_teardown = testcases.TransactionTestCase._fixture_teardown
    made: dict[tuple[str, str], tuple[list[ContentType], list[Permission]]] = {}

    def _fixture_teardown(self) -> None:
        if self.available_apps is not None or self.serialized_rollback:
            djangos_teardown(self)
            return
        for alias in self._databases_names(include_mirrors=False):
            key = (alias, connections[alias].settings_dict["NAME"])
            if key not in made:
                call_command("flush", verbosity=0, interactive=False, database=alias, reset_sequences=False)
                made[key] = (list(ContentType.objects.using(alias)), list(Permission.objects.using(alias)))
                continue
            empty_every_table(alias)
            content_types, permissions = made[key]
            ContentType.objects.using(alias).bulk_create(content_types)
            Permission.objects.using(alias).bulk_create(permissions)
            ContentType.objects.clear_cache()

    def empty_every_table(alias: str) -> None:
        connection = connections[alias]
        if connection.vendor != "postgresql":
            call_command(
                "flush", verbosity=0, interactive=False, database=alias, reset_sequences=False,
                inhibit_post_migrate=True,
            )  # fmt: skip
            return
        tables = connection.introspection.django_table_names(only_existing=True, include_views=False)
        with transaction.atomic(using=alias), connection.cursor() as cursor:
            cursor.execute("SET CONSTRAINTS ALL DEFERRED")
            for table in tables:
                cursor.execute(f"DELETE FROM {connection.ops.quote_name(table)}")

    testcases.TransactionTestCase._fixture_teardown = _fixture_teardown


def wait_for_lock_waiters(count: int, timeout_s: float = 60.0) -> None:
    """Until `count` PostgreSQL sessions wait for a lock (another transaction's row or tuple): how a
    concurrency test knows each racing transaction has reached the point it races at. The timeout is
    a deadline against hanging, not a timing."""
    from django.db import connection

    deadline = time.monotonic() + timeout_s
    waiting = 0
    while time.monotonic() < deadline:
        with connection.cursor() as cursor:
            # pg_locks reads the lock manager live (pg_stat_activity would be one snapshot per transaction).
            cursor.execute("SELECT COUNT(DISTINCT pid) FROM pg_locks WHERE NOT granted")
            (waiting,) = cursor.fetchone()
        if waiting >= count:
            return
        time.sleep(0.02)
    raise AssertionError(f"{waiting} session(s) wait for a lock after {timeout_s:g} s, not {count}")
