"""The multi-host scenario, run inside the client host by tests/multihost/test_scale_out.py.

Hosts (tests/netns.py): db (PostgreSQL and Redis), triton-a and triton-b (`manage.py runtriton`),
web-a and web-b (`manage.py serve`, as runstack, compose and Kubernetes start it, both given the
two Tritons as TRITON_SERVER_URL), worker-a and worker-b (`celery worker`, as runstack starts it;
beat beside worker-b), and this client. Phases:

1. quota: 120 requests at once, split over both web hosts, against a burst of 40 and a rate of one
   a minute: exactly 40 may pass.
2. failover: clients sending all the time to both web hosts; triton-b's link drops every packet for
   12 s at least, and until 20 requests sent since have been answered, then comes back. Every
   answer, its time and status; triton-b's executions read each 0.5 s.
3. jobs: one tenant's 40-chunk job, then another tenant's 2-chunk job, on the two workers: the
   small one waits for at most the big one's chunks already queued (fair share across hosts); then
   a job with worker-a SIGKILLed while it holds a chunk's lease: the job completes on worker-b,
   each chunk's result stored once and its usage counted once.
4. web: clients on both web hosts; web-a SIGKILLed; what web-b answered meanwhile.

Everything started here is stopped here; the test deletes the hosts. Writes what it measured as
JSON to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from embeddings.tooling.triton_server import die_with_parent  # noqa: E402
from tests.netns import Host, Network  # noqa: E402
from tests.postgres_server import PostgresServer  # noqa: E402

PYTHON = sys.executable
TRITON_PORT, WEB_PORT, REDIS_PORT, POSTGRES_PORT = 8001, 8080, 6379, 5432
MODEL = "all-MiniLM-L6-v2"
# Requests sent after triton-b's link is cut and answered before it comes back, at least.
ANSWERED_WHILE_CUT_OFF = 20


class Processes:
    """Processes started on hosts, each logging to a file; all stopped at the end."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.running: dict[str, subprocess.Popen] = {}

    def start(self, name: str, host: Host, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = (self.workdir / f"{name}.log").open("ab")
        process = subprocess.Popen(
            host.command(*argv), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent,
        )  # fmt: skip
        self.running[name] = process
        return process

    def kill(self, name: str) -> None:
        process = self.running[name]
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    def stop_all(self) -> None:
        for process in self.running.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.running.values():
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)


def wait_for(what: str, check, timeout_s: float, processes: Processes, name: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except Exception:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{what} not ready in {timeout_s} s" + (f":\n{processes.log(name)[-3000:]}" if name else "")
            )
        time.sleep(0.25)


def executions(address: str) -> int | None:
    """The replica's model executions, or None when it does not answer within 0.4 s."""
    from embeddings.triton.client import TritonClient

    try:
        with TritonClient(f"{address}:{TRITON_PORT}", retries=0, timeout_s=0.4) as client:
            return client.model_statistics("minilm").execution_count
    except Exception:
        return None


async def send(http: httpx2.AsyncClient, base: str, key: str, text: str) -> tuple[float, float, str, int]:
    started = time.monotonic()
    try:
        response = await http.post(
            f"{base}/v1/embeddings",
            json={"model": MODEL, "input": text},
            headers={"Authorization": f"Bearer {key}"},
        )
        status = response.status_code
    except httpx2.HTTPError:
        status = 0  # no answer: refused or reset
    return started, time.monotonic(), base, status


async def steady_load(
    bases: list[str], key: str, done, deadline_s: float, clients: int, events, start: float
) -> list:
    """`clients` loops, each always with one request waiting, alternating over `bases`, from
    `start` (time.monotonic()) until `done(answers)` holds, or for `deadline_s` at most (against
    hanging: the test then finds what it waited for missing); `events`: (when, callable) run
    meanwhile on a thread, in order, `when` being seconds from `start` or a condition on the answers
    so far. Each answer as (sent, answered, base, status), times from `start`."""
    answers: list = []

    async def loop(number: int) -> None:
        async with httpx2.AsyncClient(timeout=60) as http:
            sent = 0
            while time.monotonic() - start < deadline_s and not done(answers):
                sent_at, answered_at, base, status = await send(
                    http, bases[(number + sent) % len(bases)], key, f"load {number} {sent}"
                )
                answers.append((sent_at - start, answered_at - start, base, status))
                sent += 1

    async def timeline() -> None:
        for when, action in events:
            if callable(when):
                while not when(answers) and time.monotonic() - start < deadline_s:
                    await asyncio.sleep(0.1)
            else:
                await asyncio.sleep(max(0.0, start + when - time.monotonic()))
            await asyncio.to_thread(action)

    await asyncio.gather(timeline(), *(loop(number) for number in range(clients)))
    return answers


