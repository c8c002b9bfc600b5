"""Schemathesis against the shipped server: every operation of /api/schema/ fuzzed with real API keys
(examples, coverage, fuzzing and stateful phases, positive and negative data) under every check
Schemathesis has: 0 server errors, 0 responses that disagree with the schema, 0 schema-valid requests
refused and 0 schema-invalid ones accepted, no response slower than the server's own deadline, and
no object of one tenant readable by the other (object_level_authorization, with two tenants' keys as
peers). The few refusals of schema-valid data that are right, because what refuses them cannot be
written in OpenAPI 3.0, are dropped one by one in schemathesis_hooks.py, which says why for each.

The server is uvicorn serving embedsite.asgi as runstack does, backed by the test Triton and a Redis
of this test's own. The fuzzer submits jobs with `callback_url`s of its choosing (it produced
`https://0.com`), so no callback may be delivered while it runs. That is guaranteed three ways:

1. Callbacks are delivered only by the Celery task `job_callback_task`, in a worker; the web process
   only enqueues it (when a job finishes or is deleted). No worker is started here.
2. The server's broker is a Redis started by this test and stopped at its end, without persistence:
   no other test's worker (tests/job_stack.py runs one on the shared test Redis) can ever see these
   messages, and they vanish with it.
3. A Celery worker takes a message from a Redis broker with BRPOP (kombu); Redis's own command
   statistics are checked after the run: no BRPOP (or any other pop) was ever served, so nothing
   took a single queued task.
4. The server's own Python code cannot reach past loopback: loopback_only/sitecustomize.py, loaded
   into it, refuses connections to other addresses and name lookups that would query DNS, and logs
   each refusal; the test checks that it is loaded and that no connection was refused (a lookup
   refused is counted: a callback policy that resolves hosts at submission does that).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx2
import pytest
import redis
from django.conf import settings

from embeddings.tooling.local_redis import RedisServer
from embeddings.tooling.triton_server import free_port
from tests.api.conftest import LiveServer, live_uvicorn
from tests.processes import manage
from tests.reliability.schemathesis_hooks import DROPPED_LOG_ENV, REASONS

# Fuzzed cases per operation; the examples phase sends the documented examples and the coverage
# phase its own boundary and type-violation cases on top.
MAX_EXAMPLES = 40
STATEFUL_MAX_STEPS = 15
MIN_CASES = 1000
FUZZ_TIMEOUT_S = 540
LOOPBACK_GUARD = Path(__file__).resolve().parent / "loopback_only"
HOOKS = Path(__file__).resolve().parent / "schemathesis_hooks.py"
GUARD_MARK = "loopback-only guard refused"
# How the CLI reports each phase's time: "Fuzzing (in 33.22s)".
PHASE_TIME = re.compile(r"(Examples|Coverage|Fuzzing|Stateful) \(in ([0-9.]+)s\)")
# How a consumer takes messages off a Redis list (Celery's Redis transport uses BRPOP).
POP_COMMANDS = ("brpop", "blpop", "rpop", "lpop", "brpoplpush", "rpoplpush", "lmove", "blmove", "lmpop")

FINISH_JOB = """
from embeddings.models import EmbeddingJob
from embeddings.services.jobs.engine import job_chunk_run
job = EmbeddingJob.objects.get(public_id={job_id!r})
for chunk in range(job.chunks):
    job_chunk_run(job_id=job.pk, chunk=chunk)
job.refresh_from_db()
print(job.status)
"""


@pytest.fixture(scope="module")
def fuzz_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """The fuzzed server's own Redis (quotas, usage, job data and the Celery broker)."""
    data_dir = tmp_path_factory.mktemp("fuzz_redis")
    with RedisServer(
        port=free_port(), data_dir=data_dir, persistent=False, log_path=data_dir / "redis.log"
    ) as server:
        yield server


@dataclass
class FuzzServer(LiveServer):
    # A key of another tenant: object_level_authorization's second peer.
    other_api_key: str = ""
    # A third tenant's key, for the run on a finished job of its own that the full run cannot see.
    results_api_key: str = ""


