"""Overload: what one tenant's flood of connections leaves for itself and for everyone else.

Run: `make bench-overload` (or `.venv/bin/python bench/overload.py [--quick] [--baseline REF]`).
Starts the stack as `make run` has it (Triton, the two redis-servers, SQLite, `manage.py serve
--workers 1`, shipped defaults) with two tenants made by `create_tenant` as a new operator makes
them (no limits). For each connection count (32, 256, 1,000):

- tenant `flood` sends single short texts to POST /v1/embeddings on every connection, back to back
  (wrk, 20 s; a response is counted whatever it took, up to wrk's 60 s timeout);
- tenant `probe` sends one small request a second on a connection of its own, as a second
  customer would, and records each answer's status and time.

Reported per cell: the flood's answers of 200 per second (goodput), its other answers, its latency;
the probe's answers and slowest time; the web process's CPU time per answer of 200.

`--baseline REF` measures a second server in the same run, started from REF (a commit or a
directory) instead of this checkout: a git worktree of REF is made under .run/bench/, given this
checkout's generated gRPC stubs, and served on the same Triton, Redis and database, so the two
tables compare code, not machines. A refusal's cost is measured with `--refusal-cost`: the server
with an admission budget of one request and no queue (ADMISSION_*), flooded, so that nearly every
answer is a refusal; the web CPU time per refusal is the figure.

Writes bench/results/overload.json.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from api import REAL_MODEL, RootServer, Server, baseline_checkout, shipped_stack  # noqa: E402
from triton_client import make_texts, percentile  # noqa: E402

CONNECTIONS = (32, 256, 1000)
FLOOD_TENANT, PROBE_TENANT = "flood", "probe"
PROBE_INTERVAL_S = 1.0
# The probe's own deadline: far above what it should ever take, so a slow answer is measured, not lost.
PROBE_TIMEOUT_S = 30.0


def wrk_script(body: dict | None, key: str | None) -> str:
    """wrk's Lua: POST `body` as `key`'s tenant (a plain GET without either); one RESULT line with
    the counts and percentiles."""
    request = ""
    if body is not None:
        request += f'wrk.method = "POST"\nwrk.body = {json.dumps(json.dumps(body))}\n'
        request += 'wrk.headers["Content-Type"] = "application/json"\n'
    if key is not None:
        request += f'wrk.headers["Authorization"] = "Bearer {key}"\n'
    return request + (
        "done = function(summary, latency, requests)\n"
        '  io.write(string.format("RESULT %d %d %d %d %d %d %d %f %f %f\\n", summary.requests, '
        "summary.errors.status, summary.errors.connect, summary.errors.read, summary.errors.write, "
        "summary.errors.timeout, summary.duration, latency:percentile(50) / 1000, "
        "latency:percentile(99) / 1000, latency.max / 1000))\n"
        "end\n"
    )


def parse_wrk(output: str) -> dict:
    line = next((line for line in output.splitlines() if line.startswith("RESULT")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no RESULT line:\n{output}")
    fields = line.split()[1:]
    requests, status, connect, read, write, timeout, duration_us = (int(value) for value in fields[:7])
    p50, p99, slowest = (float(value) for value in fields[7:])
    seconds = duration_us / 1e6
    return {
        "responses": requests,
        "ok": requests - status,
        "refused": status,
        "socket_errors": {"connect": connect, "read": read, "write": write, "timeout": timeout},
        "seconds": seconds,
        "ok_per_s": (requests - status) / seconds,
        "p50_ms": p50,
        "p99_ms": p99,
        "max_ms": slowest,
    }


class Prober(threading.Thread):
    """One request every PROBE_INTERVAL_S on a kept-alive connection of its own (reopened when the
    server closes it), as the second tenant; records (status, seconds) per request, None on failure."""

    def __init__(self, port: int, key: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.port, self.body = port, json.dumps(body).encode()
        self.headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        self.results: list[tuple[int | None, float]] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        connection = None
        while not self.stopping.is_set():
            started = time.perf_counter()
            status = None
            try:
                if connection is None:
                    connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=PROBE_TIMEOUT_S)
                connection.request("POST", "/v1/embeddings", body=self.body, headers=self.headers)
                response = connection.getresponse()
                response.read()
                status = response.status
                if response.getheader("connection", "").lower() == "close":
                    connection.close()
                    connection = None
            except OSError:
                if connection is not None:
                    connection.close()
                connection = None
            elapsed = time.perf_counter() - started
            self.results.append((status, elapsed))
            self.stopping.wait(max(0.0, PROBE_INTERVAL_S - elapsed))

    def summary(self) -> dict:
        times = [seconds for _, seconds in self.results]
        statuses: dict[str, int] = {}
        for status, _ in self.results:
            statuses[str(status)] = statuses.get(str(status), 0) + 1
        return {
            "requests": len(self.results),
            "statuses": statuses,
            "ok_within_1s": sum(1 for status, seconds in self.results if status == 200 and seconds <= 1.0),
            "p50_ms": percentile(times, 0.5) * 1000 if times else None,
            "max_ms": max(times) * 1000 if times else None,
        }


def flood_cell(server: Server, keys: dict[str, str], connections: int, seconds: float, workdir: Path) -> dict:
    body = {"model": REAL_MODEL, "input": make_texts(1, 8, seed=29)[0]}
    script = workdir / "flood.lua"
    script.write_text(wrk_script(body, keys[FLOOD_TENANT]))
    prober = Prober(
        server.port, keys[PROBE_TENANT], {"model": REAL_MODEL, "input": "a second tenant's query"}
    )
    cpu_before = server.cpu_seconds()
    prober.start()
    output = subprocess.run(
        ["wrk", "-t", "2", "-c", str(connections), "-d", f"{int(seconds)}s", "--timeout", "60s",
         "-s", str(script), f"{server.url}/v1/embeddings"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    prober.stopping.set()
    prober.join(PROBE_TIMEOUT_S + 5)
    cpu = server.cpu_seconds() - cpu_before
    flood = parse_wrk(output)
    cell = {"connections": connections, "flood": flood, "probe": prober.summary(), "server_cpu_s": cpu}
    cell["cpu_ms_per_ok"] = cpu * 1000 / flood["ok"] if flood["ok"] else None
    cell["cpu_ms_per_response"] = cpu * 1000 / flood["responses"] if flood["responses"] else None
    return cell


def print_cell(name: str, cell: dict) -> None:
    flood, probe = cell["flood"], cell["probe"]
    errors = sum(flood["socket_errors"].values())
    cpu = f"{cell['cpu_ms_per_ok']:.2f}" if cell["cpu_ms_per_ok"] else "-"
    print(
        f"{name:9} {cell['connections']:>5} conn | flood {flood['ok_per_s']:6.0f} ok/s, "
        f"{flood['refused']} refused, {errors} socket errors, p50 {flood['p50_ms']:.0f} ms, "
        f"p99 {flood['p99_ms']:.0f} ms | probe {probe['statuses']} ok<=1s {probe['ok_within_1s']}/"
        f"{probe['requests']}, max {probe['max_ms'] or 0:.0f} ms | web CPU {cpu} ms per 200",
        flush=True,
    )


def make_tenants(env: dict[str, str]) -> dict[str, str]:
    """Two tenants as an operator makes them (no limit flags: shipped defaults), a key each."""
    manage = [sys.executable, str(ROOT / "manage.py")]
    keys = {}
    for name in (FLOOD_TENANT, PROBE_TENANT):
        subprocess.run(
            [*manage, "create_tenant", "--name", name], env=env, check=True, stdout=subprocess.DEVNULL
        )
        keys[name] = subprocess.run(
            [*manage, "create_api_key", "--tenant", name], env=env, check=True, capture_output=True, text=True
        ).stdout.strip()
    return keys


def warm(server: Server, keys: dict[str, str]) -> None:
    """One request per tenant, which must answer 200 (wrk would count refusals as answers), so that
    the server has verified both keys. A 429 is asked again: with a budget of one, the previous
    request may still hold its slot for a moment after its answer."""
    body = json.dumps({"model": REAL_MODEL, "input": "warm up"})
    for key in keys.values():
        for _ in range(50):
            connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
            connection.request(
                "POST", "/v1/embeddings", body=body,
                headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
            )  # fmt: skip
            response = connection.getresponse()
            answer = response.read()
            connection.close()
            if response.status != 429:
                break
            time.sleep(0.1)
        if response.status != 200:
            raise RuntimeError(f"warm-up answered {response.status}: {answer[:300]!r}")


def measure(
    name: str, root: Path, env: dict[str, str], keys: dict[str, str], args: argparse.Namespace, workdir: Path
) -> list[dict]:
    from embeddings.tooling.triton_server import free_port

    cells = []
    with (workdir / f"server-{name}.log").open("ab") as log:
        for connections in args.connections:
            # A fresh server per cell: a flood's leftovers (connections, caches) must not carry over.
            server = RootServer(env, free_port(), root, output=log)
            try:
                warm(server, keys)
                cell = flood_cell(server, keys, connections, args.seconds, workdir)
            finally:
                server.stop()
            print_cell(name, cell)
            cells.append(cell)
    return cells


def cpu_split(server: Server) -> tuple[float, float]:
    """The server process's (user, system) CPU seconds: Python's share and the kernel's (sockets)."""
    fields = Path(f"/proc/{server.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / ticks, int(fields[12]) / ticks


def health_flood(server: Server, connections: int, seconds: float, workdir: Path) -> dict:
    """GET /health, the cheapest answer the application gives, flooded: its web CPU per answer."""
    script = workdir / "health.lua"
    script.write_text(wrk_script(None, None))
    user, system = cpu_split(server)
    output = subprocess.run(
        ["wrk", "-t", "2", "-c", str(connections), "-d", f"{int(seconds)}s", "--timeout", "60s",
         "-s", str(script), f"{server.url}/health"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    after_user, after_system = cpu_split(server)
    cell = parse_wrk(output)
    cell["cpu_ms_per_answer"] = (after_user - user + after_system - system) * 1000 / cell["responses"]
    cell["user_ms_per_answer"] = (after_user - user) * 1000 / cell["responses"]
    return cell


def refusal_cost(env: dict[str, str], keys: dict[str, str], args: argparse.Namespace, workdir: Path) -> dict:
    """The web CPU time of a refusal: a budget of one request in flight and no queue, flooded by 256
    connections, so nearly every answer is an immediate refusal; beside it, GET /health flooded the
    same way on the same server, the cheapest answer the application itself gives."""
    from embeddings.tooling.triton_server import free_port

    tight = {**env, "ADMISSION_MAX_IN_FLIGHT": "1", "ADMISSION_QUEUE_TIMEOUT_S": "0"}
    with (workdir / "server-refusals.log").open("ab") as log:
        server = RootServer(tight, free_port(), ROOT, output=log)
        try:
            warm(server, keys)
            user, system = cpu_split(server)
            cell = flood_cell(server, keys, 256, args.seconds, workdir)
            after_user, after_system = cpu_split(server)
            cell["health"] = health_flood(server, 256, args.seconds, workdir)
        finally:
            server.stop()
    refused = cell["flood"]["refused"]
    cell["cpu_ms_per_refusal"] = (
        (after_user - user + after_system - system) * 1000 / refused if refused else None
    )
    cell["user_ms_per_refusal"] = (after_user - user) * 1000 / refused if refused else None
    health = cell["health"]
    print(
        f"refusals: {refused} of {cell['flood']['responses']} answers refused; web CPU per refusal "
        f"{cell['cpu_ms_per_refusal'] or 0:.4f} ms ({cell['user_ms_per_refusal'] or 0:.4f} ms in Python, the "
        f"rest in the kernel; every CPU second charged to refusals, the few 200s' included); GET /health: "
        f"{health['cpu_ms_per_answer']:.4f} ms ({health['user_ms_per_answer']:.4f} ms in Python)",
        flush=True,
    )
    return cell


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 s cells (a smoke run)")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each cell (default 20)")
    parser.add_argument(
        "--connections", type=lambda text: [int(part) for part in text.split(",")], default=list(CONNECTIONS)
    )
    parser.add_argument("--baseline", help="a commit or directory to measure first, in the same run")
    parser.add_argument("--refusal-cost", action="store_true", help="also measure what a refusal costs")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "overload.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds = 5.0
    return args


def main() -> None:
    args = parse_args()
    if shutil.which("wrk") is None:
        sys.exit("bench/overload.py needs wrk: apt-get install wrk")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "embedsite.settings")
    workdir = Path(tempfile.mkdtemp(prefix="embedsite-bench-overload-"))
    print(f"logs in {workdir}", flush=True)
    roots = {}
    if args.baseline:
        roots["before"] = baseline_checkout(args.baseline)
    roots["after" if args.baseline else "embedsite"] = ROOT
    results: dict = {
        "cpus": os.cpu_count(),
        "seconds": args.seconds,
        "baseline": args.baseline,
        "servers": {},
    }
    # LOG_LEVEL as shipped (INFO): the access line is part of what a request costs.
    with shipped_stack(workdir, LOG_LEVEL="INFO") as (env, _, _triton):
        keys = make_tenants(env)
        for name, root in roots.items():
            results["servers"][name] = measure(name, root, env, keys, args, workdir)
        if args.refusal_cost:
            results["refusal_cost"] = refusal_cost(env, keys, args, workdir)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"\nwritten {args.out}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
