"""Benchmark an embedding job end to end: throughput against raw ONNX Runtime, download times, memory.

Run: `make bench-jobs` (or `.venv/bin/python bench/jobs.py [--quick] [--texts N]`). Starts its own
Triton (MiniLM), Redis, SQLite database, a uvicorn server (one process) and a Celery worker
(`--concurrency` processes) on free ports, then in one run:

1. Submits N short texts (default 100,000; --quick 5,000) as a text upload to POST /v1/jobs and polls
   until the job completes: embeddings/s from submission to completion, against raw ONNX Runtime in
   this process (all cores, batches of JOB_CHUNK_SIZE) on the same texts, measured after the job
   (the two never share the machine).
2. Downloads the results as npy and as jsonl (streamed to disk), timing each, while sampling the
   resident memory (VmRSS, every 20 ms) of the web and worker processes (children included).

Writes bench/results/jobs.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from api import Server, prepare_database  # noqa: E402
from triton_client import RawOnnxRuntime, make_texts  # noqa: E402

MODEL = "all-MiniLM-L6-v2"


def process_tree(pid: int) -> list[int]:
    """pid and its descendants (uvicorn's and Celery's pool processes)."""
    children = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, []))
    return tree


def rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


class RssSampler:
    """The largest summed VmRSS of each named process tree while it runs."""

    def __init__(self, roots: dict[str, int], interval_s: float = 0.02) -> None:
        self.trees = {name: process_tree(pid) for name, pid in roots.items()}
        self.peak = {name: rss_mib(pids) for name, pids in self.trees.items()}
        self.before = dict(self.peak)
        self.interval_s = interval_s
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            for name, pids in self.trees.items():
                self.peak[name] = max(self.peak[name], rss_mib(pids))

    def __enter__(self) -> RssSampler:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.thread.join()


def raw_rate(raw: RawOnnxRuntime, texts: list[str], batch: int) -> float:
    raw.embed(texts[:batch])  # warm-up
    started = time.perf_counter()
    for start in range(0, len(texts), batch):
        raw.embed(texts[start : start + batch])
    return len(texts) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5,000 texts: a smoke run")
    parser.add_argument("--texts", type=int, default=None, help="texts in the job (default 100,000)")
    parser.add_argument("--concurrency", type=int, default=2, help="Celery worker processes")
    parser.add_argument("--raw-texts", type=int, default=20_000, help="texts raw ORT embeds (a rate)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "jobs.json")
    args = parser.parse_args()
    count = args.texts or (5_000 if args.quick else 100_000)

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "embedsite.settings")
    import django

    django.setup()
    from django.conf import settings

    from embeddings.management.jobs_client import FINISHED_STATUSES, JobsClient
    from embeddings.tokenization import TextTokenizer
    from embeddings.tooling.local_redis import RedisServer
    from embeddings.tooling.triton_server import TritonServer, free_port

    workdir = Path(tempfile.mkdtemp(prefix="embedsite-bench-jobs-"))
    triton = TritonServer(
        model_repositories=[ROOT / "model_repository"],
        run_dir=workdir,
        grpc_port=free_port(),
        http_port=free_port(),
        metrics_port=free_port(),
        log_path=workdir / "triton.log",
    )
    redis = RedisServer(port=free_port(), data_dir=workdir, persistent=False, log_path=workdir / "redis.log")
    triton.start()
    redis.start()
    server = worker = None
    try:
        triton.wait_until_ready(300)
        redis.wait_until_ready()
        env = {
            **os.environ,
            "DATABASE_URL": f"sqlite:///{workdir / 'db.sqlite3'}",
            "TRITON_SERVER_URL": triton.grpc_target,
            "REDIS_URL": redis.url,
            "CELERY_BROKER_URL": redis.url,
            "EMBEDSITE_RUN_DIR": str(workdir),
            "LOG_LEVEL": "WARNING",
        }
        key = prepare_database(env, triton.grpc_target)
        server = Server(env, free_port())
        worker = subprocess.Popen(
            [
                sys.executable, "-m", "celery", "-A", "embedsite", "worker", "--concurrency",
                str(args.concurrency), "--without-gossip", "--without-mingle", "--loglevel", "WARNING",
            ],
            cwd=ROOT, env=env, stdout=(workdir / "worker.log").open("wb"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        client = JobsClient(server.url, key, timeout_s=300)
        texts = make_texts(count, 8, seed=11)
        source = workdir / "texts.txt"
        source.write_text("\n".join(texts) + "\n")

        print(f"1. A {count}-text job ({args.concurrency} worker processes):", flush=True)
        time.sleep(3)  # the worker's processes start
        started = time.perf_counter()
        job = client.submit_file(source, model=MODEL)
        submitted_s = time.perf_counter() - started
        while job["status"] not in FINISHED_STATUSES:
            time.sleep(0.2)
            job = client.job(job["id"])
        job_s = time.perf_counter() - started
        if job["status"] != "completed":
            raise SystemExit(f"the job {job['status']}: {job.get('error')}; logs in {workdir}")
        job_rate = count / job_s
        print(
            f"   submitted in {submitted_s:.2f} s, completed in {job_s:.1f} s: {job_rate:.0f} emb/s",
            flush=True,
        )

        model_dir = ROOT / "model_repository" / "minilm" / "1"
        raw = RawOnnxRuntime(model_dir / "model.onnx", TextTokenizer.from_file(model_dir / "tokenizer.json"))
        reference = raw_rate(raw, texts[: args.raw_texts], settings.JOB_CHUNK_SIZE)
        del raw
        print(f"   raw ONNX Runtime: {reference:.0f} emb/s; ratio {job_rate / reference:.2f}", flush=True)

        print("2. Downloads (peak resident memory of each process tree while downloading):", flush=True)
        downloads = {}
        for result_format in ("npy", "jsonl"):
            out = workdir / f"vectors.{result_format}"
            with RssSampler({"web": server.process.pid, "worker": worker.pid}) as memory:
                started = time.perf_counter()
                size = client.download(job["id"], out, result_format=result_format)
                seconds = time.perf_counter() - started
            downloads[result_format] = {
                "seconds": seconds,
                "mib": size / 2**20,
                "mib_per_s": size / 2**20 / seconds,
                "rss_before_mib": memory.before,
                "rss_peak_mib": memory.peak,
            }
            print(
                f"   {result_format:>5}: {size / 2**20:.1f} MiB in {seconds:.2f} s; web "
                f"{memory.before['web']:.0f} -> {memory.peak['web']:.0f} MiB, worker "
                f"{memory.before['worker']:.0f} -> {memory.peak['worker']:.0f} MiB",
                flush=True,
            )
            out.unlink()
    finally:
        if worker is not None and worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
            worker.wait(timeout=30)
        if server is not None:
            server.stop()
        redis.stop()
        triton.stop()
    result = {
        "texts": count,
        "worker_processes": args.concurrency,
        "chunk_size": settings.JOB_CHUNK_SIZE,
        "job_seconds": job_s,
        "job_emb_per_s": job_rate,
        "raw_ort_emb_per_s": reference,
        "ratio": job_rate / reference,
        "downloads": downloads,
        "cpus": os.cpu_count(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwritten {args.out}")


if __name__ == "__main__":
    main()
