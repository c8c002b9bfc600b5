"""int8 against float32 MiniLM as served: through Triton (the project's client) and the HTTP service.

Run: `make bench-int8-serve` (or `.venv/bin/python bench/int8_serve.py [--seconds S] [--rounds N]`).
Exports MiniLM's int8 graph as an operator would (`export_model --dtype int8`, into a copy of the
model repository in a temporary folder: version 1 is the checkout's float32 export, linked; the
int8 export lands beside it as version 2), starts the stack as `make run` runs it (Triton with
explicit model control, the two redis-servers, SQLite, `manage.py serve --workers 1`, quotas on
with limits that never refuse) and registers version 2 under a second catalog name
(`register_model --dtype int8`), so Triton serves both versions side by side. Then, for the peer
benchmark's shapes (clients x texts a request: 32 x 1, 16 x 8, 16 x 32 of ~10 tokens, 16 x 8 of
~128) and 2 x 32 texts of 256 tokens (bench/int8.py's long texts), each dtype is timed

1. through Triton: bench/triton_client.py's `run_client` (AsyncTritonClient, tokenised here), the
   callers naming version 1 or 2;
2. through HTTP: wrk posting the same body to /v1/embeddings (base64) naming either catalog model;

float32 and int8 alternating cell by cell (A B, then B A the next round) so a drift of the
machine's load falls on both. Each cell records the cores other processes took meanwhile (the
machine is shared). Prints a table with the agreement export.json records and the cosine of the
served vectors, and writes bench/results/int8_serve.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import statistics
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

from api import REAL_MODEL, Server, shipped_stack  # noqa: E402
from gpu import machine_busy_seconds, process_tree_cpu_seconds  # noqa: E402
from peers import LONG_CELL_FACTOR, SHAPES, wrk_shape  # noqa: E402
from peers import Shape as PeerShape  # noqa: E402
from triton_client import make_texts, run_client, tokenizer_use  # noqa: E402

from embeddings.tooling.triton_server import free_port  # noqa: E402

INT8_MODEL = "all-MiniLM-L6-v2-int8"
DTYPES = ("float32", "int8")
VERSIONS = {"float32": "1", "int8": "2"}
MODELS = {"float32": REAL_MODEL, "int8": INT8_MODEL}
# bench/int8.py's batch: 32 texts that reach MiniLM's 256 tokens.
LONG_256 = PeerShape("2 x 32, 256 tokens", 2, 32, 240)  # wrk needs a connection a thread
OUT = ROOT / "bench" / "results" / "int8_serve.json"


@dataclass(frozen=True)
class Cell:
    shape: PeerShape
    path: str  # "triton" or "http"
    dtype: str


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seconds", type=float, default=4, help="each short-text cell's duration (default: 4)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="cells of each kind (default: 2)")
    parser.add_argument(
        "--out", type=Path, default=OUT, help=f"JSON results (default: {OUT.relative_to(ROOT)})"
    )
    return parser.parse_args(argv)


def shapes() -> tuple[PeerShape, ...]:
    return (*SHAPES, LONG_256)


def seconds_for(shape: PeerShape, seconds: float) -> float:
    """Long texts take ~10x as long a text: give them longer, or a cell ends before its first answers."""
    return seconds if shape.words < 100 else seconds * LONG_CELL_FACTOR


def texts_for(shape: PeerShape) -> list[str]:
    return make_texts(shape.texts_per_request, shape.words, seed=11 + shape.words)


def int8_repository(workdir: Path) -> Path:
    """A model repository holding the checkout's minilm version 1 (model.onnx linked, the rest
    copied: nothing written here reaches the checkout) and its int8 export as version 2."""
    checkout = ROOT / "model_repository"
    repository = workdir / "repository"
    minilm = repository / "minilm"
    (minilm / "1").mkdir(parents=True)
    shutil.copy2(checkout / "minilm" / "config.pbtxt", minilm / "config.pbtxt")
    shutil.copytree(checkout / "minilm" / "configs", minilm / "configs")
    for file in (checkout / "minilm" / "1").iterdir():
        if file.name == "model.onnx":
            (minilm / "1" / file.name).symlink_to(file)
        elif file.is_file():
            shutil.copy2(file, minilm / "1" / file.name)
    for other in ("minilm_text", "minilm_tokenizer"):
        (repository / other).symlink_to(checkout / other)
    print("Exporting minilm's int8 graph as version 2 (export_model --dtype int8) ...", flush=True)
    subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "export_model", "--repository", str(repository),
         "--name", "minilm", "--dtype", "int8"],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return repository


def other_load_cores(machine_before: float, bench_before: float, started: float) -> float:
    """Cores busy with anything but this bench and what it started, since `started`."""
    machine = machine_busy_seconds() - machine_before
    bench = process_tree_cpu_seconds(os.getpid()) - bench_before
    return max(machine - bench, 0.0) / (time.monotonic() - started)


async def measure_triton(client, cell: Cell, seconds: float) -> dict:
    shape = cell.shape
    texts = texts_for(shape) * 64  # callers take different slices of the same texts
    return await run_client(
        client,
        texts,
        shape.texts_per_request,
        seconds,
        10**9,
        shape.clients,
        version=VERSIONS[cell.dtype],
    )


def measure_http(server: Server, key: str, cell: Cell, seconds: float, workdir: Path) -> dict:
    body = {"model": MODELS[cell.dtype], "input": texts_for(cell.shape), "encoding_format": "base64"}
    headers = {"Authorization": f"Bearer {key}"}
    # wrk_shape lengthens peers' long shape itself; this bench's cells are sized here.
    shape = PeerShape(cell.shape.name, cell.shape.clients, cell.shape.texts_per_request, 0)
    return wrk_shape(f"{server.url}/v1/embeddings", body, headers, shape, seconds, workdir)


def served_cosines(server: Server, key: str) -> dict[str, float]:
    """The two catalog models' vectors of the same texts through the API: min and mean cosine."""
    texts = [*texts_for(SHAPES[2]), *texts_for(LONG_256)]
    vectors = {}
    for dtype, model in MODELS.items():
        response = httpx2.post(
            f"{server.url}/v1/embeddings",
            json={"model": model, "input": texts},
            headers={"Authorization": f"Bearer {key}"},
            timeout=300,
        )
        response.raise_for_status()
        vectors[dtype] = np.array([row["embedding"] for row in response.json()["data"]], dtype=np.float64)
    cosines = (vectors["float32"] * vectors["int8"]).sum(axis=1) / (
        np.linalg.norm(vectors["float32"], axis=1) * np.linalg.norm(vectors["int8"], axis=1)
    )
    return {"texts": len(texts), "min_cosine": float(cosines.min()), "mean_cosine": float(cosines.mean())}


