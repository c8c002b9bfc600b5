"""Faults injected into the real stack while clients use it: Triton SIGKILLed under load, Redis
SIGKILLed under load, uvicorn SIGKILLed in the middle of a job upload. Each test starts its own
Triton, Redis or uvicorn (never the session's), and derives its bounds from the settings it gives
the server and from the latencies it measured before the fault."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
import redis
from django.conf import settings

from embeddings.tooling.local_redis import RedisServer
from embeddings.tooling.triton_server import TritonServer, free_port
from embeddings.triton.client import channel_options
from tests.conftest import serving_model_folder
from tests.database_backend import database_rows
from tests.processes import manage
from tests.reliability.live import Answer, LiveApi, Load, site_prepared


@pytest.fixture
def own_redis(tmp_path) -> Iterator[RedisServer]:
    """A redis-server of this test's own, which it may kill."""
    with RedisServer(
        port=free_port(), data_dir=tmp_path / "redis", persistent=False, log_path=tmp_path / "redis.log"
    ) as server:
        yield server


def own_triton(run_dir: Path) -> TritonServer:
    """A Triton of this test's own, which it may kill, started (not yet ready): the exported minilm
    alone, one instance, which is all the test calls; less to load at each start."""
    repository = run_dir / "models"
    serving_model_folder(repository, "minilm")
    server = TritonServer(
        model_repositories=[repository], run_dir=run_dir, log_path=run_dir / "faults-triton.log",
        grpc_port=free_port(), http_port=free_port(), metrics_port=free_port(),
    )  # fmt: skip
    server.start()
    return server


def _figures(answers: list[Answer]) -> str:
    times = sorted(answer.elapsed_s for answer in answers)
    return f"{len(times)} answers, median {statistics.median(times):.3f} s, max {times[-1]:.3f} s"


def _check_outage(load: Load, *, killed_at: float, restarting_at: float, code: str, bound_s: float) -> None:
    """Every answer was 200 or 503 `code` within bound_s, none hung or dropped; every request sent
    and answered while the component was down (those in flight at the kill aside) was 503 `code`."""
    answers = load.between(0)
    assert not [answer for answer in answers if answer.status is None], "a request hung or was dropped"
    refused = [answer for answer in answers if answer.status != 200]
    assert {(answer.status, answer.code) for answer in refused} == {(503, code)}
    assert max(answer.elapsed_s for answer in refused) <= bound_s, _figures(refused)
    down = [answer for answer in load.between(killed_at + bound_s) if answer.ended < restarting_at]
    assert {answer.status for answer in down} == {503}