async def burst(bases: list[str], key: str, count: int) -> list[int]:
    async with httpx2.AsyncClient(timeout=60, limits=httpx2.Limits(max_connections=count)) as http:
        answers = await asyncio.gather(
            *(send(http, bases[i % len(bases)], key, "burst") for i in range(count))
        )
    return [status for *_, status in answers]


class Clock:
    """Seconds each step of the scenario took, in order: where its time goes."""

    def __init__(self) -> None:
        self.started = self.last = time.monotonic()
        self.steps: list[tuple[str, float]] = []

    def mark(self, step: str) -> None:
        now = time.monotonic()
        self.steps.append((step, round(now - self.last, 2)))
        self.last = now


def command(*arguments: str) -> str:
    """`manage.py ARGUMENTS` run here, in this process (Django is set up once, not once a command);
    its stdout, stripped."""
    from django.core.management import call_command

    out = io.StringIO()
    call_command(*arguments, stdout=out, stderr=io.StringIO())
    return out.getvalue().strip()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--network", type=Path, required=True)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    network = Network.described(args.network)
    hosts = network.hosts
    processes = Processes(args.workdir)
    db = hosts["db"].address
    postgres = PostgresServer(port=POSTGRES_PORT, host=db, netns=hosts["db"].netns, clients="192.0.2.0/24")
    result: dict = {}
    clock = Clock()
    result["steps"] = clock.steps
    try:
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "embedsite.settings",
            "DATABASE_URL": postgres.url("embedsite"),  # created below
            "REDIS_URL": f"redis://{db}:{REDIS_PORT}/0",
            "JOB_STORE_URL": f"redis://{db}:{REDIS_PORT}/1",
            "TRITON_SERVER_URL": ",".join(
                f"{hosts[n].address}:{TRITON_PORT}" for n in ("triton-a", "triton-b")
            ),
            "TRITON_ATTEMPT_TIMEOUT_S": "2",
            "DJANGO_ALLOWED_HOSTS": ",".join(hosts[n].address for n in ("web-a", "web-b")),
            "JOB_CHUNK_LEASE_S": "3",
            "JOB_WATCHDOG_INTERVAL_S": "1",
            "JOB_STALL_S": "600",
            "JOB_CHUNK_SIZE": "8",
            "READY_CHECK_TIMEOUT_S": "3",
            # The jobs' usage stays in Redis, to be counted there: beat folds none of it away
            # while a phase runs (after a minute, the default, on a busy machine it did).
            "USAGE_FOLD_INTERVAL_S": "3600",
        }
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        # The Tritons first: loading the model is the longest step, and needs neither the database
        # nor Redis (the catalog they reconcile with once ready may still be empty; the model is
        # registered below, and loaded at start). They serve model_repository/ as shipped.
        for name in ("triton-a", "triton-b"):
            address = hosts[name].address
            run_dir = args.workdir / name
            run_dir.mkdir()
            processes.start(
                name, hosts[name], [PYTHON, "manage.py", "runtriton"],
                {**env, "TRITON_SERVER_URL": f"{address}:{TRITON_PORT}", "EMBEDSITE_RUN_DIR": str(run_dir)},
            )  # fmt: skip
        processes.start(
            "redis", hosts["db"],
            ["redis-server", "--bind", db, "--port", str(REDIS_PORT), "--save", "", "--appendonly", "no",
             "--protected-mode", "no"],
            dict(os.environ),
        )  # fmt: skip
        postgres.start()
        postgres.wait_until_ready()
        postgres.create_database("embedsite")
        os.environ.update(env)
        import django

        django.setup()
        import redis

        wait_for("redis", lambda: redis.Redis(host=db, port=REDIS_PORT).ping(), 30, processes, "redis")
        clock.mark("postgres and redis")
        command("migrate", "--noinput")
        clock.mark("migrate")
        # The workers and beat need no Triton to start: they start while the Tritons load.
        for name in ("worker-a", "worker-b"):
            processes.start(
                name, hosts[name],
                [PYTHON, "-m", "celery", "-A", "embedsite", "worker", "--pool", "solo", "--without-gossip",
                 "--without-mingle", "--loglevel", "INFO"],
                {**env, "EMBEDSITE_RUN_DIR": str(args.workdir / name)},
            )  # fmt: skip
        (args.workdir / "beat").mkdir()
        processes.start(
            "beat", hosts["worker-b"],
            [PYTHON, "-m", "celery", "-A", "embedsite", "beat", "--loglevel", "INFO"],
            {**env, "EMBEDSITE_RUN_DIR": str(args.workdir / "beat")},
        )  # fmt: skip
        keys = {}
        for slug, limits in (
            ("load", []),
            ("exact", ["--requests-per-minute", "1", "--request-burst", "40"]),
            ("bulk", []),
            ("small", []),
        ):
            command("create_tenant", "--name", slug, "--slug", slug, *limits)
            keys[slug] = command("create_api_key", "--tenant", slug)
        clock.mark("workers and beat started, tenants and keys")

        for name in ("triton-a", "triton-b"):
            wait_for(name, lambda n=name: executions(hosts[n].address) is not None, 300, processes, name)
        clock.mark("tritons")
        command("register_local_model")
        clock.mark("model registered")

        bases = {}
        for name in ("web-a", "web-b"):
            run_dir = args.workdir / name
            (run_dir / "prometheus").mkdir(parents=True)
            address = hosts[name].address
            processes.start(
                name, hosts[name], [PYTHON, "manage.py", "serve", "--host", address, "--port", str(WEB_PORT),
                                    "--workers", "1"],
                {**env, "EMBEDSITE_RUN_DIR": str(run_dir),
                 "PROMETHEUS_MULTIPROC_DIR": str(run_dir / "prometheus")},
            )  # fmt: skip
            bases[name] = f"http://{address}:{WEB_PORT}"
        for name, base in bases.items():
            wait_for(
                name,
                lambda b=base: httpx2.get(f"{b}/ready", timeout=5).status_code == 200,
                120,
                processes,
                name,
            )
        ready = httpx2.get(f"{bases['web-a']}/ready", timeout=10).json()
        result["ready_replicas"] = ready.get("replicas")
        both = [bases["web-a"], bases["web-b"]]
        clock.mark("web hosts")

        # 1. Quotas across the two web hosts.
        result["quota"] = {"statuses": asyncio.run(burst(both, keys["exact"], 120)), "burst": 40}
        clock.mark("1. quota")

        # 2. A Triton replica's link drops every packet, then comes back. It stays cut off for at
        # least min_drop_s, and until ANSWERED_WHILE_CUT_OFF requests sent after the drop have been
        # answered (a busy machine answers fewer a second: it waits longer, not fails). The load
        # goes on until triton-b has taken calls again (test_scale_out's `rejoined`), and a while after.
        samples: list[tuple[float, int | None]] = []
        stop_sampling = threading.Event()
        clock_start = time.monotonic()
        drop_at, min_drop_s, after_rejoin_s = 4.0, 12.0, 2.0
        # When the link really dropped and came back: on a busy machine the load's events run late.
        dropped_at: list[float] = []
        restored_at: list[float] = []
        rejoined_at: list[float] = []

        def drop() -> None:
            network.drop("triton-b")
            dropped_at.append(time.monotonic() - clock_start)

        def restore_due(answers: list) -> bool:
            if not dropped_at:
                return False
            cut_off_s = time.monotonic() - clock_start - dropped_at[0]
            answered = sum(1 for answer in answers if answer[0] > dropped_at[0])
            return cut_off_s >= min_drop_s and answered >= ANSWERED_WHILE_CUT_OFF

        def restore() -> None:
            network.restore("triton-b")
            restored_at.append(time.monotonic() - clock_start)

        def sample() -> None:
            while not stop_sampling.is_set():
                at, count = time.monotonic() - clock_start, executions(hosts["triton-b"].address)
                samples.append((at, count))
                after = [
                    count
                    for at, count in samples
                    if restored_at and at > restored_at[0] and count is not None
                ]
                if not rejoined_at and after and after[-1] >= after[0] + 3:
                    rejoined_at.append(at)
                stop_sampling.wait(0.5)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        answers = asyncio.run(
            steady_load(
                both, keys["load"],
                lambda answers: bool(rejoined_at) and answers[-1][0] > rejoined_at[0] + after_rejoin_s,
                drop_at + min_drop_s + 120, 6,
                [(drop_at, drop), (restore_due, restore)],
                clock_start,
            )
        )  # fmt: skip
        stop_sampling.set()
        sampler.join()
        result["failover"] = {
            "drop_at": dropped_at[0] if dropped_at else drop_at,
            # Never restored (the load's deadline came first): the end of the answers, for the test.
            "restore_at": restored_at[0] if restored_at else max(answer[1] for answer in answers),
            "answers": answers,
            "samples": samples,
        }
        clock.mark("2. failover")

        # 3. Jobs on workers of two hosts: fair share, then a worker SIGKILLed holding a chunk's lease.
        result["fair_share"] = fair_share(bases["web-a"], keys["bulk"], keys["small"], processes)
        clock.mark("3. fair share")
        result["worker"] = kill_a_worker_mid_job(processes, bases["web-b"], keys["load"])
        clock.mark("3. worker killed")

        # 4. A web host killed under load, until the other has answered well over the test's 10
        # requests sent after the kill, and the killed one refused a few.
        killed_at = 1.0

        def enough(answers: list) -> bool:
            survivor = [a for a in answers if a[2] == bases["web-b"] and a[0] > killed_at]
            victim = [a for a in answers if a[2] == bases["web-a"] and a[0] > killed_at + 0.5]
            return len(survivor) >= 30 and len(victim) >= 5

        answers = asyncio.run(
            steady_load(
                both, keys["load"], enough, 10.0, 4, [(killed_at, lambda: processes.kill("web-a"))],
                time.monotonic(),
            )
        )  # fmt: skip
        result["web"] = {"killed_at": killed_at, "answers": answers, "bases": bases}
        clock.mark("4. web host killed")
    finally:
        try:
            processes.stop_all()
            postgres.stop()
            clock.mark("stopped")
        finally:
            args.out.write_text(json.dumps(result))


