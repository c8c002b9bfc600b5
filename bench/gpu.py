"""Measure the service on a GPU end to end: in process, through our gRPC client to Triton, and over HTTP.

Run on the GPU machine: `make bench-gpu` (or `python bench/gpu.py --out gpu.json`); debug on a CPU
machine with `python bench/gpu.py --device cpu --config-name "" --workers 1,2 --seconds 2 --quick`.
One Triton serves the whole run (`--config-name`, default the GPU configuration `bundled-gpu`), and
the same texts (short: ~10 tokens, long: ~128 tokens) are measured in turn:

(d) agreement: the in-process vectors and Triton's against the float32 reference computed with ONNX
    Runtime on CPU (`--write-reference PATH` writes it; bench/results/gpu-reference.npz): min cosine;
(a) in process: tokenizer + the torch encoder (`load_encoder(...).embed`, float16 on CUDA, float32
    on CPU; ONNX Runtime on CPU while the encoder module is absent) at batch 1, 32 and 512: the
    physical anchor;
(b) our gRPC client (AsyncTritonClient) straight to Triton: 32/128/512 concurrent single-text calls
    and batch 32 with 32 in flight, from several client processes (one Python process cannot drive
    512 streams) summed;
(c) the HTTP service as shipped (`manage.py serve --workers N`, quotas on, a tenant that is never
    refused) for each N of `--workers`, with wrk on loopback at the same shapes, base64 responses.

Per cell: embeddings/s, p50/p99 (ms), errors, GPU utilisation (nvidia-smi sampled every 200 ms; null
without nvidia-smi), web CPU seconds per 1,000 embeddings (the serve process and all its children,
from /proc) and Triton's own view (requests, executions, rows per execution, queue and compute
time). Every cell runs in its own try/except that records its error and goes on; the JSON is
rewritten after every cell and cells that would overrun `--budget-s` are skipped, so a run cut short
still leaves figures; SIGTERM stops Triton and the servers and writes it too. bench/plot_gpu.py
turns the JSON into README's table and plot.

The servers run with the shipped settings, and on CUDA with the GPU sizes README's Sizing gives
(GPU_SERVER_ENV: the defaults are CPU-sized; a process refuses past MAX_INFLIGHT_TRITON_CALLS
requests in flight with 429, counted as errors, by reason, per cell); `--server-env VAR=VALUE` changes them,
`--shapes 32x1,512x1` measures part of the matrix, `--plan` prints the cells and the time they take.

`--engines` compares the bundled Triton's GPU engines in one run instead (README "The local model on
a GPU"): float16 PyTorch (`bundled-gpu`), float16 ONNX on ONNX Runtime's CUDA provider
(`bundled-gpu-onnx`, on the newest float16 export) and TensorRT (`bundled-gpu-tensorrt`), each in
a Triton of its own over a scratch repository whose minilm/1 is the export that engine serves; per
engine its start (a TensorRT engine's build included), the agreement with the reference, our client
straight to Triton and HTTP (`--workers`, default 8) at 32 x 32 and 512 x 1, and the engine the
service's /v1/models reports. `--engines pytorch,tensorrt` runs some. bench/plot_gpu.py prints the
engines' table.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import multiprocessing
import os
import platform
import pty
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.error
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from triton_client import make_texts, percentile  # noqa: E402

MODEL_DIR = ROOT / "model_repository" / "minilm" / "1"
TRITON_MODEL = "minilm"
REFERENCE = ROOT / "bench" / "results" / "gpu-reference.npz"
TEXT_KINDS = {"short": 8, "long": 110}  # words: ~10 and ~128 tokens
TEXTS_PER_KIND = 512
# Loopback only: no proxy from the environment between the bench and its servers.
LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))
IN_PROCESS_BATCHES = (1, 32, 512)
QUICK_IN_PROCESS_BATCHES = (1, 32)


@dataclass(frozen=True)
class LoadShape:
    """`clients` callers in flight, each sending `batch` texts per request."""

    clients: int
    batch: int

    @property
    def name(self) -> str:
        return f"{self.clients} x {self.batch}"


LOAD_SHAPES = (LoadShape(32, 1), LoadShape(128, 1), LoadShape(512, 1), LoadShape(32, 32))
QUICK_LOAD_SHAPES = (LoadShape(32, 1), LoadShape(32, 32))
ENGINE_LOAD_SHAPES = (LoadShape(32, 32), LoadShape(512, 1))
ENGINE_WORKERS = (8,)


@dataclass(frozen=True)
class Engine:
    """One of the bundled Triton's GPU engines: its name as /v1/models reports it, the configuration
    that runs it, and the export dtypes it serves, preferred first."""

    name: str
    config_name: str
    export_dtypes: tuple[str, ...]


ENGINES = {
    engine.name: engine
    for engine in (
        # Reads the weights into PyTorch and runs them in float16, whatever the export's dtype.
        Engine("pytorch", "bundled-gpu", ("float32", "float16")),
        # Runs the graph as exported: the float16 export is the float16 ONNX measured.
        Engine("onnxruntime-cuda", "bundled-gpu-onnx", ("float16",)),
        # Builds float16 kernels from either; the float16 file is the one the device carries.
        Engine("tensorrt", "bundled-gpu-tensorrt", ("float16", "float32")),
    )
}
# Fixed costs of a run besides its cells (seconds): Triton loading the model, the in-process model,
# the agreement check, the database and Redis of the HTTP stack, each server start with its warm-up
# and stop; what `planned_seconds` adds to the cells.
TRITON_START_S = 60.0
STACK_START_S = 20.0
SERVER_START_S = 20.0
CELL_OVERHEAD_S = 2.0


def texts_for(kind: str) -> list[str]:
    """The texts of one kind, the same in every measurement of the run."""
    return make_texts(TEXTS_PER_KIND, TEXT_KINDS[kind], seed=21 + TEXT_KINDS[kind])


def agreement_texts() -> list[str]:
    """The texts the reference vectors are computed for: 32 short, 32 long."""
    return make_texts(32, TEXT_KINDS["short"], seed=101) + make_texts(32, TEXT_KINDS["long"], seed=102)


# --- pure helpers (tests/bench/test_gpu.py) ---------------------------------------------------------


def parse_workers(text: str) -> list[int]:
    try:
        workers = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: expected worker counts like 1,4,8,12") from error
    if not workers or min(workers) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected worker counts of at least 1")
    return workers


def parse_shapes(text: str) -> list[LoadShape]:
    """'32x1,512x1' -> the load shapes (clients x texts per request)."""
    shapes = []
    for part in filter(None, (part.strip() for part in text.split(","))):
        clients, separator, batch = part.replace(" ", "").partition("x")
        if not separator or not clients.isdigit() or not batch.isdigit() or min(int(clients), int(batch)) < 1:
            raise argparse.ArgumentTypeError(f"{part!r}: expected CLIENTSxTEXTS, like 32x1")
        shapes.append(LoadShape(int(clients), int(batch)))
    if not shapes:
        raise argparse.ArgumentTypeError(f"{text!r}: expected shapes like 32x1,512x1,32x32")
    return shapes


def parse_engines(text: str) -> list[Engine]:
    """'pytorch,tensorrt' -> those engines, in that order; 'all' -> every one."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if names == ["all"]:
        return list(ENGINES.values())
    unknown = [name for name in names if name not in ENGINES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: expected engines among {', '.join(ENGINES)} (or all)")
    return [ENGINES[name] for name in names]


def model_exports(model_dirs: list[Path]) -> dict[Path, dict]:
    """Each numbered version folder of `model_dirs` -> its export.json (unreadable ones left out)."""
    exports = {}
    for model_dir in model_dirs:
        for version_dir in sorted(model_dir.iterdir()) if model_dir.is_dir() else ():
            if version_dir.name.isdigit():
                try:
                    exports[version_dir] = json.loads((version_dir / "export.json").read_text())
                except (OSError, ValueError):
                    continue
    return exports


def engine_export(engine: Engine, exports: dict[Path, dict]) -> Path | None:
    """The version folder `engine` serves: the newest export of the first of its dtypes that has
    one. A copy whose weights bench/device/pack.sh turned to float16 (export.json `carried_as`) is
    no valid ONNX graph any more: only PyTorch, which reads the weights alone, serves it."""
    for dtype in engine.export_dtypes:
        found = [
            version_dir
            for version_dir, info in exports.items()
            if (info.get("dtype") or "float32") == dtype
            and (engine.name == "pytorch" or "carried_as" not in info)
        ]
        if found:
            return max(found, key=lambda version_dir: int(version_dir.name))
    return None


def parse_server_env(text: str) -> tuple[str, str]:
    name, equals, value = text.partition("=")
    if not name or not equals:
        raise argparse.ArgumentTypeError(f"{text!r}: expected VAR=VALUE")
    return name, value


def wrk_script(body: dict, headers: dict[str, str]) -> str:
    """wrk's Lua: POST the same JSON body; print one machine-readable RESULT line at the end (requests,
    non-2xx responses, socket errors, duration in microseconds, p50 and p99 in milliseconds)."""
    lines = ['wrk.method = "POST"', f"wrk.body = {json.dumps(json.dumps(body))}"]
    for name, value in {"Content-Type": "application/json", **headers}.items():
        lines.append(f"wrk.headers[{json.dumps(name)}] = {json.dumps(value)}")
    lines.append(
        "done = function(summary, latency, requests)\n"
        '  io.write(string.format("RESULT %d %d %d %d %f %f\\n", summary.requests, summary.errors.status, '
        "summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout, "
        "summary.duration, latency:percentile(50) / 1000, latency:percentile(99) / 1000))\n"
        "end"
    )
    return "\n".join(lines) + "\n"


def parse_wrk(output: str, texts_per_request: int) -> dict:
    """wrk counts a non-2xx answer as a request: only the others delivered embeddings."""
    line = next((line for line in output.splitlines() if line.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no RESULT line:\n{output[-2000:]}")
    requests, status_errors, socket_errors, duration_us, p50, p99 = line.split()[1:]
    answered = int(requests) - int(status_errors)
    seconds = int(duration_us) / 1e6
    return {
        "requests": int(requests),
        "status_errors": int(status_errors),
        "socket_errors": int(socket_errors),
        "errors": int(status_errors) + int(socket_errors),
        "seconds": seconds,
        "embeddings": answered * texts_per_request,
        "emb_per_s": answered * texts_per_request / seconds,
        "p50_ms": float(p50),
        "p99_ms": float(p99),
    }


def process_tree_cpu_seconds(root_pid: int, proc: Path = Path("/proc")) -> float:
    """User + system CPU seconds of `root_pid` and all its descendants, from /proc/<pid>/stat: each
    one's own time and that of its children already reaped (cutime, cstime), so a worker that exited
    still counts and none counts twice. psutil would do, but it is not installed everywhere this runs."""
    parents: dict[int, int] = {}
    times: dict[int, int] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # The command name may hold spaces and parentheses: the fields start after the last ")".
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        parents[int(entry.name)] = int(fields[1])
        times[int(entry.name)] = sum(int(value) for value in fields[11:15])
    tree, frontier = set(), [root_pid]
    while frontier:
        pid = frontier.pop()
        if pid in times and pid not in tree:
            tree.add(pid)
            frontier.extend(child for child, parent in parents.items() if parent == pid)
    return sum(times[pid] for pid in tree) / os.sysconf("SC_CLK_TCK")


def parse_proc_stat(text: str) -> int:
    """Busy clock ticks of all CPUs from /proc/stat's first line (everything but idle and iowait)."""
    fields = [int(value) for value in text.splitlines()[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    # guest time is already inside user and nice.
    return user + nice + system + irq + softirq + steal


def machine_busy_seconds() -> float:
    return parse_proc_stat(Path("/proc/stat").read_text()) / os.sysconf("SC_CLK_TCK")


def parse_gpu_samples(output: str) -> float | None:
    """Mean of nvidia-smi's utilization.gpu samples (one integer per line); None when there are none."""
    values = []
    for line in output.splitlines():
        try:
            values.append(float(line.strip()))
        except ValueError:
            continue  # "[N/A]" or a partial last line
    return sum(values) / len(values) if values else None


REFUSAL_LINE = re.compile(r"django\.request \[[^\]]*\]: (?P<reason>[A-Za-z ]+): /")


def summarize_server_log(text: str, keep: int = 5) -> dict:
    """What the server logged during a cell: its refused requests counted by reason (Django logs a
    line per 4xx/5xx answer: "Too Many Requests", "Service Unavailable"), and the first other lines
    at WARNING and above (a traceback's first line says why)."""
    refused: dict[str, int] = {}
    other: list[str] = []
    for line in text.splitlines():
        match = REFUSAL_LINE.search(line)
        if match:
            refused[match["reason"]] = refused.get(match["reason"], 0) + 1
        elif line.strip() and len(other) < keep:
            other.append(line[:300])
    return {"refused": refused, "other_lines": other}


def base64_vectors(payload: dict) -> np.ndarray:
    """The vectors of an OpenAI-shaped answer with encoding_format base64 (little-endian float32)."""
    return np.stack(
        [np.frombuffer(base64.b64decode(row["embedding"]), dtype="<f4") for row in payload["data"]]
    )


def latency_summary(latencies_s: list[float], rows: int, wall_s: float) -> dict:
    return {
        "requests": len(latencies_s),
        "embeddings": rows * len(latencies_s),
        "seconds": wall_s,
        "emb_per_s": rows * len(latencies_s) / wall_s if wall_s > 0 else 0.0,
        "p50_ms": percentile(latencies_s, 0.5) * 1000 if latencies_s else None,
        "p99_ms": percentile(latencies_s, 0.99) * 1000 if latencies_s else None,
    }


def min_cosine(ours: np.ndarray, reference: np.ndarray) -> float:
    ours = ours / np.linalg.norm(ours, axis=1, keepdims=True)
    reference = reference / np.linalg.norm(reference, axis=1, keepdims=True)
    return float(np.sum(ours * reference, axis=1).min())


def planned_cells(args: argparse.Namespace) -> dict[str, int]:
    if args.engines:
        per_engine = len(TEXT_KINDS) * len(args.shapes)
        return {
            "in_process": 0,
            "triton_direct": per_engine * len(args.engines),
            "http": per_engine * len(args.workers) * len(args.engines),
        }
    return {
        "in_process": len(TEXT_KINDS) * len(args.batches),
        "triton_direct": len(TEXT_KINDS) * len(args.shapes),
        "http": len(TEXT_KINDS) * len(args.shapes) * len(args.workers),
    }


def in_process_seconds(seconds: float) -> float:
    return max(1.0, seconds / 2)


def planned_seconds(args: argparse.Namespace) -> float:
    """What the run should take: its cells, their probes and its fixed costs."""
    cells = planned_cells(args)
    measured = cells["in_process"] * in_process_seconds(args.seconds)
    measured += (cells["triton_direct"] + cells["http"]) * (wrk_seconds(args.seconds) + CELL_OVERHEAD_S)
    starts = max(1, len(args.engines))  # each engine its own Triton, stack and servers
    return measured + starts * (TRITON_START_S + STACK_START_S + SERVER_START_S * len(args.workers))


def wrk_seconds(seconds: float) -> int:
    return max(1, round(seconds))


# --- the environment --------------------------------------------------------------------------------


def run_quietly(command: list[str], timeout_s: float = 20) -> str | None:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device: str) -> dict:
    info: dict = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "device": device,
        "wrk": shutil.which("wrk"),
        "redis_server": shutil.which("redis-server"),
    }
    gpus = run_quietly(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    )
    info["gpus"] = [line.strip() for line in gpus.splitlines() if line.strip()] if gpus else None
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
        info["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            info["torch_device_name"] = torch.cuda.get_device_name(0)
    except Exception as error:  # an environment probe: record, never fail
        info["torch"] = f"unavailable: {error}"
    try:
        import onnxruntime

        info["onnxruntime"] = onnxruntime.__version__
    except Exception as error:
        info["onnxruntime"] = f"unavailable: {error}"
    return info


GPU_SAMPLING = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-lms", "200"]


class GpuSampler:
    """nvidia-smi sampling GPU utilisation every 200 ms while a cell runs; stop() gives the mean, None
    without nvidia-smi.

    Its output goes to a pseudo-terminal: written to a pipe, C's stdio keeps a few seconds of lines
    in its buffer, which a stopped process may never write. Stopped with SIGINT, its Ctrl-C."""

    def __init__(self, command: list[str] = GPU_SAMPLING) -> None:
        self.process = None
        if shutil.which(command[0]) is None:
            return
        self.output = bytearray()
        self.terminal, child_side = pty.openpty()
        try:
            self.process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=child_side, stderr=subprocess.DEVNULL
            )
        finally:
            os.close(child_side)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.terminal, 4096)
            except OSError:  # EIO: the process has exited and closed its side
                return
            if not chunk:
                return
            self.output.extend(chunk)

    def stop(self) -> float | None:
        if self.process is None:
            return None
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=3)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.reader.join(timeout=3)
        os.close(self.terminal)
        return parse_gpu_samples(self.output.decode("ascii", "replace"))


# --- the models in process --------------------------------------------------------------------------


def tokenizer():
    from embeddings.tokenization import TextTokenizer

    return TextTokenizer.from_file(MODEL_DIR / "tokenizer.json")


class OnnxReference:
    """ONNX Runtime on CPU, float32, all cores: the reference vectors, and the in-process model on CPU
    while the torch encoder is not there yet."""

    name = "onnxruntime-cpu-float32"

    def __init__(self) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = os.cpu_count() or 1
        self.session = ort.InferenceSession(
            str(MODEL_DIR / "model.onnx"), options, providers=["CPUExecutionProvider"]
        )

    def embed(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        return self.session.run(None, {"input_ids": input_ids, "attention_mask": attention_mask})[0]


def load_in_process_model(device: str):
    """The torch encoder the GPU backend serves (float16 on CUDA, float32 on CPU); on CPU, ONNX Runtime
    while the encoder module cannot be imported. Returns (model, description)."""
    try:
        import torch

        from embeddings.in_triton.backends.embedsite_torch.encoder import load_encoder
    except ImportError:
        if device != "cpu":
            raise
        return OnnxReference(), OnnxReference.name
    dtype = torch.float16 if device == "cuda" else torch.float32
    encoder = load_encoder(MODEL_DIR / "model.onnx", device=device, dtype=dtype)
    return encoder, f"torch-{device}-{str(dtype).removeprefix('torch.')}"


def embed_texts(model, tok, texts: list[str], batch: int = 32) -> np.ndarray:
    parts = []
    for start in range(0, len(texts), batch):
        encoded = tok.encode(texts[start : start + batch])
        parts.append(np.asarray(model.embed(encoded.input_ids, encoded.attention_mask), dtype=np.float32))
    return np.concatenate(parts)


def measure_in_process(model, tok, texts: list[str], batch: int, seconds: float) -> dict:
    """One caller, batch after batch, tokenizing each: what the model alone gives at this batch."""
    chunks = [texts[i : i + batch] for i in range(0, len(texts) - batch + 1, batch)] or [texts[:batch]]
    for chunk in chunks[:2]:  # warm up (CUDA kernels, allocator)
        encoded = tok.encode(chunk)
        model.embed(encoded.input_ids, encoded.attention_mask)
    latencies, tokenize_s = [], 0.0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds or not latencies:
        chunk = chunks[len(latencies) % len(chunks)]
        begun = time.perf_counter()
        encoded = tok.encode(chunk)
        tokenized = time.perf_counter()
        model.embed(encoded.input_ids, encoded.attention_mask)
        latencies.append(time.perf_counter() - begun)
        tokenize_s += tokenized - begun
    result = latency_summary(latencies, batch, time.perf_counter() - started)
    model_s = sum(latencies) - tokenize_s
    result["model_only_emb_per_s"] = result["embeddings"] / model_s if model_s > 0 else None
    return result


def write_reference(path: Path) -> None:
    """The float32 vectors ONNX Runtime computes on CPU for agreement_texts(), stored with the texts."""
    texts = agreement_texts()
    vectors = embed_texts(OnnxReference(), tokenizer(), texts)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, texts=np.array(texts), vectors=vectors.astype(np.float32))
    print(f"written {path}: {len(texts)} texts x {vectors.shape[1]} dimensions", flush=True)


def load_reference(path: Path) -> tuple[list[str], np.ndarray, str]:
    """The stored reference, or one computed here with ONNX Runtime when the file is missing."""
    if path.exists():
        with np.load(path) as stored:
            return [str(text) for text in stored["texts"]], stored["vectors"], str(path)
    texts = agreement_texts()
    return texts, embed_texts(OnnxReference(), tokenizer(), texts), "computed in this run (file missing)"


# --- our gRPC client straight to Triton, from several processes ------------------------------------

_worker_state: dict = {}


def _client_process_tokens(
    texts_key: str, texts: list[str], batch: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The requests' token tensors, tokenized once per process: the load is Triton's, not the tokenizer's."""
    key = (texts_key, batch)
    if key not in _worker_state:
        tok = _worker_state.setdefault("tokenizer", tokenizer())
        chunks = [texts[i : i + batch] for i in range(0, len(texts) - batch + 1, batch)]
        _worker_state[key] = [(e.input_ids, e.attention_mask) for e in map(tok.encode, chunks)]
    return _worker_state[key]


def client_process_ready() -> int:
    """Imports and the tokenizer loaded before the first cell is timed."""
    _worker_state.setdefault("tokenizer", tokenizer())
    return os.getpid()


def client_process_run(
    target: str, texts_key: str, texts: list[str], batch: int, clients: int, start_at: float, seconds: float
) -> dict:
    """`clients` concurrent callers in this process, from `start_at` (time.time()) for `seconds`."""
    from embeddings.triton.client import AsyncTritonClient

    requests = _client_process_tokens(texts_key, texts, batch)

    async def run() -> dict:
        latencies: list[float] = []
        errors: list[str] = []  # the first few; a dead Triton fails fast and often
        failed = 0
        async with AsyncTritonClient(target, channels=4, timeout_s=60, retries=0) as client:
            await client.embed_tokens(TRITON_MODEL, *requests[0])  # warm up: model spec, channels
            await asyncio.sleep(max(0.0, start_at - time.time()))
            began, began_wall = time.perf_counter(), time.time()

            async def caller(index: int) -> None:
                nonlocal failed
                sent = index
                while time.perf_counter() - began < seconds:
                    input_ids, attention_mask = requests[sent % len(requests)]
                    sent += clients
                    t0 = time.perf_counter()
                    try:
                        await client.embed_tokens(TRITON_MODEL, input_ids, attention_mask)
                    except Exception as error:  # counted and reported, the cell goes on
                        failed += 1
                        if len(errors) < 5:
                            errors.append(f"{type(error).__name__}: {error}"[:300])
                        continue
                    latencies.append(time.perf_counter() - t0)

            await asyncio.gather(*(caller(index) for index in range(clients)))
            ended_wall = time.time()
        return {"latencies": latencies, "errors": errors, "failed": failed, "started": began_wall,
                "ended": ended_wall}  # fmt: skip

    return asyncio.run(run())


def split_clients(clients: int, processes: int) -> list[int]:
    """`clients` spread over at most `processes` processes, as evenly as possible, none empty."""
    processes = max(1, min(processes, clients))
    return [clients // processes + (1 if index < clients % processes else 0) for index in range(processes)]


def merge_client_results(parts: list[dict], batch: int) -> dict:
    latencies = [latency for part in parts for latency in part["latencies"]]
    errors = [error for part in parts for error in part["errors"]]
    failed = sum(part["failed"] for part in parts)
    wall = max(part["ended"] for part in parts) - min(part["started"] for part in parts)
    result = latency_summary(latencies, batch, wall)
    result["errors"] = failed
    if errors:
        result["first_error"] = errors[0]
    return result


# --- the HTTP service -------------------------------------------------------------------------------


def http_server_class():
    from api import Server

    class WorkersServer(Server):
        """`manage.py serve --workers N`: uvicorn's supervisor and its N worker processes."""

        def __init__(self, env: dict[str, str], port: int, workers: int, log_path: Path) -> None:
            self.workers = workers
            self.log_path = log_path
            # Its log goes to a file: a line per refused request would bury the run's progress lines
            # (the device returns only the last lines of a command's output).
            with open(log_path, "ab") as log:
                super().__init__(env, port, output=log)

        def log_size(self) -> int:
            return self.log_path.stat().st_size

        def log_since(self, offset: int) -> str:
            with open(self.log_path, "rb") as log:
                log.seek(offset)
                return log.read().decode("utf-8", "replace")

        def command(self, port: int) -> list[str]:
            return [sys.executable, str(ROOT / "manage.py"), "serve", "--host", "127.0.0.1", "--port",
                    str(port), "--workers", str(self.workers)]  # fmt: skip

        def cpu_seconds(self) -> float:
            return process_tree_cpu_seconds(self.process.pid)

        def wait_for_workers(self, timeout_s: float = 60) -> float:
            """/health answers once one worker is up: wait until all N are there and done starting,
            that is until the idle server's processes use less than a fifth of a core (importing
            Django keeps one busy). Returns the seconds waited."""
            started = time.monotonic()
            deadline = started + timeout_s
            # One worker is served by the supervisor's own process, more by as many children.
            children = 0 if self.workers == 1 else self.workers
            while time.monotonic() < deadline and child_count(self.process.pid) < children:
                time.sleep(0.25)
            before = self.cpu_seconds()
            while time.monotonic() < deadline:
                time.sleep(0.5)
                now = self.cpu_seconds()
                if now - before < 0.1:
                    break
                before = now
            return time.monotonic() - started

        def stop(self) -> None:
            super().stop()
            # uvicorn's supervisor ends its workers; make sure none outlives a killed supervisor.
            for pid in descendants(self.process.pid):
                with suppress(OSError):
                    os.kill(pid, 9)

    return WorkersServer


def descendants(root_pid: int) -> list[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
    found, frontier = [], [root_pid]
    while frontier:
        pid = frontier.pop()
        children = [child for child, parent in parents.items() if parent == pid]
        found.extend(children)
        frontier.extend(children)
    return found


def child_count(root_pid: int) -> int:
    return len(descendants(root_pid))


def http_probe(url: str, body: dict, headers: dict[str, str]) -> np.ndarray:
    """One request before wrk (which counts error answers as requests): 200 and one base64 vector per
    input, or the cell fails with the server's answer. Returns the vectors. The standard library's
    client: the GPU machine has the service's packages only."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={**headers, "Content-Type": "application/json"}
    )
    try:
        with LOOPBACK.open(request, timeout=120) as reply:
            payload = json.load(reply)
    except urllib.error.HTTPError as error:
        raise RuntimeError(f"{url} answered {error.code}: {error.read()[:300]!r}") from error
    vectors = base64_vectors(payload)
    if len(vectors) != len(body["input"]):
        raise RuntimeError(f"{url} answered {len(vectors)} vectors for {len(body['input'])} inputs")
    return vectors


def run_wrk(url: str, body: dict, headers: dict[str, str], shape: LoadShape, seconds: float, threads: int,
            workdir: Path) -> dict:  # fmt: skip
    script = workdir / "post.lua"
    script.write_text(wrk_script(body, headers))
    duration = wrk_seconds(seconds)
    output = subprocess.run(
        ["wrk", "-t", str(min(threads, shape.clients)), "-c", str(shape.clients), "-d", f"{duration}s",
         "--timeout", "30s", "-s", str(script), url],
        capture_output=True, text=True, check=True, timeout=duration + 60,
    ).stdout  # fmt: skip
    return parse_wrk(output, shape.batch)


# --- the run ----------------------------------------------------------------------------------------


class Run:
    """The JSON being built: written after every cell, each cell in its own try/except."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.started = time.monotonic()
        self.result: dict = {
            "options": {
                "config_name": args.config_name,
                "device": args.device,
                "seconds": args.seconds,
                "workers": args.workers,
                "quick": args.quick,
                "client_processes": args.client_processes,
                "wrk_threads": args.wrk_threads,
                "server_env": dict(args.server_env),
                "shapes": [shape.name for shape in args.shapes],
                "in_process_batches": args.batches,
                "budget_s": args.budget_s,
                "engines": [engine.name for engine in args.engines],
            },
            "planned_s": planned_seconds(args),
            "environment": {},
            "texts": {},
            "agreement": {},
            "in_process": [],
            "triton_direct": [],
            "http": [],
            "engines": [],
            "errors": [],
            "finished": False,
        }

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def save(self) -> None:
        self.result["elapsed_s"] = round(self.elapsed(), 1)
        self.args.out.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.args.out.with_suffix(".tmp")
        temporary.write_text(json.dumps(self.result, indent=2) + "\n")
        temporary.replace(self.args.out)

    def error(self, where: str, error: BaseException) -> None:
        text = f"{type(error).__name__}: {error}"
        self.result["errors"].append({"where": where, "error": text, "trace": traceback.format_exc()[-3000:]})
        print(f"!! {where}: {text}", flush=True)
        self.save()

    def cell(self, section: str, labels: dict, measure, expected_s: float) -> dict | None:
        """Run one cell: measure() -> dict, recorded with its labels, or its error; skipped when it
        would overrun the budget."""
        entry = dict(labels)
        if self.elapsed() + expected_s > self.args.budget_s:
            entry["skipped"] = f"budget: {self.elapsed():.0f} s spent of {self.args.budget_s:.0f}"
        else:
            try:
                entry.update(measure())
            except Exception as error:  # one cell's failure must not end the run
                entry["error"] = f"{type(error).__name__}: {error}"[:2000]
        self.result[section].append(entry)
        self.save()
        print(format_progress(section, entry), flush=True)
        return entry


def format_progress(section: str, entry: dict) -> str:
    keys = ("engine", "texts", "workers", "shape", "batch")
    labels = " ".join(f"{key}={entry[key]}" for key in keys if key in entry)
    if "error" in entry or "skipped" in entry:
        return f"{section:13} {labels}: {entry.get('error') or entry.get('skipped')}"
    parts = [f"{entry['emb_per_s']:9.0f} emb/s"]
    if entry.get("p50_ms") is not None:
        parts.append(f"p50 {entry['p50_ms']:.1f} ms p99 {entry['p99_ms']:.1f} ms")
    if entry.get("errors"):
        refused = entry.get("server_log", {}).get("refused")
        parts.append(f"{entry['errors']} ERRORS" + (f" {refused}" if refused else ""))
    if entry.get("gpu_util_mean") is not None:
        parts.append(f"GPU {entry['gpu_util_mean']:.0f}%")
    if entry.get("web_cpu_s_per_1000") is not None:
        parts.append(f"web CPU {entry['web_cpu_s_per_1000']:.3f} s/1000")
    if entry.get("rows_per_execution") is not None:
        parts.append(f"{entry['rows_per_execution']:.1f} rows/execution")
    return f"{section:13} {labels}: " + ", ".join(parts)


def triton_stats(triton_http: str) -> dict | None:
    from triton_stats import triton_counts

    try:
        return triton_counts(triton_http)
    except Exception:  # Triton's own view is a bonus, never a reason to fail a cell
        return None


class Observation:
    """What the machine did while a cell ran: Triton's statistics (requests, executions, rows per
    execution, queue and compute time), the GPU's utilisation, and the cores Triton and the whole
    machine kept busy."""

    def __init__(self, triton) -> None:
        self.triton = triton

    def start(self) -> None:
        self.stats = triton_stats(self.triton.http_url)
        self.triton_cpu = process_tree_cpu_seconds(self.triton.process.pid)
        self.machine = machine_busy_seconds()
        self.sampler = GpuSampler()
        self.began = time.monotonic()

    def stop(self, result: dict) -> dict:
        from triton_stats import triton_delta

        result["gpu_util_mean"] = self.sampler.stop()
        wall = time.monotonic() - self.began
        result["triton_cores_busy"] = (
            process_tree_cpu_seconds(self.triton.process.pid) - self.triton_cpu
        ) / wall
        result["machine_cores_busy"] = (machine_busy_seconds() - self.machine) / wall
        stats = triton_stats(self.triton.http_url)
        if self.stats is not None and stats is not None:
            result.update(triton_delta(self.stats, stats))
        return result

    def abandon(self) -> None:
        """The cell failed: end the GPU sampling."""
        self.sampler.stop()


def measure_all(run: Run, workdir: Path, stack: ExitStack) -> None:
    args = run.args
    shapes, batches = args.shapes, args.batches
    tok = tokenizer()
    texts = {kind: texts_for(kind) for kind in TEXT_KINDS}
    for kind, kind_texts in texts.items():
        counts = tok.encode(kind_texts[:256]).token_counts
        run.result["texts"][kind] = {
            "words": TEXT_KINDS[kind],
            "tokens_mean": float(counts.mean()),
            "tokens_min": int(counts.min()),
            "tokens_max": int(counts.max()),
        }
        print(f"{kind} texts: {TEXT_KINDS[kind]} words, {counts.mean():.1f} tokens on average", flush=True)
    run.save()

    triton = start_triton(run, workdir, stack)
    model = None
    try:
        model, description = load_in_process_model(args.device)
        run.result["in_process_model"] = description
    except Exception as error:
        run.error("in-process model", error)

    # (d) agreement with the float32 reference, before anything is timed.
    reference = None
    try:
        reference = load_reference(args.reference)
    except Exception as error:
        run.error("reference vectors", error)
    if reference is not None:
        agreement(run, model, tok, triton, reference)

    # (a) in process.
    for kind, kind_texts in texts.items():
        for batch in batches:
            seconds = in_process_seconds(args.seconds)

            def measure(kind_texts=kind_texts, batch=batch, seconds=seconds):
                if model is None:
                    raise RuntimeError("no in-process model (see errors)")
                sampler = GpuSampler()
                try:
                    result = measure_in_process(model, tok, kind_texts, batch, seconds)
                finally:
                    result_gpu = sampler.stop()
                return {**result, "gpu_util_mean": result_gpu}

            run.cell("in_process", {"texts": kind, "batch": batch}, measure, seconds + 5)
    if model is not None:
        del model
        free_device_memory()

    # (b) our gRPC client straight to Triton, from several processes.
    if triton is not None:
        measure_triton_direct(run, triton, texts, shapes)

    # (c) the HTTP service, each worker count started, measured and stopped in turn.
    if triton is not None:
        measure_http(run, workdir, stack, triton, texts, shapes, reference)


def measure_engines_run(run: Run, workdir: Path) -> None:
    """--engines: the texts and reference once, then each engine."""
    tok = tokenizer()
    texts = {kind: texts_for(kind) for kind in TEXT_KINDS}
    for kind, kind_texts in texts.items():
        counts = tok.encode(kind_texts[:256]).token_counts
        run.result["texts"][kind] = {"words": TEXT_KINDS[kind], "tokens_mean": float(counts.mean())}
    reference = None
    try:
        reference = load_reference(run.args.reference)
    except Exception as error:
        run.error("reference vectors", error)
    measure_engines(run, workdir, texts, reference)


def free_device_memory() -> None:
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def start_triton(run: Run, workdir: Path, stack: ExitStack, *, repository: Path | None = None,
                 config_name: str | None = None, record: dict | None = None):  # fmt: skip
    """Triton over `repository` (the checkout's) with `config_name` (--config-name), its start time
    and log tail recorded in `record` (the run's result)."""
    from embeddings.tooling.triton_server import TritonServer, free_port

    record = run.result if record is None else record
    config_name = run.args.config_name if config_name is None else config_name
    triton = TritonServer(
        model_repositories=[repository or ROOT / "model_repository"],
        run_dir=workdir / "triton",
        grpc_port=free_port(),
        http_port=free_port(),
        metrics_port=free_port(),
        model_config_name=config_name,
        log_path=workdir / "triton.log",
    )
    started = time.monotonic()
    try:
        triton.start()
        stack.callback(triton.stop)
        # Runs before the stop above (last in, first out): Triton's log ends up in the JSON.
        stack.callback(lambda: record.update(triton_log_tail=triton.log_tail(60)))
        triton.wait_until_ready(run.args.triton_start_timeout_s)
    except Exception as error:
        record["triton_log_tail"] = triton.log_tail(80) if triton.log_path else None
        run.error(f"Triton start ({config_name or 'config.pbtxt'})", error)
        return None
    record["triton_start_s"] = round(time.monotonic() - started, 1)
    print(f"Triton ready in {record['triton_start_s']} s ({config_name or 'config.pbtxt'})", flush=True)
    return triton


def agreement(run: Run, model, tok, triton, reference: tuple[list[str], np.ndarray, str],
              record: dict | None = None) -> None:  # fmt: skip
    """Min cosine of the in-process and of Triton's vectors against the reference, each on its own."""
    texts, vectors, source = reference
    found = {"reference": source, "texts": len(texts)}
    (run.result if record is None else record)["agreement"] = found
    if model is not None:
        try:
            found["in_process_min_cosine"] = min_cosine(embed_texts(model, tok, texts), vectors)
        except Exception as error:
            run.error("agreement in process", error)
    if triton is not None:
        try:
            found["triton_min_cosine"] = min_cosine(triton_vectors(triton, tok, texts), vectors)
        except Exception as error:
            run.error("agreement through Triton", error)
    run.save()
    print(f"agreement with the float32 reference: {found}", flush=True)


def triton_vectors(triton, tok, texts: list[str]) -> np.ndarray:
    from embeddings.triton.client import TritonClient

    with TritonClient(triton.grpc_target, timeout_s=120) as client:
        served = []
        for start in range(0, len(texts), 32):
            encoded = tok.encode(texts[start : start + 32])
            served.append(client.embed_tokens(TRITON_MODEL, encoded.input_ids, encoded.attention_mask))
    return np.concatenate(served)


def measure_triton_direct(
    run: Run, triton, texts: dict[str, list[str]], shapes, engine: str | None = None
) -> None:
    args = run.args
    context = multiprocessing.get_context("spawn")
    try:
        pool = ProcessPoolExecutor(args.client_processes, mp_context=context)
        # Every process up and warm before the first cell (each sleeps, so each call gets its own).
        run.result["client_pids"] = sorted(set(pool.map(_ready_after, [1.0] * args.client_processes)))
    except Exception as error:
        run.error("gRPC client processes", error)
        return
    try:
        for kind, kind_texts in texts.items():
            for shape in shapes:

                def measure(kind=kind, kind_texts=kind_texts, shape=shape):
                    return triton_direct_cell(pool, args.client_processes, triton, kind, kind_texts, shape,
                                              args.seconds)  # fmt: skip

                labels = {"texts": kind, "shape": shape.name, "clients": shape.clients, "batch": shape.batch}
                if engine is not None:
                    labels = {"engine": engine, **labels}
                run.cell("triton_direct", labels, measure, args.seconds + 15)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _ready_after(delay: float) -> int:
    time.sleep(delay)
    return client_process_ready()


def triton_direct_cell(
    pool, processes: int, triton, kind: str, texts: list[str], shape: LoadShape, seconds: float
) -> dict:
    split = split_clients(shape.clients, processes)
    start_at = time.time() + 1.5  # every process warmed up and waiting before the clock starts
    futures = [
        pool.submit(
            client_process_run, triton.grpc_target, kind, texts, shape.batch, clients, start_at, seconds
        )
        for clients in split
    ]
    observation = Observation(triton)
    time.sleep(max(0.0, start_at - time.time()))
    observation.start()
    try:
        parts = [future.result(timeout=seconds + 60) for future in futures]
    except BaseException:
        observation.abandon()
        raise
    result = merge_client_results(parts, shape.batch)
    result["client_processes"] = len(split)
    return observation.stop(result)


def measure_http(
    run: Run,
    workdir: Path,
    stack: ExitStack,
    triton,
    texts: dict[str, list[str]],
    shapes,
    reference,
    engine: Engine | None = None,
    repository: Path | None = None,
    record: dict | None = None,
) -> None:
    """Each worker count's server started, measured and stopped in turn; with an `engine`, over its
    `repository` and configuration, its cells labelled with it and the engine /v1/models reports
    recorded in `record`."""
    from api import RedisPair, prepare_database

    from embeddings.tooling.triton_server import free_port

    args = run.args
    try:
        redis = RedisPair(workdir)
        stack.callback(redis.stop)
        env = {
            **os.environ,
            **redis.start(),
            "DJANGO_SETTINGS_MODULE": "embedsite.settings",
            "DATABASE_URL": f"sqlite:///{workdir / 'db.sqlite3'}",
            "TRITON_SERVER_URL": triton.grpc_target,
            "TRITON_MODEL_CONFIG_NAME": args.config_name if engine is None else engine.config_name,
            **({"TRITON_MODEL_REPOSITORY": str(repository)} if repository is not None else {}),
            "QUOTAS_ENABLED": "true",
            "LOG_LEVEL": "WARNING",
            **dict(args.server_env),
        }
        key = prepare_database(env, triton.grpc_target)
    except Exception as error:
        run.error("HTTP stack (Redis, database)", error)
        return
    headers = {"Authorization": f"Bearer {key}"}
    engine_label = {} if engine is None else {"engine": engine.name}
    # Each server's first request: the reference texts, its vectors checked (when there is a reference).
    check_texts = reference[0] if reference is not None else agreement_texts()
    WorkersServer = http_server_class()
    for workers in args.workers:
        if run.elapsed() + SERVER_START_S + CELL_OVERHEAD_S + args.seconds > args.budget_s:
            for kind in texts:
                for shape in shapes:
                    labels = {**engine_label, "texts": kind, "workers": workers, "shape": shape.name,
                              "clients": shape.clients, "batch": shape.batch}  # fmt: skip
                    run.cell("http", labels, dict, float("inf"))  # recorded as skipped
            continue
        server = None
        started = time.monotonic()
        try:
            server = WorkersServer(env, free_port(), workers, workdir / f"serve-{workers}.log")
            booted_s = server.wait_for_workers()
            url = f"{server.url}/v1/embeddings"
            check = {"model": "all-MiniLM-L6-v2", "input": check_texts, "encoding_format": "base64"}
            served = http_probe(url, check, headers)
            cosine = min_cosine(served, reference[1]) if reference is not None else None
            warm_up(url, texts["short"], headers, workers, args, workdir)
            if record is not None:
                record["reported_engine"] = reported_engine(server.url, headers)
            run.result.setdefault("servers", []).append(
                {
                    **engine_label,
                    "workers": workers,
                    "start_s": round(time.monotonic() - started, 1),
                    "workers_settled_s": round(booted_s, 1),
                    "min_cosine": cosine,
                }
            )
            print(f"serve --workers {workers} up in {time.monotonic() - started:.1f} s, "
                  f"min cosine {cosine}", flush=True)  # fmt: skip
        except Exception as error:
            log = workdir / f"serve-{workers}.log"
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            run.result.setdefault("servers", []).append(
                {**engine_label, "workers": workers, "error": str(error), "log_tail": tail}
            )
            run.error(f"serve --workers {workers}", error)
            if server is not None:
                server.stop()
            continue
        try:
            for kind, kind_texts in texts.items():
                for shape in shapes:

                    def measure(kind_texts=kind_texts, shape=shape, server=server, url=url):
                        return http_cell(server, url, kind_texts, shape, headers, triton, args, workdir)

                    labels = {**engine_label, "texts": kind, "workers": workers, "shape": shape.name,
                              "clients": shape.clients, "batch": shape.batch}  # fmt: skip
                    run.cell("http", labels, measure, args.seconds + CELL_OVERHEAD_S + 10)
        finally:
            server.stop()


def reported_engine(base_url: str, headers: dict[str, str]) -> dict | None:
    """The engine the service's /v1/models says answers the default model."""
    request = urllib.request.Request(f"{base_url}/v1/models/all-MiniLM-L6-v2", headers=headers)
    with LOOPBACK.open(request, timeout=30) as reply:
        return json.load(reply).get("engine")


# --- the GPU engines, one after the other (--engines) ------------------------------------------------


# A backend's load line in Triton's log, without the closing quote Triton puts around messages.
ENGINE_LOG_LINE = re.compile(r'(embedsite_(?:onnx|torch): [^"\n]*)')


def engine_repository(directory: Path, version_dir: Path) -> Path:
    """A model repository serving `version_dir` as minilm's version 1, with minilm's configurations
    and the tokenizer models beside it: each engine's Triton serves only the export it runs."""
    source = MODEL_DIR.parent
    model = directory / TRITON_MODEL
    model.mkdir(parents=True)
    (model / "1").symlink_to(version_dir.resolve())
    shutil.copyfile(source / "config.pbtxt", model / "config.pbtxt")
    shutil.copytree(source / "configs", model / "configs")
    for other in source.parent.iterdir():
        if other.name != TRITON_MODEL and (other / "config.pbtxt").is_file():
            (directory / other.name).symlink_to(other.resolve())
    return directory


def measure_engines(run: Run, workdir: Path, texts: dict[str, list[str]], reference) -> None:
    """Each engine in its own Triton over its own export: agreement, Triton direct, HTTP."""
    args = run.args
    tok = tokenizer()
    exports = model_exports([MODEL_DIR.parent, *args.exports])
    for engine in args.engines:
        record: dict = {"engine": engine.name, "config_name": engine.config_name}
        run.result["engines"].append(record)
        version_dir = engine_export(engine, exports)
        if version_dir is None:
            record["error"] = (
                f"no {' or '.join(engine.export_dtypes)} export of {TRITON_MODEL} to serve "
                f"(manage.py export_model --name {TRITON_MODEL} --dtype {engine.export_dtypes[0]})"
            )
            run.error(f"engine {engine.name}", RuntimeError(record["error"]))
            continue
        info = exports[version_dir]
        record |= {"version": int(version_dir.name), "export_dir": str(version_dir),
                   "export_dtype": info.get("dtype") or "float32"}  # fmt: skip
        if "carried_as" in info:
            record["carried_as"] = info["carried_as"]
        directory = workdir / engine.name
        repository = engine_repository(directory / "repository", version_dir)
        with ExitStack() as stack:
            triton = start_triton(run, directory, stack, repository=repository,
                                  config_name=engine.config_name, record=record)  # fmt: skip
            if triton is None:
                continue
            log = triton.log_path.read_text(errors="replace")
            record["load_log"] = [match.group(1)[:500] for match in ENGINE_LOG_LINE.finditer(log)][:8]
            if reference is not None:
                agreement(run, None, tok, triton, reference, record=record)
            measure_triton_direct(run, triton, texts, args.shapes, engine=engine.name)
            measure_http(run, directory, stack, triton, texts, args.shapes, reference,
                         engine=engine, repository=repository, record=record)  # fmt: skip
        run.save()


def warm_up(url: str, texts: list[str], headers: dict[str, str], workers: int, args, workdir: Path) -> None:
    """A second of load, so every worker has made its first Triton call before a cell is timed."""
    shape = LoadShape(max(8, 4 * workers), 1)
    body = {"model": "all-MiniLM-L6-v2", "input": texts[:1], "encoding_format": "base64"}
    run_wrk(url, body, headers, shape, 1, args.wrk_threads, workdir)


def http_cell(
    server, url: str, texts: list[str], shape: LoadShape, headers, triton, args, workdir: Path
) -> dict:
    body = {"model": "all-MiniLM-L6-v2", "input": texts[: shape.batch], "encoding_format": "base64"}
    http_probe(url, body, headers)

    observation = Observation(triton)
    log_offset = server.log_size()
    cpu_before = server.cpu_seconds()
    observation.start()
    try:
        result = run_wrk(url, body, headers, shape, args.seconds, args.wrk_threads, workdir)
    except BaseException:
        observation.abandon()
        raise
    observation.stop(result)
    result["server_log"] = summarize_server_log(server.log_since(log_offset))
    cpu = server.cpu_seconds() - cpu_before
    result["web_cpu_s"] = cpu
    result["web_cpu_s_per_1000"] = cpu * 1000 / result["embeddings"] if result["embeddings"] else None
    # Cores the web processes kept busy, of the `workers` they could use.
    result["web_cores_busy"] = cpu / result["seconds"] if result["seconds"] else None
    return result


def stop_on_sigterm(signum: int, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


# The service's limits sized for a GPU (README "Sizing"); its defaults are a CPU's.
GPU_SERVER_ENV = {
    "MAX_BATCH_TOKENS": "16384",
    "MAX_TOKENS_IN_FLIGHT": "32768",
    "MAX_INFLIGHT_TRITON_CALLS": "1024",
    "COALESCE_MAX_CALLS": "2",
    "REDIS_MAX_CONNECTIONS": "256",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config-name", default="bundled-gpu",
                        help='Triton configuration: configs/<NAME>.pbtxt; "" for config.pbtxt')  # fmt: skip
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="in-process model's device")
    parser.add_argument("--seconds", type=float, default=4.0,
                        help="seconds per gRPC and HTTP cell (in-process cells take half)")  # fmt: skip
    parser.add_argument("--workers", type=parse_workers,
                        help="e.g. 1,4,8,12 (default: that; with --engines, 8)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu.json")
    parser.add_argument("--quick", action="store_true", help="fewer shapes and batches: a smoke run")
    parser.add_argument("--reference", type=Path, default=REFERENCE,
                        help="float32 reference vectors (computed in the run when missing)")  # fmt: skip
    parser.add_argument("--write-reference", type=Path, metavar="PATH",
                        help="write the reference (ONNX Runtime, CPU) to PATH and exit")  # fmt: skip
    parser.add_argument("--client-processes", type=int, default=min(8, max(1, (os.cpu_count() or 2) // 2)),
                        help="processes the gRPC clients are spread over")  # fmt: skip
    parser.add_argument("--wrk-threads", type=int, default=min(4, max(1, (os.cpu_count() or 2) // 4)))
    parser.add_argument("--server-env", type=parse_server_env, action="append", default=[],
                        metavar="VAR=VALUE", help="extra environment of the HTTP servers")  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="skip the cells that would end later than this after the start")  # fmt: skip
    parser.add_argument("--triton-start-timeout-s", type=float, default=240.0)
    parser.add_argument("--shapes", type=parse_shapes,
                        help="gRPC and HTTP load shapes, e.g. 32x1,512x1 (default: all)")  # fmt: skip
    parser.add_argument("--plan", action="store_true", help="print the cell count and planned time, and exit")
    parser.add_argument("--exports", type=Path, action="append", default=[], metavar="DIR",
                        help="with --engines, more folders of minilm's numbered versions to choose "
                        "each engine's export from (the device's float16 export)")  # fmt: skip
    parser.add_argument("--engines", type=parse_engines, nargs="?", const="all", default=[],
                        help=f"compare the GPU engines ({','.join(ENGINES)}; bare: all) at 32x32 and "
                        "512x1 instead of one configuration's full matrix")  # fmt: skip
    args = parser.parse_args(argv)
    if args.seconds < 1:
        parser.error("--seconds must be at least 1 (wrk runs whole seconds)")
    if args.client_processes < 1 or args.wrk_threads < 1:
        parser.error("--client-processes and --wrk-threads must be at least 1")
    if args.device == "cuda":
        # First, so that a --server-env of the same name wins.
        args.server_env = [*GPU_SERVER_ENV.items(), *args.server_env]
    if args.engines and args.device != "cuda":
        parser.error("--engines runs the GPU engines: it needs --device cuda")
    if args.shapes is None:
        default_shapes = (
            ENGINE_LOAD_SHAPES if args.engines else QUICK_LOAD_SHAPES if args.quick else LOAD_SHAPES
        )
        args.shapes = list(default_shapes)
    if args.workers is None:
        args.workers = list(ENGINE_WORKERS if args.engines else (1, 4, 8, 12))
    args.batches = (
        [] if args.engines else list(QUICK_IN_PROCESS_BATCHES if args.quick else IN_PROCESS_BATCHES)
    )
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "embedsite.settings")
    if args.write_reference is not None:
        write_reference(args.write_reference)
        return
    cells = planned_cells(args)
    planned = planned_seconds(args)
    print(
        f"{sum(cells.values())} cells {cells}, about {planned:.0f} s planned (budget {args.budget_s:.0f} s)"
    )
    if args.plan:
        return
    # SIGTERM (a timeout around the command) ends the run like Ctrl-C: Triton and the servers are
    # stopped and the JSON written, so nothing is left holding the GPU for the next command.
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    run = Run(args)
    run.result["environment"] = environment(args.device)
    print(json.dumps(run.result["environment"]), flush=True)
    run.save()
    for tool in ("wrk", "redis-server"):
        if shutil.which(tool) is None:
            run.error("environment", RuntimeError(f"{tool} is not on PATH: the HTTP cells will fail"))
    with tempfile.TemporaryDirectory(prefix="embedsite-bench-gpu-") as tmp, ExitStack() as stack:
        try:
            if args.engines:
                measure_engines_run(run, Path(tmp))
            else:
                measure_all(run, Path(tmp), stack)
        except BaseException as error:  # a KeyboardInterrupt too leaves its record
            run.error("run", error)
            if not isinstance(error, Exception):
                raise
        finally:
            stack.close()  # servers and Triton stopped, Triton's log tail taken, before the last save
            run.result["finished"] = True
            run.save()
    print(f"written {args.out} after {run.elapsed():.0f} s", flush=True)


if __name__ == "__main__":
    main()
