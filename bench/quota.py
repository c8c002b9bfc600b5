"""Benchmark what quotas cost a request: latency with quotas on against the same endpoint with them off.

Run: `make bench-quota` (or `.venv/bin/python bench/quota.py [--quick]`). Starts its own Triton,
redis-server, SQLite database and two uvicorn servers (one worker each) on free ports, sharing the
database and Redis: one with QUOTAS_ENABLED=true, one with QUOTAS_ENABLED=false. Then sends
sequential requests (one at a time, batch 1, base64, the instant test model so inference costs
next to nothing), interleaved across four configurations so drift hits all of them alike:

    off               quotas disabled; the key's tenant and key have every limit set
    on, no limits     quotas enabled; a tenant without limits (no quota work, usage still counted)
    on, tenant        quotas enabled; the tenant has RPM, TPM, day, month and concurrency limits
    on, tenant + key  the same, and the key has its own five: the script checks 4 rate cells,
                      4 budget counters and 2 lease sets, then a second script releases the leases

Every configuration authenticates (the key is cached in process) and counts usage in Redis in one
round trip; the difference from `off` is the quota work: one more round trip (the reserve script,
before inference), its arguments and the headers. For scale it also times one bare Redis PING
after the same idle gap as between requests.

Then, against the same Redis, the asyncio transports (embeddings.redis.transport) run the request
path's operations back to back, interleaved, for the `tenant + key` plan: the hand-written lean
client against redis-py's asyncio client, with its pure-Python parser and (when hiredis is
importable) with hiredis: reserve, settle (release with usage), settle with the request's activity
counters too (what every API request's settle writes since the operations overview:
embeddings/services/quotas/activity.py; "settle" alone is what it wrote before) and status, p50/p90
in microseconds; the reserve and settle scripts' own time inside Redis (INFO commandstats,
microseconds per call; settle with and without the activity counters, alternated), and the Python
time to build a request's activity counters. Prints tables and writes bench/results/quota.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx2

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from api import INSTANT_MODEL, Server, bench_triton  # noqa: E402
from triton_client import percentile  # noqa: E402

BIG = 10**12  # limits that are never reached, so every request does the full quota work
LIMITS = ["--requests-per-minute", str(10**9), "--tokens-per-minute", str(BIG), "--tokens-per-day", str(BIG),
          "--tokens-per-month", str(BIG), "--max-concurrent-requests", str(10**6)]  # fmt: skip
KEY_LIMITS = (
    "dict(requests_per_minute=10**9, tokens_per_minute=10**12, tokens_per_day=10**12, "
    "tokens_per_month=10**12, max_concurrent_requests=10**6)"
)


def manage(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), *args], env=env, check=True, capture_output=True, text=True
    )
    return done.stdout.strip()


def prepare_database(env: dict[str, str]) -> dict[str, str]:
    """Migrate, register the models, and make the tenants and keys; returns slug -> key."""
    manage(env, "migrate", "--noinput", "-v", "0")
    manage(env, "register_local_model")
    manage(
        env,
        "shell",
        "-c",
        "from embeddings.models import EmbeddingModel as M; "
        f"M.objects.update_or_create(name={INSTANT_MODEL!r}, defaults=dict(triton_model='instant_1024', "
        "dimensions=1024, max_tokens=256))",
    )
    manage(env, "create_tenant", "--name", "Free", "--slug", "free")
    manage(env, "create_tenant", "--name", "Tenant limits", "--slug", "tenant", *LIMITS)
    manage(env, "create_tenant", "--name", "Both limits", "--slug", "both", *LIMITS)
    keys = {slug: manage(env, "create_api_key", "--tenant", slug) for slug in ("free", "tenant", "both")}
    manage(
        env,
        "shell",
        "-c",
        "from embeddings.models import ApiKey; "
        "from embeddings.services.accounts.tenants import quota_limits_update; "
        f"quota_limits_update(owner=ApiKey.objects.get(tenant__slug='both'), limits={KEY_LIMITS})",
    )
    return keys


def measure(configurations: list[tuple[str, Server, str]], requests: int, warmup: int) -> list[dict]:
    body = {"model": INSTANT_MODEL, "input": "hello", "encoding_format": "base64"}
    clients = [
        httpx2.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        for _, server, key in configurations
    ]
    latencies: list[list[float]] = [[] for _ in configurations]
    try:
        for round_number in range(warmup + requests):
            for index, http in enumerate(clients):
                started = time.perf_counter()
                response = http.post("/v1/embeddings", json=body)
                elapsed = (time.perf_counter() - started) * 1000
                response.raise_for_status()
                if round_number >= warmup:
                    latencies[index].append(elapsed)
            if round_number == warmup:
                limited = clients[-1].post("/v1/embeddings", json=body).headers
                assert "x-ratelimit-remaining-tokens" in limited, "the limited configuration sent no headers"
    finally:
        for http in clients:
            http.close()
    rows = []
    for (name, _, _), values in zip(configurations, latencies, strict=True):
        rows.append(
            {
                "configuration": name,
                "requests": len(values),
                "p50_ms": percentile(values, 0.5),
                "p90_ms": percentile(values, 0.9),
            }
        )
    baseline = rows[0]
    for row in rows:
        row["overhead_p50_ms"] = row["p50_ms"] - baseline["p50_ms"]
        row["overhead_p90_ms"] = row["p90_ms"] - baseline["p90_ms"]
    return rows


def redis_round_trip_ms(url: str, gap_s: float, count: int) -> float:
    """p50 of one PING sent after `gap_s` idle, as each request's quota script is: on a VM an idle
    process and Redis must be woken, which costs far more than a round trip in a busy loop."""
    import redis

    client = redis.Redis.from_url(url)
    latencies = []
    for _ in range(count):
        time.sleep(gap_s)
        started = time.perf_counter()
        client.ping()
        latencies.append((time.perf_counter() - started) * 1000)
    client.close()
    return percentile(latencies, 0.5)


TRANSPORT_KEY_LIMITS = dict(
    requests_per_minute=10**9,
    tokens_per_minute=BIG,
    tokens_per_day=BIG,
    tokens_per_month=BIG,
    max_concurrent_requests=10**6,
)


def measure_transports(env: dict[str, str], rounds: int) -> dict:
    """p50/p90 (µs) of reserve, settle and status on the lean client and on redis-py's, interleaved."""
    import asyncio

    os.environ.update(env)
    import django
    from django.conf import settings

    django.setup()
    import redis.asyncio
    import redis.utils
    from redis._parsers import _AsyncHiredisParser, _AsyncRESP2Parser

    from embeddings.redis.connections import reset_redis_clients
    from embeddings.redis.transport import operation_run

    settings.REDIS_URL = env["REDIS_URL"]  # settings may have been read before env was set
    reset_redis_clients()
    from embeddings.callers import Caller
    from embeddings.services.quotas.activity import activity_counters
    from embeddings.services.quotas.limits import (
        QuotaLimitValues,
        reserve_operation,
        settle_operation,
        status_operation,
    )
    from embeddings.services.quotas.usage import UsageEvent

    limits = QuotaLimitValues(**TRANSPORT_KEY_LIMITS)
    caller = Caller(10**6, 10**6, limits, limits)  # ids no tenant of the bench has
    usage = UsageEvent(10**6, 10**6, INSTANT_MODEL, "openai", "succeeded", 1, 1, 1)

    # redis-py picks hiredis when it is importable; then its pure-Python parser is timed too.
    parsers = {"redis-py": _AsyncRESP2Parser}
    if redis.utils.HIREDIS_AVAILABLE:
        parsers["redis-py+hiredis"] = _AsyncHiredisParser

    async def run() -> dict:
        clients = {
            name: redis.asyncio.Redis.from_url(env["REDIS_URL"], parser_class=parser)
            for name, parser in parsers.items()
        }
        transports = {"lean": {}, **{name: {"client": client} for name, client in clients.items()}}
        operations = ("reserve", "settle", "settle+activity", "status")
        timings = {(op, name): [] for op in operations for name in transports}
        try:
            for round_number in range(rounds + rounds // 10):
                for name, options in transports.items():
                    started = time.perf_counter()
                    reservation = await operation_run(reserve_operation(caller, 1, 1, None), **options)
                    reserved = time.perf_counter()
                    await operation_run(settle_operation(reservation, False, usage), **options)
                    settled = time.perf_counter()
                    reservation = await operation_run(reserve_operation(caller, 1, 1, None), **options)
                    reserved_again = time.perf_counter()
                    counted = settle_operation(reservation, False, usage, None, activity_counters(usage))
                    await operation_run(counted, **options)
                    settled_with_activity = time.perf_counter()
                    await operation_run(status_operation(caller, time.time()), **options)
                    done = time.perf_counter()
                    if round_number >= rounds // 10:  # the first tenth warms up
                        timings[("reserve", name)].append((reserved - started) * 1e6)
                        timings[("settle", name)].append((settled - reserved) * 1e6)
                        timings[("settle+activity", name)].append(
                            (settled_with_activity - reserved_again) * 1e6
                        )
                        timings[("status", name)].append((done - settled_with_activity) * 1e6)
        finally:
            for client in clients.values():
                await client.aclose()
        return timings

    async def script_time_in_redis() -> float:
        """Microseconds per call Redis spends running the reserve script (its own clock)."""
        client = redis.asyncio.Redis.from_url(env["REDIS_URL"])
        try:
            await client.config_resetstat()
            for _ in range(rounds):
                reservation = await operation_run(reserve_operation(caller, 1, 1, None))
                await client.zrem(reservation.leases[0].key, reservation.lease_member)
                await client.zrem(reservation.leases[1].key, reservation.lease_member)
            stats = await client.info("commandstats")
            return float(stats["cmdstat_evalsha"]["usec_per_call"])
        finally:
            await client.aclose()

    async def settle_script_times_in_redis(alternations: int = 4) -> dict[str, list[float]]:
        """Microseconds per call Redis spends in the settle script, without and with the activity
        counters, alternated (commandstats sums every EVALSHA: one kind of call per count)."""
        client = redis.asyncio.Redis.from_url(env["REDIS_URL"])
        times: dict[str, list[float]] = {"settle": [], "settle+activity": []}
        try:
            for _ in range(alternations):
                for kind in times:
                    activity = activity_counters(usage) if kind == "settle+activity" else ()
                    await client.config_resetstat()
                    for _ in range(rounds):
                        await operation_run(settle_operation(None, False, usage, None, activity))
                    stats = await client.info("commandstats")
                    times[kind].append(float(stats["cmdstat_evalsha"]["usec_per_call"]))
        finally:
            await client.aclose()
        return times

    def activity_build_us() -> float:
        """Python's time to build one request's activity counters (its fields cached per model)."""
        started = time.perf_counter()
        for _ in range(rounds * 10):
            activity_counters(usage)
        return (time.perf_counter() - started) * 1e6 / (rounds * 10)

    timings = asyncio.run(run())
    reserve_script_us = asyncio.run(script_time_in_redis())
    settle_script_us = asyncio.run(settle_script_times_in_redis())
    rows = [
        {
            "operation": operation,
            "transport": name,
            "p50_us": percentile(values, 0.5),
            "p90_us": percentile(values, 0.9),
        }
        for (operation, name), values in timings.items()
    ]
    return {
        "hiredis": bool(redis.utils.HIREDIS_AVAILABLE),
        "rounds": rounds,
        "rows": rows,
        "reserve_script_us_in_redis": reserve_script_us,
        "settle_script_us_in_redis": settle_script_us,
        "activity_build_us": activity_build_us(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--requests", type=int, default=2000, help="timed requests per configuration")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "quota.json")
    args = parser.parse_args()
    requests, warmup = (100, 20) if args.quick else (args.requests, 200)

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "embedsite.settings")
    from embeddings.tooling.local_redis import RedisServer
    from embeddings.tooling.triton_server import free_port

    workdir = Path(tempfile.mkdtemp(prefix="embedsite-bench-quota-"))
    triton = bench_triton(workdir)
    redis_server = RedisServer(port=free_port(), data_dir=workdir, persistent=False)
    servers: list[Server] = []
    triton.start()
    redis_server.start()
    try:
        triton.wait_until_ready(300)
        redis_server.wait_until_ready()
        env = {
            **os.environ,
            "DATABASE_URL": f"sqlite:///{workdir / 'db.sqlite3'}",
            "TRITON_SERVER_URL": triton.grpc_target,
            "REDIS_URL": redis_server.url,
            "LOG_LEVEL": "WARNING",
        }
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        keys = prepare_database(env)
        on = Server({**env, "QUOTAS_ENABLED": "true"}, free_port())
        servers.append(on)
        off = Server({**env, "QUOTAS_ENABLED": "false"}, free_port())
        servers.append(off)
        configurations = [
            ("off", off, keys["both"]),
            ("on, no limits", on, keys["free"]),
            ("on, tenant", on, keys["tenant"]),
            ("on, tenant + key", on, keys["both"]),
        ]
        print(f"Sequential POST /v1/embeddings (batch 1, {INSTANT_MODEL}), {requests} per configuration:")
        rows = measure(configurations, requests, warmup)
        gap_s = rows[0]["p50_ms"] / 1000
        idle_ping_ms = redis_round_trip_ms(redis_server.url, gap_s, min(requests, 1000))
        busy_ping_ms = redis_round_trip_ms(redis_server.url, 0, min(requests, 1000))
        for server in servers:  # the transports are timed with the machine otherwise idle
            server.stop()
        transports = measure_transports(env, requests)
    finally:
        for server in servers:
            server.stop()
        redis_server.stop()
        triton.stop()
    print(f"\n{'configuration':<18} {'p50 ms':>8} {'p90 ms':>8} {'+p50 ms':>8} {'+p90 ms':>8}")
    print("-" * 54)
    for row in rows:
        print(
            f"{row['configuration']:<18} {row['p50_ms']:>8.3f} {row['p90_ms']:>8.3f} "
            f"{row['overhead_p50_ms']:>8.3f} {row['overhead_p90_ms']:>8.3f}"
        )
    print(
        f"\nOne Redis round trip (PING, p50): {idle_ping_ms:.3f} ms after {gap_s * 1000:.1f} ms idle "
        f"(as between requests), {busy_ping_ms:.3f} ms back to back"
    )
    if not transports["hiredis"]:
        print("\nhiredis is not installed: redis-py is timed with its pure-Python parser only")
    print("\nasyncio transports, back to back, tenant + key plan:")
    print(f"{'operation':<16} {'transport':<18} {'p50 us':>8} {'p90 us':>8}")
    print("-" * 53)
    for row in transports["rows"]:
        print(f"{row['operation']:<16} {row['transport']:<18} {row['p50_us']:>8.1f} {row['p90_us']:>8.1f}")
    print(f"\nThe reserve script inside Redis: {transports['reserve_script_us_in_redis']:.1f} us per call")
    for kind, times in transports["settle_script_us_in_redis"].items():
        print(f"The {kind} script inside Redis: {' / '.join(f'{t:.1f}' for t in times)} us per call")
    print(f"Building a request's activity counters: {transports['activity_build_us']:.2f} us")
    result = {
        "rows": rows,
        "transports": transports,
        "redis_ping_after_idle_p50_ms": idle_ping_ms,
        "redis_ping_back_to_back_p50_ms": busy_ping_ms,
        "cpus": os.cpu_count(),
        "requests": requests,
        "model": INSTANT_MODEL,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwritten {args.out}")


if __name__ == "__main__":
    main()
