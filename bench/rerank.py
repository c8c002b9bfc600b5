"""Rerank throughput: documents ranked per second through POST /v2/rerank against raw ONNX Runtime.

Run: `make bench-rerank` (or `.venv/bin/python bench/rerank.py [--quick] [--rankers ...]`). In one
run, on the same texts: one query against 32 and against 256 documents of ~64 tokens each, ranked
by each of two rankers,

- `similarity`: the bundled MiniLM ranking by cosine similarity (the query and the documents
  embedded in one call; the cosines take microseconds and are left out of raw ORT's timing);
- `cross-encoder`: a cross-encoder of cross-encoder/ms-marco-MiniLM-L6-v2's shape (BERT, 6 layers,
  384 wide, 12 heads, 512 positions, MiniLM's vocabulary), built here with random weights (nothing
  can be downloaded from model hubs; its cost per pair is the real model's), exported with
  `export_model --task rerank` and registered; each (query, document) pair is one row,

1. by raw ONNX Runtime in this process on the export's model.onnx (all cores, one caller, every
   pair or text in one call, tokenised by the service's tokenizer): what the model alone gives;
2. by embedsite as `make run` runs it (Triton, the two redis-servers, SQLite, `manage.py serve
   --workers 1`, quotas on with limits that never refuse): wrk posting the same body to
   /v2/rerank on 1 and on 4 connections.

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

RANKERS = ("similarity", "cross-encoder")
CROSS_ENCODER = "ms-marco-shaped-reranker"
CROSS_ENCODER_TRITON = "ms_marco_shaped"

DOCUMENT_WORDS = 55  # ~64 tokens with this vocabulary
QUERY = "which river flows past the mountain city"
SHAPES = (32, 256)
CONNECTIONS = (1, 4)
SCORE_TOLERANCE = 1e-4


def documents_for(count: int) -> list[str]:
    return make_texts(count, DOCUMENT_WORDS, seed=64 + count)


class RawCrossEncoder:
    """A cross-encoder export run by raw ORT: `embed([query, *documents])` scores every pair in one
    call (the shape peers.py's loop times), as the service pairs them; sigmoid scores."""

    def __init__(self, version_dir: Path, tokenizer) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = os.cpu_count() or 1
        self.session = ort.InferenceSession(
            str(version_dir / "model.onnx"), options, providers=["CPUExecutionProvider"]
        )
        self.inputs = json.loads((version_dir / "export.json").read_text())["inputs"]
        self.tokenizer = tokenizer

    def embed(self, texts: list[str]) -> np.ndarray:
        batch = self.tokenizer.encode_pairs(texts[0], texts[1:])
        arrays = {
            "input_ids": batch.input_ids,
            "attention_mask": batch.attention_mask,
            "token_type_ids": batch.token_type_ids,
        }
        logits = self.session.run(None, {name: arrays[name] for name in self.inputs})[0][:, 0]
        return 1 / (1 + np.exp(-logits.astype(np.float64)))


def raw_scores(raw, documents: list[str]) -> np.ndarray:
    if isinstance(raw, RawCrossEncoder):
        return raw.embed([QUERY, *documents])
    vectors = raw.embed([QUERY, *documents]).astype(np.float64)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors[1:] @ vectors[0]


def measure_raw(raw, documents: list[str], seconds: float) -> dict:
    """peers.py's one-caller loop over the query and the documents (a similarity's cosines,
    microseconds, left out), counted in documents (pairs)."""
    cell = raw_sequential(raw, [QUERY, *documents], seconds)
    return {**cell, "pairs_per_s": cell["emb_per_s"] * len(documents) / (len(documents) + 1)}


def cross_encoder_repository(workdir: Path) -> Path:
    """A model repository with the bundled MiniLM and the ms-marco-shaped cross-encoder exported
    beside it (export_model --task rerank, as an operator would)."""
    from tests.tiny_models import build_tiny_bert

    repository = workdir / "repository"
    repository.mkdir()
    (repository / "minilm").symlink_to(ROOT / "model_repository" / "minilm")
    source = build_tiny_bert(
        workdir / "cross-encoder-source", seed=0, hidden_size=384, layers=6, heads=12, max_tokens=512,
        cross_encoder=True, initializer_range=0.02,
    )  # fmt: skip
    import subprocess

    subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "export_model", "--source", str(source), "--repository",
         str(repository), "--name", CROSS_ENCODER_TRITON, "--task", "rerank"],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return repository


