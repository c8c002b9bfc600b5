"""Which worker process of a live server answered requests: each worker's own metrics file, read as
/metrics reads them (prometheus_client's multiprocess files, one per pid, in PROMETHEUS_MULTIPROC_DIR)."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.multiprocess import MultiProcessCollector

REQUESTS_TOTAL = "embedsite_requests_total"


def requests_answered_by_worker(prometheus_dir: Path) -> dict[str, float]:
    """pid -> API requests that worker process has answered (every endpoint and status), from the
    counter file it alone writes."""
    answered: dict[str, float] = {}
    for path in prometheus_dir.glob("counter_*.db"):
        pid = path.stem.rsplit("_", 1)[1]
        samples = [
            sample
            for metric in MultiProcessCollector.merge([str(path)])
            for sample in metric.samples
            if sample.name == REQUESTS_TOTAL
        ]
        answered[pid] = sum(sample.value for sample in samples)
    return answered


def answered_since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """pid -> requests answered between two readings, for the workers that answered any."""
    gained = {pid: count - before.get(pid, 0.0) for pid, count in after.items()}
    return {pid: count for pid, count in gained.items() if count}
