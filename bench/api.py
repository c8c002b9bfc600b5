"""Benchmark the HTTP service: its own overhead, end-to-end throughput against raw ORT, and its ceiling.

Run: `make bench-api` (or `.venv/bin/python bench/api.py [--quick]`). Starts, on free ports, the
shipped configuration as `make run` has it: its own Triton, two redis-servers (critical: quotas,
usage; job store), a SQLite database and two `manage.py serve --workers 1` servers, one with quotas
on (the bench tenant has limits so high they never refuse, so every request does the quota work) and
one with QUOTAS_ENABLED=false. Then measures in one run:

1. The seed proxy's table: batch 8..256 through POST /v1/embeddings against `instant_1024` (a
   test-only Triton model that returns 1024-d vectors at once): request latency p50/p90, the Triton
   call time the service reports (Server-Timing `inference`), and processing = total - Triton, for
   float and base64 responses; with `--baseline REF` also from that commit's tree (a git worktree
   under .run/bench/), so a change is measured against its parent in the same run.
2. End-to-end throughput with the real MiniLM model at saturation (wrk, 16 connections; batch 8 and
   32 short texts), quotas on and off, against raw ONNX Runtime in this process on the same texts
   (16 threads sharing a session): the ratio.
3. The ceiling with the instant model: embeddings per second per server core, from the server
   process's own CPU time (wrk and Triton share the machine, so wall-clock rates understate it).

Writes bench/results/api.json and the plot docs/bench-api-processing.png. Needs `wrk` (Debian) and
matplotlib (requirements-bench.txt; installed by the script, with a message, when missing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from triton_client import RawOnnxRuntime, make_texts, percentile  # noqa: E402

SEED_RUST_PROCESSING_P90_MS = {8: 1.8, 16: 2.3, 32: 3.3, 64: 5.4, 128: 9.3, 256: 20.3}
INSTANT_MODEL = "instant-1024"
REAL_MODEL = "all-MiniLM-L6-v2"
# Limits a bench can never reach: with quotas on, every request does the full quota work, none is refused.
NEVER_REFUSING_LIMITS = ["--requests-per-minute", str(10**9), "--tokens-per-minute", str(10**12),
                         "--tokens-per-day", str(10**12), "--tokens-per-month", str(10**12),
                         "--max-concurrent-requests", str(10**6)]  # fmt: skip


def ensure_matplotlib() -> None:
    """Install the benchmark's plotting dependency before a long run rather than die at the plot."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is missing: installing requirements-bench.txt into this virtualenv", flush=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "-r", str(ROOT / "requirements-bench.txt")],
            check=True,
        )


def bench_triton(workdir: Path, repository: Path | None = None, model_control_mode: str = "none"):
    """A Triton on free ports serving the model repository (default: the checkout's) and the
    test-only models (instant_1024), logging into `workdir`; not started. "explicit" mode loads
    nothing until the catalog is reconciled (`manage.py reconcile_models`), as `make run` does."""
    from embeddings.tooling.triton_server import TritonServer, free_port

    return TritonServer(
        model_repositories=[repository or ROOT / "model_repository", ROOT / "tests" / "triton_models"],
        run_dir=workdir,
        grpc_port=free_port(),
        http_port=free_port(),
        metrics_port=free_port(),
        log_path=workdir / "triton.log",
        model_control_mode=model_control_mode,
    )


class RedisPair:
    """The two local redis-servers `make run` has: the critical one (quotas, usage) and the job store."""

    def __init__(self, workdir: Path) -> None:
        from embeddings.tooling.local_redis import RedisServer
        from embeddings.tooling.triton_server import free_port

        self.critical = RedisServer(port=free_port(), data_dir=workdir / "redis", persistent=False)
        self.jobs = RedisServer(port=free_port(), data_dir=workdir / "redis-jobs", persistent=False)

    def start(self) -> dict[str, str]:
        """Start both and return the environment that points the service at them."""
        for server in (self.critical, self.jobs):
            server.start()
        for server in (self.critical, self.jobs):
            server.wait_until_ready()
        return {"REDIS_URL": self.critical.url, "JOB_STORE_URL": self.jobs.url}

    def stop(self) -> None:
        for server in (self.critical, self.jobs):
            server.stop()


def server_timing_ms(header: str, name: str) -> float:
    for part in header.split(","):
        key, _, value = part.strip().partition(";dur=")
        if key == name:
            return float(value)
    raise KeyError(name)


