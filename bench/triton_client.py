"""Benchmark: raw ONNX Runtime in-process vs the same model through our gRPC client and a real Triton.

Run: `make bench` (or `.venv/bin/python bench/triton_client.py [--quick]`). Prints a table and
writes bench/results/triton_client.json. Both sides tokenize with the same tokenizer and run the same
model.onnx on the same texts, in one run, so the ratios compare like with like on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import platform
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from embeddings.tokenization import TextTokenizer  # noqa: E402
from embeddings.tooling.triton_server import TritonServer, free_port  # noqa: E402
from embeddings.triton.client import AsyncTritonClient  # noqa: E402
from embeddings.triton.codec import decode_infer_response  # noqa: E402
from embeddings.triton.protocol import grpc_service_pb2 as pb  # noqa: E402

MODEL = "minilm"
REPOSITORY = ROOT / "model_repository"
WORDS = tuple(
    "the quick brown fox jumps over lazy dog search engine vector embedding model server request "
    "tenant quota token latency throughput python django triton batch queue worker result cache "
    "index query document passage answer question river mountain city music".split(" ")
)


def make_texts(count: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(count)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(latencies_s: list[float], rows: int, wall_s: float) -> dict:
    return {
        "requests": len(latencies_s),
        "emb_per_s": rows * len(latencies_s) / wall_s,
        "p50_ms": percentile(latencies_s, 0.5) * 1000,
        "p90_ms": percentile(latencies_s, 0.9) * 1000,
    }


class RawOnnxRuntime:
    """The reference: tokenize and run model.onnx in this process with all cores."""

    def __init__(self, model_path: Path, tokenizer: TextTokenizer) -> None:
        # Imported here: bench/gpu.py imports this module on a GPU machine without onnxruntime.
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = os.cpu_count() or 1
        self.session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
        self.tokenizer = tokenizer

    def embed(self, texts: list[str]) -> np.ndarray:
        batch = self.tokenizer.encode(texts)
        feeds = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
        return self.session.run(None, feeds)[0]


def run_raw(
    embed, texts: list[str], batch: int, min_s: float, max_requests: int, concurrency: int = 1
) -> dict:
    """Raw ORT: `concurrency` threads share one session (run() is thread-safe and frees the GIL)."""
    embed(texts[:batch])  # warm up
    latencies: list[float] = []
    started = time.perf_counter()
    lock = threading.Lock()
    issued = 0

    def worker(seed: int) -> None:
        nonlocal issued
        offset = seed * batch
        while True:
            with lock:
                elapsed = time.perf_counter() - started
                if issued >= max_requests or (elapsed >= min_s and issued >= 3 * concurrency):
                    return
                issued += 1
            chunk = texts[offset % len(texts) : offset % len(texts) + batch]
            if len(chunk) < batch:
                chunk = texts[:batch]
            offset += batch * concurrency
            t0 = time.perf_counter()
            embed(chunk)
            latencies.append(time.perf_counter() - t0)

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(worker, range(concurrency)))
    return summarize(latencies, batch, time.perf_counter() - started)


async def run_client(client, texts, batch, min_s, max_requests, concurrency=1, version="") -> dict:
    """Through the project's client: `concurrency` callers of `batch` texts, of minilm `version`
    ("": the one Triton serves)."""
    await client.embed_tokens(MODEL, *tokenized(texts[:batch]), version=version)  # warm up
    latencies: list[float] = []
    started = time.perf_counter()
    counter = 0

    async def worker(seed: int) -> None:
        nonlocal counter
        offset = seed * batch
        while (time.perf_counter() - started < min_s or counter < 3) and counter < max_requests:
            counter += 1
            chunk = texts[offset % len(texts) : offset % len(texts) + batch]
            if len(chunk) < batch:
                chunk = texts[:batch]
            offset += batch * concurrency
            t0 = time.perf_counter()
            await client.embed_tokens(MODEL, *tokenized(chunk), version=version)
            latencies.append(time.perf_counter() - t0)

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return summarize(latencies, batch, time.perf_counter() - started)


_tokenizer: TextTokenizer | None = None


def tokenizer_use(tokenizer: TextTokenizer) -> None:
    """The tokenizer run_client tokenises with (measure() sets it itself)."""
    global _tokenizer
    _tokenizer = tokenizer


def tokenized(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    batch = _tokenizer.encode(texts)
    return batch.input_ids, batch.attention_mask


def decode_cost_ms(rows: int, dims: int, repeats: int = 200) -> float:
    """The client's decode of a ModelInferResponse carrying `rows` x `dims` FP32 (size is what costs)."""
    response = pb.ModelInferResponse(model_name=MODEL)
    response.outputs.add(name="embedding", datatype="FP32", shape=[rows, dims])
    response.raw_output_contents.append(np.random.default_rng(0).random((rows, dims), np.float32).tobytes())
    wire = response.SerializeToString()
    t0 = time.perf_counter()
    for _ in range(repeats):
        decode_infer_response(pb.ModelInferResponse.FromString(wire))
    return (time.perf_counter() - t0) / repeats * 1000


