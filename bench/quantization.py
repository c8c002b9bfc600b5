"""Ranking quality of quantised embeddings: int8, uint8, binary and ubinary against float.

Run: `make bench-quantization` (or `.venv/bin/python bench/quantization.py [--quick]`). The bundled
MiniLM export (model_repository/minilm/1, raw ONNX Runtime in this process, tokenised by the
service's TextTokenizer) embeds the held-out texts of the calibration corpus
(embeddings/tooling/calibration/held_out.txt: never calibrated on). Each held-out text is then a
query against all the others, ranked

- by dot product of the float vectors (the reference: cosine, the vectors being unit length);
- by the integer dot product of their int8 codes, and of their uint8 codes, as a vector database
  computes it on the stored bytes (ranges from the export's calibration, at the width ranked);
- by Hamming distance of their binary and of their ubinary codes (the same bits, signed or not);
- and, for comparison, by the integer dot product of int8 codes made as sentence-transformers makes
  them (each dimension's calibrated [minimum, maximum] onto 256 codes): the scheme the service does
  not use, because its per-dimension offsets and scales bend the integer dot product.

For each type: mean recall@10 (the share of float's ten best that the type's ten best hold; ties
broken by text order) and mean Spearman rank correlation of the scores with float's, over every
query; at the model's width and at a truncated, renormalised one (`--dimensions`), as a request
with `dimensions` gets them. Prints a table and writes bench/results/quantization.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from triton_client import RawOnnxRuntime  # noqa: E402

from embeddings.services.inference.exports import model_export_info  # noqa: E402
from embeddings.services.inference.quantization import (  # noqa: E402
    OUTPUT_TYPES,
    model_calibration,
    output_bytes,
    quantized,
)
from embeddings.tokenization import TextTokenizer  # noqa: E402
from embeddings.tooling.calibration_corpus import HELD_OUT_CORPUS, read_corpus  # noqa: E402

MODEL = "minilm"
VERSION = "1"
REPOSITORY = ROOT / "model_repository"
OUT = ROOT / "bench" / "results" / "quantization.json"
BATCH = 64
QUICK_TEXTS = 100
# For comparison, not served: sentence-transformers' scheme (each dimension's [minimum, maximum] onto
# 256 codes), which the integer dot product of a search engine ranks less well.
PER_DIMENSION = "int8, per-dimension ranges (not served)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"the first {QUICK_TEXTS} held-out texts only")
    parser.add_argument("--k", type=int, default=10, help="recall@k (default: 10)")
    parser.add_argument(
        "--dimensions",
        type=lambda text: [int(part) for part in text.split(",") if part],
        default=[384, 128],
        help="widths to rank at, comma-separated (default: 384,128; below 384: truncated and renormalised)",
    )
    parser.add_argument(
        "--out", type=Path, default=OUT, help=f"JSON results (default: {OUT.relative_to(ROOT)})"
    )
    return parser.parse_args(argv)


def average_ranks(values: np.ndarray) -> np.ndarray:
    """Ranks from 1, tied values sharing the mean of the ranks they span (as Spearman's rho needs)."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    counts = np.diff(np.r_[starts, len(values)])
    group_ranks = starts + (counts + 1) / 2
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[order] = np.repeat(group_ranks, counts)
    return ranks


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation: Pearson's of the average ranks (scipy.stats.spearmanr's)."""
    ranks_a = average_ranks(np.asarray(a)) - (len(a) + 1) / 2
    ranks_b = average_ranks(np.asarray(b)) - (len(b) + 1) / 2
    denominator = np.sqrt((ranks_a @ ranks_a) * (ranks_b @ ranks_b))
    return float(ranks_a @ ranks_b / denominator) if denominator else float("nan")


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """The indices of the k highest scores, ties broken by index."""
    return np.argsort(-scores, kind="stable")[:k]


def recall_at_k(reference: np.ndarray, scores: np.ndarray, k: int) -> float:
    return len(set(top_k(reference, k).tolist()) & set(top_k(scores, k).tolist())) / k


def similarities(codes: np.ndarray, output_type: str) -> np.ndarray:
    """Every pair's score as a search engine computes it on `output_type`'s stored codes: the dot
    product (float, int8, uint8) or minus the Hamming distance (binary, ubinary)."""
    if output_type == "float":
        return codes.astype(np.float64) @ codes.T.astype(np.float64)
    if output_type in ("int8", "uint8"):
        wide = codes.astype(np.int64)
        return wide @ wide.T
    bits = np.unpackbits(codes.view(np.uint8), axis=1).astype(np.int64)
    agreements = bits @ bits.T + (1 - bits) @ (1 - bits).T
    return agreements - bits.shape[1]


def rank_agreement(reference: np.ndarray, scores: np.ndarray, k: int) -> dict[str, float]:
    """Mean recall@k and Spearman of each query's scores against the reference's, the query
    itself left out of its own ranking."""
    recalls, correlations = [], []
    for query in range(len(reference)):
        others = np.arange(len(reference)) != query
        recalls.append(recall_at_k(reference[query, others], scores[query, others], k))
        correlations.append(spearman(reference[query, others], scores[query, others]))
    return {f"recall_at_{k}": float(np.mean(recalls)), "spearman": float(np.mean(correlations))}


def measure(vectors: np.ndarray, dims: int, k: int) -> dict[str, dict]:
    """Each output type's agreement with float at width `dims` (vectors truncated and
    renormalised below the model's width, as the service does for `dimensions`)."""
    requested = dims if dims < vectors.shape[1] else None
    if requested:
        vectors = vectors[:, :dims]
        vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), np.float32(1e-12))
    calibration = model_calibration(REPOSITORY, MODEL, VERSION, dimensions=requested, normalize=True)
    reference = similarities(vectors, "float")
    results = {}
    for output_type in OUTPUT_TYPES:
        codes = quantized(vectors, output_type, calibration)
        row = {"bytes_per_vector": output_bytes(output_type, dims)}
        if output_type in ("int8", "uint8"):
            # Values outside the calibrated range, which took an end code.
            row["clipped_share"] = float((np.abs(vectors) > calibration.scale).mean())
        row.update(rank_agreement(reference, similarities(codes, output_type), k))
        results[output_type] = row
        if output_type == "int8":
            results[PER_DIMENSION] = {
                "bytes_per_vector": row["bytes_per_vector"],
                **rank_agreement(
                    reference, similarities(per_dimension_codes(vectors, calibration), "int8"), k
                ),
            }
    return results