SETUP = """
import io, json, socket
from django.core.management import call_command
keys = {}
for slug in ("other", "results"):
    call_command("create_tenant", "--name", slug.title(), "--slug", slug, stdout=io.StringIO())
    key = io.StringIO()
    call_command("create_api_key", "--tenant", slug, stdout=key, stderr=io.StringIO())
    keys[slug] = key.getvalue().strip()
print(json.dumps({"guard": socket.getaddrinfo.__module__, "keys": keys}))
"""


@pytest.fixture(scope="module")
def fuzz_server(triton_server, fuzz_redis, tmp_path_factory) -> Iterator[FuzzServer]:
    """One uvicorn worker on fuzz_redis, its Python code held to loopback (LOOPBACK_GUARD), with a
    second and a third tenant and their keys."""
    with live_uvicorn(
        workdir=tmp_path_factory.mktemp("fuzz_server"),
        triton_target=triton_server.grpc_target,
        redis_url=fuzz_redis.url,
        workers=1,
        env={
            "CELERY_BROKER_URL": fuzz_redis.url,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(LOOPBACK_GUARD), os.environ.get("PYTHONPATH")])),
        },
    ) as server:
        # One `manage.py shell` as the server's Python: the guard loaded, the tenants made.
        setup = json.loads(manage(server.env, "shell", "-c", SETUP).splitlines()[-1])
        assert setup["guard"] == "sitecustomize", setup
        keys = setup["keys"]
        yield FuzzServer(**vars(server), other_api_key=keys["other"], results_api_key=keys["results"])


def finished_job(server: LiveServer, api_key: str) -> str:
    """A completed job of `api_key`'s tenant whose results the fuzzer downloads in every format:
    submitted over HTTP, its chunks run by the job engine in a one-off `manage.py shell` (no worker,
    no callback)."""
    response = httpx2.post(
        f"{server.base_url}/v1/jobs",
        json={"model": "all-MiniLM-L6-v2", "input": ["first text", "second text", "third text"]},
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=30,
    )
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    status = manage(server.env, "shell", "-c", FINISH_JOB.format(job_id=job_id)).splitlines()[-1]
    assert status == "completed", status
    return job_id


def pops_served(client: redis.Redis) -> dict[str, int]:
    stats = client.info("commandstats")
    return {name: stats[f"cmdstat_{name}"]["calls"] for name in POP_COMMANDS if f"cmdstat_{name}" in stats}


CONFIG = f"""
# How long generating data takes depends on the load of a shared CI machine, not on the schema.
suppress-health-check = ["too_slow"]
# The refusals of schema-valid data that are right, each on its operations (see the module).
hooks = "{HOOKS}"

[generation]
mode = "all"
max-examples = {MAX_EXAMPLES}
# Derandomized, and nothing kept between runs: CI replays the same cases every time.
deterministic = true
database = "none"
# The key comes from [auth.wfc] alone: as a generated header, negative data would spend its cases on
# requests without one (401s; ignored_auth checks that, once per operation).
with-security-parameters = false

# Every check is on (Schemathesis's default), and these two need settings: no answer may come later
# than the server's own deadline (a request past it is answered 504 at it), and each tenant's
# objects must stay its own (each peer replays the other's reads).
[checks]
max_response_time = {settings.EMBEDDING_TIMEOUT_S + 5}

[auth.wfc]
path = "auth.json"
user = "live"
peers = ["live", "other"]

[phases.stateful]
max-steps = {STATEFUL_MAX_STEPS}
"""


