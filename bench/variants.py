"""Speed of MiniLM's int8 or float16 graph against float32 on long texts, raw ONNX Runtime on this
machine's CPU.

Run: `make bench-int8` or `make bench-float16` (or `.venv/bin/python bench/variants.py [--dtype
int8|float16] [--rounds N] [--threads 1,2]`). Converts a copy of the bundled export
(model_repository/minilm/1/model.onnx) as `export_model --dtype` does
(embeddings/tooling/model_variants.py, which also measures its agreement with float32 on the
held-out texts), then times one batch of long texts (each made of held-out sentences, truncated at
256 tokens) through both graphs, alternating them round by round so load from elsewhere falls on
both alike. Prints a table and writes bench/results/<dtype>.json. Issue 36's aim: int8 at least
1.5x float32 on long texts at min cosine 0.99 or more. float16 is for GPUs: on a CPU, ONNX Runtime
computes most of it in float32 between casts, so this times what it costs here, not its point.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from embeddings.tooling.calibration_corpus import HELD_OUT_CORPUS, read_corpus  # noqa: E402
from embeddings.tooling.model_variants import VARIANT_DTYPES, variant_replace  # noqa: E402

VERSION_DIR = ROOT / "model_repository" / "minilm" / "1"
RESULTS = ROOT / "bench" / "results"
# Held-out sentences joined into one text: 14 of them reach MiniLM's 256 tokens (most are cut there).
SENTENCES_PER_TEXT = 14


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dtype",
        choices=VARIANT_DTYPES,
        default="int8",
        help="the graph timed against float32 (default: int8)",
    )
    parser.add_argument("--texts", type=int, default=32, help="texts in the batch (default: 32)")
    parser.add_argument("--rounds", type=int, default=6, help="timed runs of each graph (default: 6)")
    parser.add_argument(
        "--threads",
        type=lambda text: [int(part) for part in text.split(",") if part],
        default=[1, 2],
        help="ONNX Runtime intra-op threads to time with, comma-separated (default: 1,2)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"JSON results (default: {RESULTS.relative_to(ROOT)}/<dtype>.json)",
    )
    args = parser.parse_args(argv)
    args.out = args.out or RESULTS / f"{args.dtype}.json"
    return args


def long_batch(tokenizer, count: int) -> dict[str, np.ndarray]:
    held_out = read_corpus(HELD_OUT_CORPUS)
    texts = [
        " ".join(held_out[index * SENTENCES_PER_TEXT : (index + 1) * SENTENCES_PER_TEXT])
        for index in range(count)
    ]
    encodings = tokenizer.encode_batch(texts)
    return {
        "input_ids": np.array([encoding.ids for encoding in encodings], dtype=np.int64),
        "attention_mask": np.array([encoding.attention_mask for encoding in encodings], dtype=np.int64),
    }


def timed(sessions: dict, feeds: dict[str, np.ndarray], rounds: int) -> dict[str, list[float]]:
    """Seconds per run of each session, the sessions alternating within each round."""
    for session in sessions.values():
        session.run(None, feeds)  # first run: allocations, not the steady state
    seconds: dict[str, list[float]] = {name: [] for name in sessions}
    for _ in range(rounds):
        for name, session in sessions.items():
            started = time.perf_counter()
            session.run(None, feeds)
            seconds[name].append(time.perf_counter() - started)
    return seconds


def main(argv: list[str] | None = None) -> int:
    import onnxruntime
    from tokenizers import Tokenizer

    args = parse_args(argv)
    if not (VERSION_DIR / "model.onnx").is_file():
        print(f"{VERSION_DIR / 'model.onnx'} is missing: run `make setup` first", file=sys.stderr)
        return 1
    tokenizer = Tokenizer.from_file(str(VERSION_DIR / "tokenizer.json"))  # truncates and pads as served
    dtype = args.dtype
    with tempfile.TemporaryDirectory(prefix=f"bench-{dtype}-") as scratch:
        variant_path = Path(scratch) / "model.onnx"
        shutil.copyfile(VERSION_DIR / "model.onnx", variant_path)
        print(
            f"Converting a copy of minilm version 1 to {dtype}, measuring it on the held-out texts ...",
            flush=True,
        )
        agreement = variant_replace(
            model_path=variant_path, tokenizer=tokenizer, dtype=dtype, min_cosine=1e-9
        )
        feeds = long_batch(tokenizer, args.texts)
        results = {
            "dtype": dtype,
            "batch": list(feeds["input_ids"].shape),
            "min_real_tokens": int(feeds["attention_mask"].sum(axis=1).min()),
            "agreement": {key: agreement[key] for key in ("min_cosine", "mean_cosine", "recall_at_10")},
            "onnxruntime": onnxruntime.__version__,
            "timings": [],
        }
        for threads in args.threads:
            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
            sessions = {
                name: onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
                for name, path in (("float32", VERSION_DIR / "model.onnx"), (dtype, variant_path))
            }
            seconds = timed(sessions, feeds, args.rounds)
            best = {name: min(values) for name, values in seconds.items()}
            median = {name: float(np.median(values)) for name, values in seconds.items()}
            results["timings"].append(
                {
                    "threads": threads,
                    "best_seconds": best,
                    "median_seconds": median,
                    "speedup_best": best["float32"] / best[dtype],
                    "speedup_median": median["float32"] / median[dtype],
                }
            )
    rows, tokens = results["batch"]
    measured = results["agreement"]
    print(
        f"\n{dtype} vs float32 on {HELD_OUT_CORPUS.name}: min cosine {measured['min_cosine']:.7f}, "
        f"mean {measured['mean_cosine']:.7f}, recall@10 {measured['recall_at_10']:.4f}"
    )
    print(f"batch {rows} x {tokens} tokens (shortest text {results['min_real_tokens']} real tokens)\n")
    print(f"| threads | float32 s (best / median) | {dtype} s (best / median) | speed-up (best / median) |")
    print("|---|---|---|---|")
    for timing in results["timings"]:
        best, median = timing["best_seconds"], timing["median_seconds"]
        print(
            f"| {timing['threads']} | {best['float32']:.3f} / {median['float32']:.3f} | "
            f"{best[dtype]:.3f} / {median[dtype]:.3f} | "
            f"{timing['speedup_best']:.2f}x / {timing['speedup_median']:.2f}x |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(f"\nWrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
