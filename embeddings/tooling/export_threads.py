"""How many cores an export's own computing takes: EXPORT_THREADS.

An export runs PyTorch (tracing, the check against it) and ONNX Runtime (the check, the calibration
corpus, a variant's agreement) on this machine's CPU. Unset or 0: each library's default, every
core. An export often runs on a host that is serving (README "Serving your own model"); a number
caps what it takes from the web processes and Triton. The test processes set 1: beside the other
pytest workers on two cores, threads that wait for each other's share of a batch cost more CPU than
they save (tests/model_export and the torch backend's tests: 142 CPU-s instead of 169).
"""

from __future__ import annotations

import os
from pathlib import Path

from embeddings.services.inference.exports import ModelExportError

EXPORT_THREADS_VARIABLE = "EXPORT_THREADS"


def export_threads() -> int:
    """EXPORT_THREADS as a number of threads; 0 for the libraries' own default."""
    raw = os.environ.get(EXPORT_THREADS_VARIABLE, "").strip() or "0"
    try:
        threads = int(raw)
    except ValueError:
        threads = -1
    if threads < 0:
        raise ModelExportError(
            f"{EXPORT_THREADS_VARIABLE} must be a whole number of threads (0: all cores), not {raw!r}"
        )
    return threads


def cpu_session(model_path: Path):
    """An ONNX Runtime session of `model_path` on the CPU, on EXPORT_THREADS threads."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = export_threads()
    return onnxruntime.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])


def limit_torch_threads(torch) -> None:
    """PyTorch's intra-op threads for this process at EXPORT_THREADS, when it names a number."""
    threads = export_threads()
    if threads and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
