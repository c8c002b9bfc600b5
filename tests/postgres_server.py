"""A throwaway PostgreSQL cluster for the tests: Debian's `postgresql` binaries, `initdb` into a
temporary directory, a free loopback port, its unix socket in that directory."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

from embeddings.tooling.triton_server import die_with_parent

SUPERUSER = "embedsite"


class PostgresServerError(RuntimeError):
    """PostgreSQL is not installed, would not start, or stopped."""


def postgres_binary(name: str) -> str:
    """`initdb` or `postgres`: on PATH, else in Debian's /usr/lib/postgresql/<version>/bin (newest)."""
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(
        glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
        key=lambda path: int(Path(path).parts[-3]) if Path(path).parts[-3].isdigit() else 0,
    )
    if not candidates:
        raise PostgresServerError(
            f"{name} not found: the setup installs Debian's postgresql (`apt-get install postgresql`)"
        )
    return candidates[-1]


class PostgresServer:
    """One cluster, its data and socket under a fresh temporary directory that `stop` removes.

    PostgreSQL refuses to run as root: under root (CI) the cluster runs as Debian's `postgres`
    system user, which owns the directory. Clients connect over TCP on 127.0.0.1 with a random
    password (as a deployment would, through DATABASE_URL); the socket only serves the owner.
    """

    def __init__(self, *, port: int, host: str = "127.0.0.1", netns: str | None = None, clients: str = ""):
        """`netns`: run postgres in that network namespace (tests/netns.py), listening on `host`;
        `clients`: a network (CIDR) whose hosts may connect too, with the password."""
        self.port = port
        self.host = host
        self.netns = netns
        self.clients = clients
        self.password = secrets.token_urlsafe(24)
        self.directory = Path(tempfile.mkdtemp(prefix="embedsite-postgres-"))
        self.data_dir = self.directory / "data"
        self.log_path = self.directory / "postgres.log"
        self.process: subprocess.Popen | None = None
        self.run_as = pwd.getpwnam("postgres") if os.geteuid() == 0 else None

    def url(self, database: str) -> str:
        return f"postgres://{SUPERUSER}:{quote(self.password, safe='')}@{self.host}:{self.port}/{database}"

    def _user_options(self) -> dict:
        if self.run_as is None:
            return {}
        return {"user": self.run_as.pw_uid, "group": self.run_as.pw_gid, "extra_groups": []}

    def start(self) -> None:
        initdb, postgres = postgres_binary("initdb"), postgres_binary("postgres")
        if self.run_as is not None:
            os.chown(self.directory, self.run_as.pw_uid, self.run_as.pw_gid)
        password_file = self.directory / "password"
        password_file.write_text(self.password)
        if self.run_as is not None:
            os.chown(password_file, self.run_as.pw_uid, self.run_as.pw_gid)
        done = subprocess.run(
            [
                initdb, "-D", str(self.data_dir), "-U", SUPERUSER, f"--pwfile={password_file}",
                "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8", "--locale=C",
                "--no-sync", "--no-instructions",
            ],
            capture_output=True, text=True, timeout=120, cwd=self.directory, **self._user_options(),
        )  # fmt: skip
        password_file.unlink()
        if done.returncode != 0:
            raise PostgresServerError(f"initdb failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        if self.clients:
            with (self.data_dir / "pg_hba.conf").open("a") as hba:
                hba.write(f"host all all {self.clients} scram-sha-256\n")
        launcher, user_options = [], self._user_options()
        if self.netns is not None:
            # Into the namespace as root, then down to the postgres user (setpriv, util-linux).
            launcher = ["ip", "netns", "exec", self.netns]
            if self.run_as is not None:
                launcher += ["setpriv", f"--reuid={self.run_as.pw_uid}", f"--regid={self.run_as.pw_gid}",
                             "--clear-groups"]  # fmt: skip
            user_options = {}
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    *launcher, postgres, "-D", str(self.data_dir), "-p", str(self.port),
                    "-c", f"listen_addresses={self.host}", "-c", f"unix_socket_directories={self.directory}",
                    "-c", "unix_socket_permissions=0700",
                    # Room for every stack a test run has up at once (uvicorn workers, Celery, the tests).
                    "-c", "max_connections=300",
                    # A test cluster is thrown away: durability only costs time here.
                    "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
                ],
                cwd=self.directory, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=die_with_parent, **user_options,
            )  # fmt: skip

    def wait_until_ready(self, timeout_s: float = 60.0) -> None:
        import psycopg

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise PostgresServerError(f"postgres exited while starting; log:\n{self.log_tail()}")
            try:
                with psycopg.connect(self.url("postgres"), connect_timeout=2):
                    return
            except psycopg.OperationalError:
                time.sleep(0.1)
        raise PostgresServerError(
            f"postgres did not answer within {timeout_s:.0f} s; log:\n{self.log_tail()}"
        )

    def create_database(self, name: str) -> str:
        """A new, empty database; its URL."""
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.url("postgres"), autocommit=True) as connection:
            connection.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url(name)

    def end_sessions(self, database: str) -> None:
        """Disconnect every session on `database` (before it is dropped)."""
        import psycopg

        with psycopg.connect(self.url("postgres"), autocommit=True) as connection:
            connection.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = %s AND pid <> pg_backend_pid()",
                (database,),
            )

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-4000:]
        return ""

    def stop(self, timeout_s: float = 20.0) -> None:
        """Fast shutdown (SIGINT: open sessions are ended), SIGKILL after timeout_s; the directory goes."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=5)
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        self.start()
        self.wait_until_ready()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