def check_agreement(server: Server, key: str, model: str, raw, documents: list[str]) -> float:
    """The server's ranking is raw ORT's; returns the largest score difference."""
    answer = httpx2.post(
        f"{server.url}/v2/rerank",
        json={"model": model, "query": QUERY, "documents": documents},
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
        "| ranker | documents | raw ORT pairs/s (p50 ms) | embedsite, 1 connection "
        "| embedsite, 4 connections | best ÷ raw |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for ranker, shapes in results.items():
        for count, cells in shapes.items():
            raw = cells["raw ORT"]
            served = [cells[f"embedsite, {c} connection{'s' if c > 1 else ''}"] for c in CONNECTIONS]
            best = max(cell["emb_per_s"] for cell in served)
            lines.append(
                f"| {ranker} | {count} | {raw['pairs_per_s']:.0f} ({raw['p50_ms']:.0f}) | "
                + " | ".join(f"{cell['emb_per_s']:.0f} ({cell['p50_ms']:.0f})" for cell in served)
                + f" | {best / raw['pairs_per_s']:.2f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20, help="each cell's duration")
    parser.add_argument("--quick", action="store_true", help="3-second cells")
    parser.add_argument(
        "--rankers",
        default=",".join(RANKERS),
        help=f"comma-separated, of {', '.join(RANKERS)} (default: both)",
    )
    args = parser.parse_args()
    seconds = 3 if args.quick else args.seconds
    rankers = [ranker for ranker in args.rankers.split(",") if ranker]
    if not rankers or set(rankers) - set(RANKERS):
        parser.error(f"--rankers takes {', '.join(RANKERS)}")

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "embedsite.settings")
    import django

    django.setup()
    from embeddings.tokenization import TextTokenizer

    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-rerank-") as scratch:
        workdir = Path(scratch)
        repository = cross_encoder_repository(workdir) if "cross-encoder" in rankers else None
        served_models, raws = {}, {}
        for ranker in rankers:
            if ranker == "similarity":
                model_dir = ROOT / "model_repository" / "minilm" / "1"
                tokenizer = TextTokenizer.from_file(model_dir / "tokenizer.json")
                raws[ranker] = RawOnnxRuntime(model_dir / "model.onnx", tokenizer)
                served_models[ranker] = REAL_MODEL
            else:
                version_dir = repository / CROSS_ENCODER_TRITON / "1"
                tokenizer = TextTokenizer.from_file(version_dir / "tokenizer.json")
                raws[ranker] = RawCrossEncoder(version_dir, tokenizer)
                served_models[ranker] = CROSS_ENCODER
            results[ranker] = {}
            for count in SHAPES:
                results[ranker][count] = {"raw ORT": measure_raw(raws[ranker], documents_for(count), seconds)}
                pairs_per_s = results[ranker][count]["raw ORT"]["pairs_per_s"]
                print(f"{ranker}, raw ORT, {count} documents: {pairs_per_s:.0f} pairs/s", flush=True)
        with (
            shipped_stack(workdir, repository) as (env, key, _triton),
            (workdir / "server.log").open("wb") as log,
        ):
            if repository is not None:
                import subprocess

                subprocess.run(
                    [sys.executable, str(ROOT / "manage.py"), "register_model", "--triton-model",
                     CROSS_ENCODER_TRITON, "--name", CROSS_ENCODER],
                    env=env, check=True, stdout=subprocess.DEVNULL,
                )  # fmt: skip
            server = Server(env, free_port(), output=log)
            try:
                for ranker in rankers:
                    for count in SHAPES:
                        cells = results[ranker][count]
                        documents = documents_for(count)
                        model = served_models[ranker]
                        cells["largest score difference"] = check_agreement(
                            server, key, model, raws[ranker], documents
                        )
                        body = {"model": model, "query": QUERY, "documents": documents}
                        for connections in CONNECTIONS:
                            name = f"embedsite, {connections} connection{'s' if connections > 1 else ''}"
                            cell = wrk(
                                server,
                                key,
                                body,
                                seconds,
                                connections,
                                workdir,
                                path="/v2/rerank",
                                rows=count,
                            )
                            if cell["errors"]:
                                raise SystemExit(
                                    f"{ranker}, {name}, {count} documents: {cell['errors']} errors"
                                )
                            cells[name] = cell
                            print(
                                f"{ranker}, {name}, {count} documents: {cell['emb_per_s']:.0f} pairs/s",
                                flush=True,
                            )
            finally:
                server.stop()
    print(table(results))
    out = ROOT / "bench" / "results" / "rerank.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"seconds": seconds, "results": results}, indent=2))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