def test_triton_killed_under_load(tmp_path, own_redis):
    """SIGKILL a Triton of this test's own while four clients embed through uvicorn: 503
    model_unavailable within TRITON_TIMEOUT_S (retries included) of each request's own overhead,
    never a hang; Triton started again on the same ports serves them again."""
    triton = own_triton(tmp_path)
    api = None
    try:
        triton_timeout_s = 2.0
        # The site is prepared while Triton loads.
        env, key = site_prepared(
            tmp_path,
            TRITON_SERVER_URL=triton.grpc_target,
            TRITON_TIMEOUT_S=str(triton_timeout_s),
            TRITON_RETRIES="1",
            REDIS_URL=own_redis.url,
        )
        triton.wait_until_ready(settings.TRITON_STARTUP_TIMEOUT_S)
        api = LiveApi(env, key, tmp_path / "uvicorn.log")
        api.start()
        with Load(api) as load:
            started = time.monotonic()
            load.wait_for(lambda answer: answer.status == 200, after=started)
            time.sleep(1.5)
            killed_at = time.monotonic()
            triton.kill()
            healthy = [answer for answer in load.between(started, killed_at) if answer.ended < killed_at]
            # A refused request spends at most the Triton deadline (retries included) in the call,
            # plus what the service does around it, bounded by a whole healthy request's time.
            healthy_max_s = max(answer.elapsed_s for answer in healthy)
            bound_s = triton_timeout_s + 2 * healthy_max_s
            # Down until a request sent once that bound had passed was refused (what _check_outage
            # checks the outage by).
            load.wait_for(lambda answer: answer.status == 503, after=killed_at + bound_s)
            restarting_at = time.monotonic()
            triton.start()
            triton.wait_until_ready(settings.TRITON_STARTUP_TIMEOUT_S)
            ready_at = time.monotonic()
            # Each of the client's channels reconnects on its own backoff, capped by the channel
            # options and randomised by ±20% (gRPC's connection-backoff JITTER): by then, plus a
            # healthy request's own time, every request must be served again.
            backoff_cap_s = dict(channel_options())["grpc.max_reconnect_backoff_ms"] / 1000
            reconnect_cap_s = 1.2 * backoff_cap_s + max(answer.elapsed_s for answer in healthy)
            back = load.wait_for(lambda answer: answer.status == 200, after=restarting_at)
            time.sleep(max(0.0, ready_at + reconnect_cap_s + 2 - time.monotonic()))
        assert {answer.status for answer in healthy} == {200}
        _check_outage(
            load, killed_at=killed_at, restarting_at=restarting_at, code="model_unavailable", bound_s=bound_s
        )
        late = [
            (round(answer.started - ready_at, 2), answer.status, answer.code)
            for answer in load.between(ready_at + reconnect_cap_s)
            if answer.status != 200
        ]
        assert late == [], (late, reconnect_cap_s)
        refused_after_ready = [
            answer for answer in load.between(0) if answer.status != 200 and answer.ended > ready_at
        ]
        first_s = back.ended - ready_at
        all_s = max([first_s] + [answer.ended - ready_at for answer in refused_after_ready])
        refused = [answer for answer in load.between(0) if answer.status == 503]
        print(
            f"\nTriton killed under load: healthy {_figures(healthy)}; 503 model_unavailable: "
            f"{_figures(refused)} (bound {bound_s:.2f} s); "
            f"restarted, ready in {ready_at - restarting_at:.1f} s; "
            f"then first 200 in {first_s:.2f} s, last 503 at {all_s:.2f} s "
            f"(reconnect backoff cap {backoff_cap_s:g} s, jittered, plus a request)"
        )
    finally:
        if api is not None:
            api.stop()
        triton.stop(timeout_s=0)  # its whole process group: no backend stub of the killed one is left either


def test_redis_killed_under_load(tmp_path, own_redis, triton_server):
    """SIGKILL this test's Redis while a tenant with quotas embeds through uvicorn: 503
    quota_unavailable within REDIS_TIMEOUT_S per Redis call, /ready names Redis; a Redis started
    again on the same port serves them again."""
    redis_timeout_s, ready_check_timeout_s = 0.5, 2.0
    env, key = site_prepared(
        tmp_path,
        TRITON_SERVER_URL=triton_server.grpc_target,
        REDIS_URL=own_redis.url,
        REDIS_TIMEOUT_S=str(redis_timeout_s),
        READY_CHECK_TIMEOUT_S=str(ready_check_timeout_s),
    )
    api = LiveApi(env, key, tmp_path / "uvicorn.log")
    try:
        api.start()
        with Load(api) as load:
            started = time.monotonic()
            load.wait_for(lambda answer: answer.status == 200, after=started)
            time.sleep(1.5)
            killed_at = time.monotonic()
            own_redis.kill()
            healthy = [answer for answer in load.between(started, killed_at) if answer.ended < killed_at]
            # A request makes at most two Redis calls (reserve, settle), each under REDIS_TIMEOUT_S.
            healthy_max_s = max(answer.elapsed_s for answer in healthy)
            bound_s = 2 * redis_timeout_s + 2 * healthy_max_s
            load.wait_for(lambda answer: answer.status == 503, after=killed_at)
            ready_started = time.monotonic()
            ready = httpx2.get(f"{api.base_url}/ready", timeout=30)
            ready_s = time.monotonic() - ready_started
            # Down until a request sent once that bound had passed was refused (what _check_outage
            # checks the outage by).
            load.wait_for(lambda answer: answer.status == 503, after=killed_at + bound_s)
            restarting_at = time.monotonic()
            own_redis.start()
            own_redis.wait_until_ready()
            ready_at = time.monotonic()
            back = load.wait_for(lambda answer: answer.status == 200, after=restarting_at)
            time.sleep(1.0)
        assert {answer.status for answer in healthy} == {200}
        # One server holds both roles here (JOB_STORE_URL unset), so both checks name it.
        assert ready.status_code == 503 and ready.json()["failed"] == ["redis", "job_store"], ready.text
        assert ready_s <= ready_check_timeout_s + healthy_max_s
        _check_outage(
            load, killed_at=killed_at, restarting_at=restarting_at, code="quota_unavailable", bound_s=bound_s
        )
        assert {answer.status for answer in load.between(back.ended)} == {200}
        # Counted from the restart (Redis answers before the readiness poll notices).
        recovery_s = back.ended - restarting_at
        assert recovery_s <= (ready_at - restarting_at) + bound_s
        assert httpx2.get(f"{api.base_url}/ready", timeout=30).status_code == 200
        refused = [answer for answer in load.between(0) if answer.status == 503]
        print(
            f"\nRedis killed under load: healthy {_figures(healthy)}; 503 quota_unavailable: "
            f"{_figures(refused)} (bound {bound_s:.2f} s); /ready 503 naming redis in {ready_s:.2f} s; "
            f"first 200 {recovery_s:.3f} s after the restart began"
        )
    finally:
        api.stop()


