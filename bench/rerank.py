"""Rerank throughput: documents ranked per second through POST /v2/rerank against raw ONNX Runtime.

Run: `make bench-rerank` (or `.venv/bin/python bench/rerank.py [--quick]`). In one run, on the same
texts: one query against 32 and against 256 documents of ~64 tokens each, ranked

1. by raw ONNX Runtime in this process on model_repository/minilm/1/model.onnx (all cores, one
   caller): the query and the documents embedded in one call (the cosines that score them take
   microseconds and are left out of the timing); what the model alone gives;
2. by embedsite as `make run` runs it (Triton, the two redis-servers, SQLite, `manage.py serve
   --workers 1`, quotas on with limits that never refuse), with the bundled MiniLM ranking by
   similarity: wrk posting the same body to /v2/rerank on 1 and on 4 connections.

Before timing, embedsite's order and scores are checked against raw ORT's (the same order, scores
within 1e-4). Prints pairs (documents) per second and latencies, writes bench/results/rerank.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
from pathlib import Path

import httpx2
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from api import REAL_MODEL, Server, shipped_stack, wrk  # noqa: E402
from peers import raw_sequential  # noqa: E402
from triton_client import RawOnnxRuntime, make_texts  # noqa: E402

from embeddings.tooling.triton_server import free_port  # noqa: E402

DOCUMENT_WORDS = 55  # ~64 tokens with this vocabulary
QUERY = "which river flows past the mountain city"
SHAPES = (32, 256)
CONNECTIONS = (1, 4)
SCORE_TOLERANCE = 1e-4


def documents_for(count: int) -> list[str]:
    return make_texts(count, DOCUMENT_WORDS, seed=64 + count)


def raw_scores(raw: RawOnnxRuntime, documents: list[str]) -> np.ndarray:
    vectors = raw.embed([QUERY, *documents]).astype(np.float64)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors[1:] @ vectors[0]


def measure_raw(raw: RawOnnxRuntime, documents: list[str], seconds: float) -> dict:
    """peers.py's one-caller loop over the query and the documents (the cosines, microseconds,
    left out), counted in documents."""
    cell = raw_sequential(raw, [QUERY, *documents], seconds)
    return {**cell, "pairs_per_s": cell["emb_per_s"] * len(documents) / (len(documents) + 1)}


def check_agreement(server: Server, key: str, raw: RawOnnxRuntime, documents: list[str]) -> float:
    """The server's ranking is raw ORT's; returns the largest score difference."""
    answer = httpx2.post(
        f"{server.url}/v2/rerank",
        json={"model": REAL_MODEL, "query": QUERY, "documents": documents},
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )
    answer.raise_for_status()
    results = answer.json()["results"]
    reference = raw_scores(raw, documents)
    served = np.array([result["relevance_score"] for result in results])
    difference = float(np.abs(served - reference[[result["index"] for result in results]]).max())
    if difference > SCORE_TOLERANCE:
        raise SystemExit(f"embedsite's scores differ from raw ORT's by {difference:.2e}")
    # Ties aside, the same order: each served score is at least the next one's.
    if not all(a >= b for a, b in itertools.pairwise(served)):
        raise SystemExit("embedsite's results are not best first")
    return difference


def table(results: dict) -> str:
    lines = [
        "| documents | raw ORT pairs/s (p50 ms) | embedsite, 1 connection | embedsite, 4 connections "
        "| best ÷ raw |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for count, cells in results.items():
        raw = cells["raw ORT"]
        served = [cells[f"embedsite, {c} connection{'s' if c > 1 else ''}"] for c in CONNECTIONS]
        best = max(cell["emb_per_s"] for cell in served)
        lines.append(
            f"| {count} | {raw['pairs_per_s']:.0f} ({raw['p50_ms']:.0f}) | "
            + " | ".join(f"{cell['emb_per_s']:.0f} ({cell['p50_ms']:.0f})" for cell in served)
            + f" | {best / raw['pairs_per_s']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20, help="each cell's duration")
    parser.add_argument("--quick", action="store_true", help="3-second cells")
    args = parser.parse_args()
    seconds = 3 if args.quick else args.seconds

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "embedsite.settings")
    import django

    django.setup()
    from embeddings.tokenization import TextTokenizer

    model_dir = ROOT / "model_repository" / "minilm" / "1"
    raw = RawOnnxRuntime(model_dir / "model.onnx", TextTokenizer.from_file(model_dir / "tokenizer.json"))
    results: dict = {}
    for count in SHAPES:
        results[count] = {"raw ORT": measure_raw(raw, documents_for(count), seconds)}
        pairs_per_s = results[count]["raw ORT"]["pairs_per_s"]
        print(f"raw ORT, {count} documents: {pairs_per_s:.0f} pairs/s", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-rerank-") as scratch:
        workdir = Path(scratch)
        with shipped_stack(workdir) as (env, key, _triton), (workdir / "server.log").open("wb") as log:
            server = Server(env, free_port(), output=log)
            try:
                for count in SHAPES:
                    documents = documents_for(count)
                    difference = check_agreement(server, key, raw, documents)
                    results[count]["largest score difference"] = difference
                    body = {"model": REAL_MODEL, "query": QUERY, "documents": documents}
                    for connections in CONNECTIONS:
                        name = f"embedsite, {connections} connection{'s' if connections > 1 else ''}"
                        cell = wrk(
                            server, key, body, seconds, connections, workdir, path="/v2/rerank", rows=count
                        )
                        if cell["errors"]:
                            raise SystemExit(f"{name}, {count} documents: {cell['errors']} errors")
                        results[count][name] = cell
                        print(f"{name}, {count} documents: {cell['emb_per_s']:.0f} pairs/s", flush=True)
            finally:
                server.stop()
    print(table(results))
    out = ROOT / "bench" / "results" / "rerank.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"seconds": seconds, "results": results}, indent=2))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
