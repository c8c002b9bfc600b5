"""Triton's own view of a benchmark cell: its model statistics read before and after, as a delta.

Apart from bench/configs.py so that bench/gpu.py reads them on a GPU machine that has only the
service's packages (configs.py imports the peer benchmark, which needs httpx2).
"""

from __future__ import annotations

import json
import urllib.request

TRITON_MODEL = "minilm"


def triton_counts(http_url: str) -> dict[str, float]:
    """Cumulative counters of the model's statistics: requests, executions, rows, times (ns)."""
    with urllib.request.urlopen(f"{http_url}/v2/models/{TRITON_MODEL}/stats", timeout=10) as reply:
        stats = json.load(reply)["model_stats"]
    inference = [entry["inference_stats"] for entry in stats]
    return {
        "requests": sum(float(s["success"]["count"]) for s in inference),
        "executions": sum(float(entry["execution_count"]) for entry in stats),
        "rows": sum(float(entry["inference_count"]) for entry in stats),
        "queue_ns": sum(float(s["queue"]["ns"]) for s in inference),
        "compute_infer_ns": sum(float(s["compute_infer"]["ns"]) for s in inference),
    }


def triton_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    delta = {name: after[name] - before[name] for name in before}
    executions = max(delta["executions"], 1.0)
    requests = max(delta["requests"], 1.0)
    return {
        "triton_requests": delta["requests"],
        "triton_executions": delta["executions"],
        "rows_per_execution": delta["rows"] / executions,
        "queue_ms_per_request": delta["queue_ns"] / requests / 1e6,
        # compute_infer is counted per request: a merged execution adds its time once per request
        # it served, so divide by requests to get one execution's time.
        "compute_infer_ms_per_execution": delta["compute_infer_ns"] / requests / 1e6,
    }