QUOTA_TOKENS_USED = """
import json
from embeddings.models import Tenant
from embeddings.services.quotas.limits import quota_status_sync
print(json.dumps(quota_status_sync(Tenant.objects.get(slug="faults").pk)["tenant"]["tokens_per_day"]["used"]))
"""


def _multipart(boundary: str, data: bytes) -> bytes:
    return (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="model"\r\n\r\nall-MiniLM-L6-v2\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="corpus.txt"\r\n'
            "Content-Type: text/plain\r\n\r\n"
        ).encode()
        + data
        + f"\r\n--{boundary}--\r\n".encode()
    )


def test_uvicorn_killed_mid_upload_leaves_nothing(tmp_path, own_redis, triton_server):
    """A 2 MB job upload streamed slowly; the server's process group is SIGKILLed when half of it
    is sent: no job row, no Redis key of a job, no tokens reserved. Started again, the server takes
    the same upload normally."""
    env, key = site_prepared(
        tmp_path,
        TRITON_SERVER_URL=triton_server.grpc_target,
        REDIS_URL=own_redis.url,
        CELERY_BROKER_URL=own_redis.url,
    )
    api = LiveApi(env, key, tmp_path / "uvicorn.log")
    corpus = "".join(
        f"line {index} of a corpus whose upload the server does not survive\n" for index in range(30_000)
    )
    body = _multipart("faultsboundary", corpus.encode())
    headers = {**api.headers, "Content-Type": "multipart/form-data; boundary=faultsboundary"}
    piece = 32 * 1024

    killed_after: list[int] = []

    def slowly():
        for offset in range(0, len(body), piece):
            if offset >= len(body) // 2 and not killed_after:
                api.kill()
                killed_after.append(offset)
            yield body[offset : offset + piece]
            time.sleep(0.01)

    store = redis.Redis.from_url(own_redis.url)
    try:
        api.start()
        with pytest.raises(httpx2.TransportError):
            httpx2.post(
                f"{api.base_url}/v1/jobs",
                content=slowly(),
                headers={**headers, "Content-Length": str(len(body))},
                timeout=60,
            )
        assert killed_after and api.process.returncode is not None
        assert database_rows(env["DATABASE_URL"], "SELECT COUNT(*) AS jobs FROM embeddings_embeddingjob") == [
            {"jobs": 0}
        ]
        assert store.keys("job:*") == [] and store.keys("jobs:*") == []
        assert json.loads(manage(env, "shell", "-c", QUOTA_TOKENS_USED).splitlines()[-1]) == 0

        restarted = time.monotonic()
        api.start()
        reply = httpx2.post(f"{api.base_url}/v1/jobs", content=body, headers=headers, timeout=60)
        served_s = time.monotonic() - restarted
        assert reply.status_code == 202, reply.text
        job = reply.json()
        assert job["status"] == "queued" and job["counts"]["total"] == 30_000
        rows = database_rows(
            env["DATABASE_URL"], "SELECT public_id, reserved_tokens FROM embeddings_embeddingjob"
        )
        assert [row["public_id"] for row in rows] == [job["id"]]
        assert {name.decode().split(":")[1] for name in store.keys("job:*")} == {f"{{{job['id']}}}"}
        used = json.loads(manage(env, "shell", "-c", QUOTA_TOKENS_USED).splitlines()[-1])
        assert used == rows[0]["reserved_tokens"] > 0
        print(
            f"\nuvicorn killed after {killed_after[0]:,} of {len(body):,} bytes of an upload: nothing left; "
            f"restarted, it answered the same upload 202 in {served_s:.1f} s (start included)"
        )
    finally:
        api.stop()