def summary(cells: list[dict]) -> list[dict]:
    """Per shape and path: each dtype's median emb/s over its cells, and int8 / float32."""
    rows = []
    for shape in shapes():
        for path in ("triton", "http"):
            picked = [c for c in cells if c["shape"] == shape.name and c["path"] == path]
            if not picked:
                continue
            median = {
                dtype: statistics.median(c["emb_per_s"] for c in picked if c["dtype"] == dtype)
                for dtype in DTYPES
            }
            p50 = {
                dtype: statistics.median(c["p50_ms"] for c in picked if c["dtype"] == dtype)
                for dtype in DTYPES
            }
            rows.append(
                {
                    "shape": shape.name,
                    "path": path,
                    "emb_per_s": median,
                    "p50_ms": p50,
                    "speedup": median["int8"] / median["float32"],
                    "other_load_cores": statistics.mean(c["other_load_cores"] for c in picked),
                }
            )
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| clients x texts | through | float32 emb/s (p50 ms) | int8 emb/s (p50 ms) | int8 / float32 "
        "| other load, cores |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        rate, p50 = row["emb_per_s"], row["p50_ms"]
        lines.append(
            f"| {row['shape']} | {row['path']} | {rate['float32']:.0f} ({p50['float32']:.0f}) | "
            f"{rate['int8']:.0f} ({p50['int8']:.0f}) | {row['speedup']:.2f}x | "
            f"{row['other_load_cores']:.2f} |"
        )
    return "\n".join(lines)