def prepare_database(env: dict[str, str], triton_target: str) -> str:
    """Migrate a fresh SQLite file, register the models and make a key; returns the key."""
    manage = [sys.executable, str(ROOT / "manage.py")]
    subprocess.run([*manage, "migrate", "--noinput", "-v", "0"], env=env, check=True)
    subprocess.run([*manage, "register_local_model"], env=env, check=True, stdout=subprocess.DEVNULL)
    script = (
        "from embeddings.models import EmbeddingModel as M; "
        f"M.objects.update_or_create(name={INSTANT_MODEL!r}, defaults=dict(triton_model='instant_1024', "
        "dimensions=1024, max_tokens=256, max_inputs_per_request=4096))"
    )
    subprocess.run([*manage, "shell", "-c", script], env=env, check=True)
    subprocess.run(
        [*manage, "create_tenant", "--name", "Bench", *NEVER_REFUSING_LIMITS],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    created = subprocess.run(
        [*manage, "create_api_key", "--tenant", "bench"], env=env, check=True, capture_output=True, text=True
    )
    return created.stdout.strip()


@contextlib.contextmanager
def shipped_stack(
    workdir: Path, repository: Path | None = None, model_control_mode: str = "none", **env_overrides: str
) -> Iterator[tuple[dict[str, str], str, object]]:
    """What `make run` starts besides the web server: Triton and the two redis-servers, and a fresh
    SQLite database with the models and a bench tenant. Yields the environment for the server, the
    tenant's API key and the TritonServer; stops them all after. `repository`: another model
    repository than the checkout's (it must hold minilm too)."""
    triton = bench_triton(workdir, repository, model_control_mode)
    if repository is not None:
        env_overrides = {"TRITON_MODEL_REPOSITORY": str(repository), **env_overrides}
    redis = RedisPair(workdir)
    triton.start()
    try:
        env = {
            **os.environ,
            **redis.start(),
            "DATABASE_URL": f"sqlite:///{workdir / 'db.sqlite3'}",
            "TRITON_SERVER_URL": triton.grpc_target,
            "LOG_LEVEL": "WARNING",
            **env_overrides,
        }
        triton.wait_until_ready(300)
        yield env, prepare_database(env, triton.grpc_target), triton
    finally:
        triton.stop()
        redis.stop()


def wait_until_healthy(url: str, server) -> None:
    """Until GET /health answers 200 (a minute at most); stops `server` and raises if it never does."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            # The standard library: bench/gpu.py runs this on a machine without httpx2.
            with urllib.request.urlopen(f"{url}/health", timeout=1) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"the server at {url} did not start")


class Server:
    """`manage.py serve --workers 1`: embedsite as shipped, in one process (so its CPU time is readable)."""

    # In a process group of its own (for servers that serve from child processes).
    own_process_group = False
    # The checkout it serves from (uvicorn puts its working directory first on sys.path).
    root = ROOT

    def __init__(self, env: dict[str, str], port: int, output=None) -> None:
        """`output`: a file for the server's stdout and stderr; None: this process's."""
        self.port = port
        self.process = subprocess.Popen(
            self.command(port), env=env, cwd=self.root, start_new_session=self.own_process_group,
            stdout=output, stderr=output,
        )  # fmt: skip
        wait_until_healthy(self.url, self)

    def command(self, port: int) -> list[str]:
        return [sys.executable, str(ROOT / "manage.py"), "serve", "--host", "127.0.0.1", "--port", str(port),
                "--workers", "1"]  # fmt: skip

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()


# Generated files a checkout needs to serve (gitignored: made by `make setup`; a baseline worktree
# has none of its own).
GENERATED_STUBS = "embeddings/triton/protocol"


class RootServer(Server):
    """`manage.py serve --workers 1` from another checkout (the baseline) or this one, run in it."""

    def __init__(self, env: dict[str, str], port: int, root: Path, output=None) -> None:
        self.root = root
        # This checkout's key (the stack's API keys were hashed with it) and exported model (the
        # tokenizer; a baseline worktree has no generated files).
        env = {
            "DJANGO_SECRET_KEY_FILE": str(ROOT / ".run" / "secret_key"),
            "TRITON_MODEL_REPOSITORY": str(ROOT / "model_repository"),
            **env,
        }
        super().__init__(env, port, output)

    def command(self, port: int) -> list[str]:
        return [sys.executable, str(self.root / "manage.py"), "serve", "--host", "127.0.0.1", "--port",
                str(port), "--workers", "1"]  # fmt: skip


def baseline_checkout(reference: str) -> Path:
    """A directory to serve the baseline from: `reference` itself if it is one, else a git worktree
    of that commit under .run/bench/ with this checkout's generated stubs."""
    if Path(reference).is_dir():
        return Path(reference).resolve()
    commit = subprocess.run(
        ["git", "rev-parse", "--verify", f"{reference}^{{commit}}"], cwd=ROOT, check=True,
        capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    tree = ROOT / ".run" / "bench" / f"baseline-{commit[:12]}"
    if not tree.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], cwd=ROOT, check=True)
    for stub in (ROOT / GENERATED_STUBS).glob("*_pb2*.py"):
        shutil.copy2(stub, tree / GENERATED_STUBS / stub.name)
    return tree