async def measure(args) -> dict:
    global _tokenizer
    model_dir = REPOSITORY / MODEL / "1"
    _tokenizer = TextTokenizer.from_file(model_dir / "tokenizer.json")
    raw = RawOnnxRuntime(model_dir / "model.onnx", _tokenizer)
    run_dir = Path(tempfile.mkdtemp(prefix="embedsite-bench-"))
    server = TritonServer(
        model_repositories=[REPOSITORY],
        run_dir=run_dir,
        grpc_port=free_port(),
        http_port=free_port(),
        metrics_port=free_port(),
        log_path=run_dir / "triton.log",
    )
    server.start()
    server.wait_until_ready(300)
    client = AsyncTritonClient(server.grpc_target, channels=4, timeout_s=120)
    rows = []
    try:
        for kind, words in (("short", 8), ("long", 110)):
            texts = make_texts(512, words, seed=len(kind))
            tokens = int(_tokenizer.encode(texts[:64]).token_counts.mean())
            for batch in args.batches:
                max_requests = max(3, args.max_rows // batch)
                raw_result = run_raw(raw.embed, texts, batch, args.seconds, max_requests)
                client_result = await run_client(client, texts, batch, args.seconds, max_requests)
                dims = raw.embed(texts[:1]).shape[1]
                rows.append(
                    {
                        "texts": kind,
                        "tokens_per_text": tokens,
                        "batch": batch,
                        "concurrency": 1,
                        "raw": raw_result,
                        "client": client_result,
                        "ratio": client_result["emb_per_s"] / raw_result["emb_per_s"],
                        "client_decode_ms": decode_cost_ms(batch, dims),
                    }
                )
                print_row(rows[-1])
            # Cross-request batching: 16 concurrent callers of batch 8.
            concurrency, batch = 16, 8
            max_requests = max(16, args.max_rows // batch)
            raw_result = run_raw(raw.embed, texts, batch, args.seconds, max_requests, concurrency)
            stats_before = await client.model_statistics(MODEL)
            client_result = await run_client(client, texts, batch, args.seconds, max_requests, concurrency)
            stats_after = await client.model_statistics(MODEL)
            rows.append(
                {
                    "texts": kind,
                    "tokens_per_text": tokens,
                    "batch": batch,
                    "concurrency": concurrency,
                    "raw": raw_result,
                    "client": client_result,
                    "ratio": client_result["emb_per_s"] / raw_result["emb_per_s"],
                    "triton_requests": stats_after.success_count - stats_before.success_count,
                    "triton_executions": stats_after.execution_count - stats_before.execution_count,
                }
            )
            print_row(rows[-1])
    finally:
        await client.close()
        server.stop()
    return {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "onnxruntime": importlib.metadata.version("onnxruntime"),
        },
        "rows": rows,
    }


HEADER = (
    f"{'texts':6} {'tok':>4} {'batch':>5} {'conc':>4} | {'raw emb/s':>9} {'p50':>7} {'p90':>7} | "
    f"{'client emb/s':>12} {'p50':>7} {'p90':>7} | {'ratio':>5} {'decode ms':>9}"
)


def print_row(row: dict) -> None:
    if not getattr(print_row, "header_done", False):
        print(HEADER)
        print("-" * len(HEADER))
        print_row.header_done = True
    raw, client = row["raw"], row["client"]
    extra = (
        f"{row['client_decode_ms']:9.3f}"
        if "client_decode_ms" in row
        else (f"  Triton: {row['triton_executions']} executions for {row['triton_requests']} requests")
    )
    print(
        f"{row['texts']:6} {row['tokens_per_text']:>4} {row['batch']:>5} {row['concurrency']:>4} | "
        f"{raw['emb_per_s']:9.0f} {raw['p50_ms']:7.1f} {raw['p90_ms']:7.1f} | "
        f"{client['emb_per_s']:12.0f} {client['p50_ms']:7.1f} {client['p90_ms']:7.1f} | "
        f"{row['ratio']:5.2f} {extra}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--seconds", type=float, default=3.0, help="minimum measuring time per cell")
    parser.add_argument("--max-rows", type=int, default=4096, help="cap on texts embedded per cell")
    parser.add_argument("--quick", action="store_true", help="short run for a smoke check")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "triton_client.json")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.max_rows = 0.3, 256
    result = asyncio.run(measure(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwritten {args.out}")


if __name__ == "__main__":
    main()