async def run_cells(args, repository: Path, workdir: Path) -> dict:
    from embeddings.tokenization import TextTokenizer
    from embeddings.triton.client import AsyncTritonClient

    tokenizer_use(TextTokenizer.from_file(repository / "minilm" / "1" / "tokenizer.json"))
    cells: list[dict] = []
    with (
        shipped_stack(workdir, repository, model_control_mode="explicit") as (env, key, triton),
        (workdir / "server.log").open("wb") as log,
    ):
        manage = [sys.executable, str(ROOT / "manage.py")]
        # The bundled name stays on version 1; a second name serves the int8 export, and the
        # register loads both versions into Triton.
        subprocess.run([*manage, "reconcile_models"], env=env, check=True, stdout=subprocess.DEVNULL)
        subprocess.run(
            [*manage, "register_model", "--triton-model", "minilm", "--name", INT8_MODEL, "--dtype", "int8"],
            env=env, check=True,
        )  # fmt: skip
        server = Server(env, free_port(), output=log)
        client = AsyncTritonClient(triton.grpc_target, channels=4, timeout_s=300)
        try:
            served = served_cosines(server, key)
            print(f"served vectors, int8 vs float32: {served}", flush=True)
            for round_index in range(args.rounds):
                order = DTYPES if round_index % 2 == 0 else DTYPES[::-1]
                for shape in shapes():
                    seconds = seconds_for(shape, args.seconds)
                    for path in ("triton", "http"):
                        for dtype in order:
                            cell = Cell(shape, path, dtype)
                            machine, bench, started = (
                                machine_busy_seconds(),
                                process_tree_cpu_seconds(os.getpid()),
                                time.monotonic(),
                            )
                            if path == "triton":
                                result = await measure_triton(client, cell, seconds)
                            else:
                                result = measure_http(server, key, cell, seconds, workdir)
                            result = {
                                "shape": shape.name,
                                "path": path,
                                "dtype": dtype,
                                "round": round_index,
                                "emb_per_s": result["emb_per_s"],
                                "p50_ms": result["p50_ms"],
                                "errors": result.get("errors", 0),
                                "other_load_cores": other_load_cores(machine, bench, started),
                                "load_average": os.getloadavg()[0],
                            }
                            if result["errors"]:
                                raise SystemExit(f"{shape.name}, {path}, {dtype}: {result['errors']} errors")
                            cells.append(result)
                            print(
                                f"round {round_index} {shape.name:20} {path:6} {dtype:7} "
                                f"{result['emb_per_s']:7.0f} emb/s  p50 {result['p50_ms']:6.0f} ms  "
                                f"other load {result['other_load_cores']:.2f} cores",
                                flush=True,
                            )
        finally:
            await client.close()
            server.stop()
    return {"served_cosines": served, "cells": cells}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not (ROOT / "model_repository" / "minilm" / "1" / "model.onnx").is_file():
        print("model_repository/minilm/1/model.onnx is missing: run `make setup` first", file=sys.stderr)
        return 1
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "embedsite.settings")
    import django

    django.setup()
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # one line a probe otherwise
    uptime_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="bench-int8-serve-") as scratch:
        workdir = Path(scratch)
        repository = int8_repository(workdir)
        export = json.loads((repository / "minilm" / "2" / "export.json").read_text())
        measured = asyncio.run(run_cells(args, repository, workdir))
    rows = summary(measured["cells"])
    agreement = {key: export["int8"][key] for key in ("min_cosine", "mean_cosine", "recall_at_10")}
    results = {
        "seconds": args.seconds,
        "rounds": args.rounds,
        "uptime_before": uptime_before,
        "uptime_after": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
        "export_agreement": agreement,
        **measured,
        "summary": rows,
    }
    print(f"\nexport.json's agreement (held-out texts): {agreement}")
    print(f"served vectors of the bench's texts: {measured['served_cosines']}")
    print(f"uptime before: {uptime_before}\nuptime after:  {results['uptime_after']}\n")
    print(table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(f"\nWrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