@dataclass
class FuzzRun:
    report: dict
    statuses: Counter  # responses by status code
    # 2xx answers to positive data by operation: what the exceptions leave accepted.
    accepted: Counter
    stateful_calls: int
    dropped: Counter  # refusals of schema-valid data dropped by HOOKS, by operation and reason
    wall_s: float
    output: str

    @property
    def cases(self) -> int:
        return self.report["test_cases"]["generated"]

    @property
    def phase_seconds(self) -> dict[str, float]:
        return {phase.lower(): float(s) for phase, s in PHASE_TIME.findall(self.output)}

    def summary(self) -> str:
        return (
            f"{self.cases} cases over {(self.report['operations'] or {}).get('tested')} operations "
            f"({self.stateful_calls} stateful calls) in {self.wall_s:.0f} s {self.phase_seconds}; "
            f"responses {dict(sorted(self.statuses.items()))}; failures {self.report['failures']}, "
            f"errors {self.report['errors']}; right refusals of valid data dropped: "
            f"{sum(self.dropped.values())} {dict(sorted(self.dropped.items()))}"
        )


def auth_document(live_key: str, other_key: str) -> str:
    """Two tenants' keys as a Web Fuzzing Commons auth document (what [auth.wfc] reads)."""
    users = {"live": live_key, "other": other_key}
    return json.dumps(
        {
            "auth": [
                {"name": name, "fixedHeaders": [{"name": "Authorization", "value": f"Bearer {key}"}]}
                for name, key in users.items()
            ]
        }
    )


def schemathesis_run(
    server: FuzzServer, workdir: Path, *, schema: Path, config: str, options: list[str], live_key: str
) -> FuzzRun:
    """`schemathesis run` (the CLI, as a developer would run it) against the server, with its
    /api/schema/ as saved in `schema`, as `live_key`'s tenant with the other tenant as its peer."""
    workdir.mkdir()
    (workdir / "schemathesis.toml").write_text(config)
    (workdir / "auth.json").write_text(auth_document(live_key, server.other_api_key))
    dropped_log = workdir / "dropped.jsonl"
    reports = workdir / "reports"
    started = time.monotonic()
    run = subprocess.run(
        [
            sys.executable, "-m", "schemathesis.cli", "--config-file", str(workdir / "schemathesis.toml"),
            "run", str(schema), "--url", server.base_url,
            # One worker: the 2 cores are shared with the server, Triton and the other run.
            "--workers", "1", "--no-color", "--report", "json,ndjson,junit", "--report-dir", str(reports),
            *options,
        ],
        cwd=workdir, capture_output=True, text=True, timeout=FUZZ_TIMEOUT_S,
        env={**os.environ, DROPPED_LOG_ENV: str(dropped_log)},
    )  # fmt: skip
    wall_s = time.monotonic() - started
    output = run.stdout + run.stderr
    reports_written = list(reports.glob("json-*.json"))
    assert reports_written, output[-20000:]
    statuses: Counter = Counter()
    accepted: Counter = Counter()
    stateful_calls = 0
    for line in next(reports.glob("ndjson-*.ndjson")).read_text().splitlines():
        finished = json.loads(line).get("ScenarioFinished")
        if not finished:
            continue
        recorder = finished.get("recorder", {})
        interactions = recorder.get("interactions", {})
        for case_id, interaction in interactions.items():
            status = (interaction.get("response") or {}).get("status_code")
            statuses[status] += 1
            case = recorder.get("cases", {}).get(case_id, {}).get("value", {})
            mode = (case.get("meta") or {}).get("generation", {}).get("mode")
            if mode == "positive" and 200 <= (status or 0) < 300:
                accepted[f"{case.get('method')} {case.get('path')}"] += 1
        if finished.get("phase") == "stateful":
            stateful_calls += len(interactions)
    entries = [
        json.loads(line) for line in (dropped_log.read_text() if dropped_log.exists() else "").splitlines()
    ]
    # Every dropped refusal is one of the documented exceptions.
    assert {entry["reason"] for entry in entries} <= set(REASONS), entries
    dropped = Counter(f"{entry['operation']}: {entry['reason']} ({entry['param']})" for entry in entries)
    report = json.loads(reports_written[0].read_text())
    fuzz_run = FuzzRun(report, statuses, accepted, stateful_calls, dropped, wall_s, output)
    assert fuzz_run.report["failures"] == [] and fuzz_run.report["errors"] == [], (
        f"{fuzz_run.summary()}\n{output[-20000:]}"
    )
    assert run.returncode == 0, output[-20000:]
    assert all(phase["status"] in ("success", "skip") for phase in fuzz_run.report["phases"].values()), (
        fuzz_run.report["phases"]
    )
    # The report counted each dropped refusal.
    assert fuzz_run.report["filtered"] == sum(dropped.values()), (fuzz_run.report["filtered"], dropped)
    return fuzz_run


