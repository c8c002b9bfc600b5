"""A one-minute check of the lent GPU machine before the benchmark: the image's CUDA and torch from
this virtualenv, the bundled Triton serving a tiny export through embedsite_torch on KIND_GPU (its
vectors against ONNX Runtime's, computed where it was packed), and redis-server and wrk running.

Run (on the device, after bench/device/setup.sh and `source .gpu/env.sh`):
    python bench/device/probe.py .gpu/carry1/probe
Made where it is packed by `python bench/device/probe.py --make DIR`.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

TEXT_IDS = [[101, 7592, 2088, 102], [101, 1996, 4248, 2829, 4419, 14523, 2058, 1996, 13971, 3899, 1012, 102]]


def padded(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    width = max(map(len, rows))
    ids = np.zeros((len(rows), width), dtype=np.int64)
    for index, row in enumerate(rows):
        ids[index, : len(row)] = row
    return ids, (ids != 0).astype(np.int64)


def make(directory: Path) -> None:
    """A tiny random BERT exported as minilm's are, and ONNX Runtime's vectors for TEXT_IDS."""
    import onnxruntime

    from embeddings.tooling.model_export import model_export
    from tests.tiny_models import build_tiny_bert

    with tempfile.TemporaryDirectory() as scratch:
        source = build_tiny_bert(Path(scratch) / "source", hidden_size=32, layers=2, heads=2, seed=7)
        result = model_export(
            source_dir=source, repository_dir=directory / "repository", name="tiny", pooling="mean"
        )
    session = onnxruntime.InferenceSession(str(result.model_path), providers=["CPUExecutionProvider"])
    ids, mask = padded(TEXT_IDS)
    (vectors,) = session.run(["embedding"], {"input_ids": ids, "attention_mask": mask})
    np.save(directory / "reference.npy", vectors)


def probe(directory: Path) -> int:
    import torch

    from embeddings.tooling.triton_server import TritonServer, free_port
    from embeddings.triton.client import AsyncTritonClient

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    print("python", sys.version.split()[0], "numpy", np.__version__, "torch", torch.__version__, gpu)
    for command in (["nvidia-smi", "-L"], ["redis-server", "--version"], ["wrk", "--version"]):
        done = subprocess.run(command, capture_output=True, text=True)
        print(" ".join(command), "->", done.returncode, (done.stdout + done.stderr).strip().splitlines()[:1])
    run_dir = Path(tempfile.mkdtemp(prefix="probe-triton-"))
    server = TritonServer(
        model_repositories=[directory / "repository"],
        run_dir=run_dir,
        grpc_port=free_port(),
        http_port=free_port(),
        metrics_port=free_port(),
        model_config_name="bundled-gpu",
        log_path=run_dir / "triton.log",
    )
    server.start()
    try:
        server.wait_until_ready(240)

        async def infer() -> np.ndarray:
            async with AsyncTritonClient(server.grpc_target) as client:
                return await client.embed_tokens("tiny", *padded(TEXT_IDS))

        vectors = asyncio.run(infer())
        reference = np.load(directory / "reference.npy")
        cosines = (vectors * reference).sum(axis=1) / (
            np.linalg.norm(vectors, axis=1) * np.linalg.norm(reference, axis=1)
        )
        print("triton embedsite_torch on GPU: min cosine vs ONNX Runtime", float(cosines.min()))
        print("\n".join(line for line in server.log_tail(400).splitlines() if "embedsite_torch" in line))
        return 0 if cosines.min() >= 0.999 else 1
    except Exception as error:
        print("PROBE FAILED:", repr(error))
        print(server.log_tail(60))
        return 2
    finally:
        server.stop()


if __name__ == "__main__":
    if sys.argv[1] == "--make":
        make(Path(sys.argv[2]))
    else:
        sys.exit(probe(Path(sys.argv[1])))