PROCESSING_BATCHES = [8, 16, 32, 64, 128, 256]


def processing_table(server: Server, key: str, batches: list[int], requests: int) -> list[dict]:
    import httpx2

    texts = make_texts(256, 8, seed=3)
    rows = []
    with httpx2.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
        for encoding in ("float", "base64"):
            for batch in batches:
                body = {"model": INSTANT_MODEL, "input": texts[:batch], "encoding_format": encoding}
                for _ in range(5):  # warm up
                    http.post("/v1/embeddings", json=body).raise_for_status()
                totals, tritons = [], []
                for _ in range(requests):
                    started = time.perf_counter()
                    response = http.post("/v1/embeddings", json=body)
                    totals.append((time.perf_counter() - started) * 1000)
                    response.raise_for_status()
                    tritons.append(server_timing_ms(response.headers["server-timing"], "inference"))
                processing = [t - i for t, i in zip(totals, tritons, strict=True)]
                row = {
                    "encoding": encoding,
                    "batch": batch,
                    "bytes": len(response.content),
                    "total_p50_ms": percentile(totals, 0.5),
                    "total_p90_ms": percentile(totals, 0.9),
                    "triton_p50_ms": percentile(tritons, 0.5),
                    "processing_p50_ms": percentile(processing, 0.5),
                    "processing_p90_ms": percentile(processing, 0.9),
                    "seed_rust_processing_p90_ms": SEED_RUST_PROCESSING_P90_MS.get(batch),
                }
                rows.append(row)
                print(
                    f"{encoding:6} {batch:>5} | total p50 {row['total_p50_ms']:7.2f} "
                    f"p90 {row['total_p90_ms']:7.2f} | triton p50 {row['triton_p50_ms']:6.2f} | "
                    f"processing p50 {row['processing_p50_ms']:6.2f} p90 {row['processing_p90_ms']:6.2f} "
                    f"(seed Rust p90 {row['seed_rust_processing_p90_ms']})",
                    flush=True,
                )
    return rows