def per_dimension_codes(vectors: np.ndarray, calibration) -> np.ndarray:
    """sentence-transformers' int8: each dimension's [minimum, maximum] onto -128..127."""
    minimum = calibration.minimum.astype(np.float64)
    step = (calibration.maximum.astype(np.float64) - minimum) / 255
    step[step == 0] = 1.0
    return np.clip(np.rint((vectors - minimum) / step - 128), -128, 127).astype(np.int8)


def table(results: dict, k: int) -> str:
    lines = [
        f"| dims | type | bytes / vector | recall@{k} vs float | Spearman vs float |",
        "| ---: | --- | ---: | ---: | ---: |",
    ]
    for dims, rows in results.items():
        for output_type, row in rows.items():
            lines.append(
                f"| {dims} | {output_type} | {row['bytes_per_vector']:,} | {row[f'recall_at_{k}']:.3f} | "
                f"{row['spearman']:.4f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    info = model_export_info(repository_dir=REPOSITORY, name=MODEL, version=VERSION)
    if "quantization" not in info:
        raise SystemExit(
            f"{MODEL} version {VERSION} was exported before calibration: `make setup` (or `manage.py "
            "export_model --if-missing --version 1`) exports it again"
        )
    version_dir = REPOSITORY / MODEL / VERSION
    raw = RawOnnxRuntime(version_dir / "model.onnx", TextTokenizer.from_file(version_dir / "tokenizer.json"))
    texts = read_corpus(HELD_OUT_CORPUS)[: QUICK_TEXTS if args.quick else None]
    vectors = np.concatenate(
        [raw.embed(texts[start : start + BATCH]) for start in range(0, len(texts), BATCH)]
    )
    results = {dims: measure(vectors, dims, args.k) for dims in args.dimensions}
    print(f"{len(texts)} held-out texts, each a query against the other {len(texts) - 1}:")
    print(table(results, args.k))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "model": f"{MODEL}/{VERSION}",
                "texts": len(texts),
                "corpus": str(HELD_OUT_CORPUS.relative_to(ROOT)),
                "k": args.k,
                "calibration": info["quantization"],
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