def fair_share(base: str, bulk_key: str, small_key: str, processes: Processes) -> dict:
    """The chunks of a big job that started while a later, small job of another tenant waited."""
    from django.conf import settings

    from embeddings.models import EmbeddingJob
    from embeddings.redis.connections import redis_job_store
    from embeddings.services.jobs.leases import chunk_runs
    from embeddings.services.jobs.store import JobStore

    def submit(key: str, count: int) -> str:
        texts = [f"fair share {key[-6:]} {i}" for i in range(count)]
        headers = {"Authorization": f"Bearer {key}"}
        answer = httpx2.post(
            f"{base}/v1/jobs", json={"model": MODEL, "input": texts}, headers=headers, timeout=60
        )
        return answer.json()["id"]

    big, small = submit(bulk_key, 320), submit(small_key, 16)
    deadline = time.monotonic() + 240
    jobs = {}
    while len(jobs) < 2:
        if time.monotonic() > deadline:
            raise RuntimeError("the fair-share jobs did not finish")
        jobs = {
            job.public_id: job
            for job in EmbeddingJob.objects.filter(public_id__in=[big, small], status="completed")
        }
        time.sleep(0.2)
    started = {
        public_id: chunk_runs(JobStore(redis_job_store(), public_id, ttl_s=3600)).started_ms
        for public_id in (big, small)
    }
    small_created_ms = jobs[small].created_at.timestamp() * 1000
    small_done_ms = max(started[small].values())
    worker_chunks = {name: processes.log(name).count("job_chunk_task") for name in ("worker-a", "worker-b")}
    return {
        "big_chunks": len(started[big]),
        "small_chunks": len(started[small]),
        "big_started_meanwhile": sorted(
            chunk for chunk, at in started[big].items() if small_created_ms <= at <= small_done_ms
        ),
        "chunks_in_flight": settings.JOB_CHUNKS_IN_FLIGHT,
        "worker_chunk_lines": worker_chunks,
    }