def wrk(
    server: Server,
    key: str,
    body: dict,
    seconds: float,
    connections: int,
    workdir: Path,
    *,
    path: str = "/v1/embeddings",
    rows: int | None = None,
) -> dict:
    """wrk posting `body` to `path` for `seconds` on `connections`; `rows`: what one request counts
    as (default: its `input`'s length), for emb_per_s."""
    script = workdir / "post.lua"
    script.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = {json.dumps(json.dumps(body))}\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
        f'wrk.headers["Authorization"] = "Bearer {key}"\n'
        "done = function(summary, latency, requests)\n"
        '  io.write(string.format("RESULT %d %d %d %d %f %f\\n", summary.requests, summary.errors.status, '
        "summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout, "
        "summary.duration, latency:percentile(50) / 1000, latency:percentile(90) / 1000))\n"
        "end\n"
    )
    cpu_before = server.cpu_seconds()
    output = subprocess.run(
        ["wrk", "-t", "1", "-c", str(connections), "-d", f"{int(seconds)}s", "--timeout", "60s",
         "-s", str(script), f"{server.url}{path}"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    cpu = server.cpu_seconds() - cpu_before
    line = next(line for line in output.splitlines() if line.startswith("RESULT"))
    requests, status_errors, socket_errors, duration_us, p50, p90 = line.split()[1:]
    rows = len(body["input"]) if rows is None else rows
    result = {
        "requests": int(requests),
        "errors": int(status_errors) + int(socket_errors),
        "seconds": int(duration_us) / 1e6,
        "p50_ms": float(p50),
        "p90_ms": float(p90),
        "server_cpu_s": cpu,
    }
    result["emb_per_s"] = result["requests"] * rows / result["seconds"]
    result["emb_per_server_core_s"] = result["requests"] * rows / cpu if cpu > 0 else None
    return result


def raw_throughput(raw: RawOnnxRuntime, texts: list[str], seconds: float, threads: int) -> dict:
    raw.embed(texts)
    done = 0
    lock = threading.Lock()
    started = time.perf_counter()

    def worker(_: int) -> None:
        nonlocal done
        while time.perf_counter() - started < seconds:
            raw.embed(texts)
            with lock:
                done += 1

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(worker, range(threads)))
    elapsed = time.perf_counter() - started
    return {"requests": done, "seconds": elapsed, "emb_per_s": done * len(texts) / elapsed}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.2), dpi=110)
    for encoding, marker in (("float", "o"), ("base64", "s")):
        picked = [row for row in rows if row["encoding"] == encoding]
        axis.plot([r["batch"] for r in picked], [r["processing_p90_ms"] for r in picked], marker=marker,
                  label=f"embedsite, {encoding}")  # fmt: skip
    seed = sorted(SEED_RUST_PROCESSING_P90_MS.items())
    axis.plot(
        [b for b, _ in seed], [ms for _, ms in seed], linestyle="--", marker="^", label="seed Rust proxy"
    )
    axis.set_xscale("log", base=2)
    axis.set_xlabel("inputs per request (1024-d outputs)")
    axis.set_ylabel("processing p90 (ms) = total - Triton")
    axis.set_title("Service overhead per request")
    axis.grid(True, alpha=0.3)
    axis.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--baseline", help="a commit or checkout whose processing table is measured too")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "api.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "bench-api-processing.png")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if shutil.which("wrk") is None:
        sys.exit("bench/api.py needs wrk: apt-get install wrk")
    ensure_matplotlib()
    requests, seconds = (30, 3.0) if args.quick else (300, 15.0)

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "embedsite.settings")
    from embeddings.tokenization import TextTokenizer
    from embeddings.tooling.triton_server import free_port

    workdir = Path(tempfile.mkdtemp(prefix="embedsite-bench-api-"))
    servers: dict[str, Server] = {}
    with shipped_stack(workdir, MAX_INFLIGHT_TRITON_CALLS="256") as (env, key, _):
        try:
            servers["quotas on"] = Server({**env, "QUOTAS_ENABLED": "true"}, free_port())
            servers["quotas off"] = Server({**env, "QUOTAS_ENABLED": "false"}, free_port())
            server = servers["quotas on"]
            print("1. Service overhead (instant 1024-d model, quotas on), sequential requests:", flush=True)
            table = processing_table(server, key, PROCESSING_BATCHES, requests)
            baseline_table = None
            if args.baseline:
                print(f"\n1b. The same, served from {args.baseline}:", flush=True)
                baseline = RootServer(
                    {**env, "QUOTAS_ENABLED": "true"}, free_port(), baseline_checkout(args.baseline)
                )
                try:
                    baseline_table = processing_table(baseline, key, PROCESSING_BATCHES, requests)
                finally:
                    baseline.stop()

            print("\n3. Ceiling (instant model, quotas on, wrk 16 connections, batch 32):", flush=True)
            body = {"model": INSTANT_MODEL, "input": make_texts(32, 8, seed=5), "encoding_format": "base64"}
            ceiling = wrk(server, key, body, seconds, 16, workdir)
            print(
                f"   {ceiling['emb_per_s']:.0f} emb/s wall clock, "
                f"{ceiling['emb_per_server_core_s']:.0f} emb/s per server core "
                f"(server CPU {ceiling['server_cpu_s']:.1f} s), errors {ceiling['errors']}",
                flush=True,
            )

            print("\n2. End to end with MiniLM vs raw ONNX Runtime (16 concurrent):", flush=True)
            model = ROOT / "model_repository" / "minilm" / "1"
            raw = RawOnnxRuntime(model / "model.onnx", TextTokenizer.from_file(model / "tokenizer.json"))
            end_to_end = []
            for batch in (8, 32):
                texts = make_texts(batch, 8, seed=7)
                reference = raw_throughput(raw, texts, seconds, 16)
                for name, measured in servers.items():
                    http = wrk(measured, key, {"model": REAL_MODEL, "input": texts}, seconds, 16, workdir)
                    ratio = http["emb_per_s"] / reference["emb_per_s"]
                    end_to_end.append(
                        {"batch": batch, "server": name, "http": http, "raw": reference, "ratio": ratio}
                    )
                    print(
                        f"   batch {batch:>3}, {name:10}: HTTP {http['emb_per_s']:.0f} emb/s "
                        f"(p50 {http['p50_ms']:.0f} ms, errors {http['errors']}), "
                        f"raw ORT {reference['emb_per_s']:.0f} emb/s, ratio {ratio:.2f}",
                        flush=True,
                    )
        finally:
            for server in servers.values():
                server.stop()
    result = {"processing": table, "ceiling": ceiling, "end_to_end": end_to_end, "cpus": os.cpu_count()}
    if baseline_table is not None:
        result.update(baseline=args.baseline, processing_baseline=baseline_table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(table, args.plot)
    print(f"\nwritten {args.out} and {args.plot}")


if __name__ == "__main__":
    main()
