"""The embedding cache's keys and its in-process LRU (embeddings/services/inference/vector_cache.py)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
from prometheus_client import REGISTRY

from embeddings.services.inference.vector_cache import (
    LocalVectors,
    ServedModel,
    served_model,
    vector_cache_clear_local,
)

IDS = np.array([101, 7592, 2088, 102], dtype=np.int64)


def test_a_key_changes_with_everything_that_determines_the_vector():
    served = ServedModel("minilm", "1", "a" * 64)
    key = served.row_key("tenant:1", IDS)
    assert key == ServedModel("minilm", "1", "a" * 64).row_key("tenant:1", IDS.astype(np.int32))
    others = {
        ServedModel("minilm", "2", "a" * 64).row_key("tenant:1", IDS),  # another version
        ServedModel("minilm", "1", "b" * 64).row_key("tenant:1", IDS),  # another export
        ServedModel("other", "1", "a" * 64).row_key("tenant:1", IDS),  # another model
        served.row_key("tenant:2", IDS),  # another tenant
        served.row_key("tenant:1", IDS[:-1]),  # other ids (truncated, another prompt)
        served.row_key("tenant:1", IDS[::-1]),
    }
    assert key not in others and len(others) == 6


def test_the_served_model_is_the_exports_version_and_checksum(settings, tmp_path):
    source = Path(settings.TRITON_MODEL_REPOSITORY) / "minilm" / "1"
    for version in (1, 2):
        shutil.copytree(source, tmp_path / "minilm" / str(version))
    settings.TRITON_MODEL_REPOSITORY = str(tmp_path)
    vector_cache_clear_local()
    recorded = json.loads((source / "export.json").read_text())["sha256"]
    assert served_model("minilm", "2") == ServedModel("minilm", "2", recorded)
    assert served_model("minilm", "1") == ServedModel("minilm", "1", recorded)
    # Unpinned, the answer may come from whichever version Triton has loaded: not cached.
    assert served_model("minilm", "") is None
    # A re-export in place with another model.onnx: another key, never the old vector.
    info_path = tmp_path / "minilm" / "2" / "export.json"
    (tmp_path / "minilm" / "2" / "model.onnx").write_bytes(b"another model")
    info = json.loads(info_path.read_text())
    info["sha256"] = hashlib.sha256(b"another model").hexdigest()
    info_path.write_text(json.dumps(info))
    assert served_model("minilm", "2") == ServedModel("minilm", "2", info["sha256"])
    assert served_model("absent", "1") is None
    vector_cache_clear_local()


def test_the_local_lru_keeps_at_most_its_capacity_and_drops_the_least_recent():
    local = LocalVectors(3)
    for index in range(3):
        local.put(bytes([index]), np.full(4, index, dtype=np.float32))
    assert local.get(bytes([0])) is not None  # 0 is now the most recent; 1 the least
    for index in range(3, 10):
        local.put(bytes([index]), np.full(4, index, dtype=np.float32))
        assert len(local) <= 3
    assert local.get(bytes([9]))[0] == 9 and local.get(bytes([1])) is None
    assert len(local) == 3
    assert len(LocalVectors(0).entries) == 0


def local_evictions() -> float:
    return REGISTRY.get_sample_value("embedsite_embedding_cache_evictions_total", {"where": "local"})


def test_the_local_lru_counts_each_entry_it_evicts_and_nothing_else():
    local = LocalVectors(2)
    before = local_evictions()
    for index in range(2):
        local.put(bytes([index]), np.full(4, index, dtype=np.float32))
    local.put(bytes([1]), np.full(4, 7, dtype=np.float32))  # replaced in place: nothing dropped
    assert local_evictions() == before
    for index in range(2, 5):
        local.put(bytes([index]), np.full(4, index, dtype=np.float32))
    assert local_evictions() == before + 3 and len(local) == 2
    LocalVectors(0).put(b"never kept", np.zeros(4, dtype=np.float32))  # nothing kept, nothing evicted
    assert local_evictions() == before + 3