def kill_a_worker_mid_job(processes: Processes, base: str, key: str) -> dict:
    from embeddings.models import EmbeddingJob
    from embeddings.redis.connections import redis_job_store
    from embeddings.services.jobs.leases import chunk_runs
    from embeddings.services.jobs.store import JobStore
    from tests.worker_stack import job_usage

    # Eight chunks: one for worker-a to be killed holding, the rest for worker-b meanwhile.
    texts = [f"document {i} " + "about the replicas of a model server " * 20 for i in range(64)]
    headers = {"Authorization": f"Bearer {key}"}
    job = httpx2.post(
        f"{base}/v1/jobs", json={"model": MODEL, "input": texts}, headers=headers, timeout=60
    ).json()
    store = JobStore(redis_job_store(), job["id"], ttl_s=3600)
    worker_pid = processes.running["worker-a"].pid
    deadline = time.monotonic() + 180
    victim = None
    while victim is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"worker-a took no chunk:\n{processes.log('worker-a')[-3000:]}")
        for field, value in store.client.hgetall(store.key("lease")).items():
            _, owner = value.decode().split(" ")
            if int(owner.rsplit(":", 1)[1]) == worker_pid and not store.is_chunk_done(int(field)):
                victim = int(field)
        time.sleep(0.02)
    processes.kill("worker-a")
    killed_done = store.is_chunk_done(victim)
    while True:
        job = httpx2.get(f"{base}/v1/jobs/{job['id']}", headers=headers, timeout=30).json()
        if job["status"] in ("completed", "failed") or time.monotonic() > deadline + 180:
            break
        time.sleep(0.5)
    rows = httpx2.get(
        f"{base}/v1/jobs/{job['id']}/results", params={"format": "jsonl"}, headers=headers, timeout=120
    ).text.splitlines()
    return {
        "status": job["status"],
        "counts": job["counts"],
        "indexes": sorted(json.loads(row)["index"] for row in rows),
        "total": len(texts),
        "victim_chunk": victim,
        "victim_done_before_kill": killed_done,
        "runs": chunk_runs(store).runs,
        "usage": job_usage(EmbeddingJob.objects.get(public_id=job["id"]).tenant_id),
        "prompt_tokens": job["usage"]["prompt_tokens"],
    }


if __name__ == "__main__":
    main()