def test_schemathesis_finds_no_server_error_and_no_schema_violation(fuzz_server, fuzz_redis, tmp_path):
    broker = redis.Redis.from_url(fuzz_redis.url)
    # The results of a finished job in a run of their own, beside the full run: the job is the third
    # tenant's, whose key only this run has, since the full run deletes the jobs it finds (the
    # check that a deleted job stays gone).
    job_id = finished_job(fuzz_server, fuzz_server.results_api_key)
    # The schema read once, for both runs: two runs loading it at once from a busy server timed out.
    schema = tmp_path / "schema.json"
    schema.write_bytes(httpx2.get(f"{fuzz_server.base_url}/api/schema/?format=json", timeout=120).content)
    with ThreadPoolExecutor(2) as runs:
        results_run = runs.submit(
            schemathesis_run,
            fuzz_server,
            tmp_path / "results",
            schema=schema,
            config=CONFIG
            + f"""
[[operations]]
include-operation-id = "retrieve_job_results"
parameters = {{ job_id = "{job_id}" }}
""",
            options=[
                "--include-operation-id",
                "retrieve_job_results",
                "--phases",
                "examples,coverage,fuzzing",
            ],
            live_key=fuzz_server.results_api_key,
        )
        full_run = runs.submit(
            schemathesis_run,
            fuzz_server,
            tmp_path / "all",
            schema=schema,
            config=CONFIG,
            options=[],
            live_key=fuzz_server.api_key,
        )
        results, full = results_run.result(), full_run.result()
    assert results.statuses[200] > 0, results.summary()
    summary = f"results of a finished job: {results.summary()}\nall operations: {full.summary()}"
    print(f"\nschemathesis: {summary}")
    # 28: the 14 operations of embeddings (Cohere's /v2/embed among them), models, usage and jobs,
    # 3 of rerank, TEI's tokenize and decode, and 9 of the Files and Batches API.
    assert full.report["operations"]["tested"] == full.report["operations"]["total"] == 28, summary
    assert full.report["phases"]["stateful"]["status"] == "success" and full.stateful_calls > 0, summary
    assert full.cases >= MIN_CASES, summary
    # The exceptions leave every operation schema-valid requests it accepted, so none is hollowed out
    # by them (a finished job's results: in the first run).
    paths = httpx2.get(f"{fuzz_server.base_url}/api/schema/?format=json", timeout=30).json()["paths"]
    operations = {f"{method.upper()} {path}" for path, methods in paths.items() for method in methods}
    accepted = full.accepted + results.accepted
    never_accepted = sorted(op for op in operations if not accepted[op])
    assert len(operations) == 28 and not never_accepted, (never_accepted, dict(accepted))
    # Nothing consumed the queue the server filled: no worker ran, no callback was delivered.
    assert pops_served(broker) == {}, pops_served(broker)
    # Kombu keeps each broker priority in its own list (`celery`, `celery\x06\x166`, ...).
    queues = [key for key in broker.scan_iter(b"celery*") if broker.type(key) == b"list"]
    queued = Counter(
        json.loads(message)["headers"]["task"] for key in queues for message in broker.lrange(key, 0, -1)
    )
    print(f"left queued, never taken: {dict(queued)}")
    assert queued["embeddings.tasks.job_chunk_task"] > 0, queued
    server_log = fuzz_server.log_path.read_text()
    refused = [line for line in server_log.splitlines() if line.startswith(GUARD_MARK)]
    print(f"refused by the loopback-only guard: {len(refused)} ({refused[:3]})")
    assert not [line for line in refused if "a connection" in line], refused
    assert "Traceback" not in server_log, server_log[-5000:]
