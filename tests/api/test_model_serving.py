"""Models registered next to MiniLM, loaded into a running Triton (explicit model control): served
side by side, and a registered model Triton has not loaded answers 503 at once, through a real uvicorn."""

from __future__ import annotations

import json
import urllib.request

import httpx2
import numpy as np
import pytest

from tests.api.conftest import live_uvicorn
from tests.processes import manage


def triton_unload(http_url: str, name: str) -> None:
    """Unload in Triton directly, behind the catalog's back (as a Triton restart would leave it)."""
    request = urllib.request.Request(
        f"{http_url}/v2/repository/models/{name}/unload", data=b"{}", method="POST"
    )
    with urllib.request.urlopen(request, timeout=60):
        pass


@pytest.fixture
def serving_stack(explicit_triton, redis_server, tmp_path):
    """uvicorn (one worker) on the explicit-mode Triton and its repository, MiniLM registered (and
    loaded: register_local_model loads it)."""
    with live_uvicorn(
        workdir=tmp_path,
        triton_target=explicit_triton.server.grpc_target,
        redis_url=redis_server.url,
        workers=1,
        env={"TRITON_MODEL_REPOSITORY": str(explicit_triton.repository), "MODEL_CACHE_SECONDS": "0.2"},
    ) as server:
        yield server


def embed(server, model: str, texts: list[str]) -> httpx2.Response:
    return httpx2.post(
        f"{server.base_url}/v1/embeddings",
        headers=server.headers,
        json={"model": model, "input": texts},
        timeout=60,
    )


def test_a_second_model_is_registered_loaded_served_and_503_once_unloaded(serving_stack, explicit_triton):
    server = serving_stack
    output = manage(
        server.env, "register_model", "--triton-model", "minilm_copy", "--name", "copy", "--alias", "c"
    )
    assert "registered copy -> Triton model minilm_copy version 1 (384-d, 256 tokens)" in output
    assert "copy is loaded in Triton and serving" in output

    texts = ["hello world", "a second model"]
    default, copy = embed(server, "minilm", texts), embed(server, "c", texts)
    assert default.status_code == copy.status_code == 200, copy.text
    assert copy.json()["model"] == "copy"
    # The same weights behind both names: the same vectors.
    np.testing.assert_allclose(
        [row["embedding"] for row in copy.json()["data"]],
        [row["embedding"] for row in default.json()["data"]],
        atol=1e-5,
    )
    models = httpx2.get(f"{server.base_url}/v1/models", headers=server.headers, timeout=10).json()
    assert {"all-MiniLM-L6-v2", "copy"} <= {entry["id"] for entry in models["data"]}
    assert "minilm_copy" not in json.dumps(models)  # Triton's names are not the tenant's business

    triton_unload(explicit_triton.server.http_url, "minilm_copy")
    refused = embed(server, "copy", texts)
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["code"] == "model_not_loaded" and error["param"] == "model"
    assert (
        "'copy'" in error["message"]
        and "'minilm_copy'" in error["message"]
        and "version 1" in error["message"]
    )
    assert refused.headers["retry-after"]
    # The other model keeps serving, and readiness depends on the default model only.
    assert embed(server, "minilm", texts).status_code == 200
    ready = httpx2.get(f"{server.base_url}/ready", timeout=30)
    assert ready.status_code == 200, ready.text
    states = ready.json()["models"]
    assert states["all-MiniLM-L6-v2"] == {
        "triton_model": "minilm",
        "version": "1",
        "dtype": "float32",
        "engine": {"name": "onnxruntime-cpu", "precision": "float32"},
        "state": "READY",
        "reason": "",
    }
    assert states["copy"]["triton_model"] == "minilm_copy" and states["copy"]["state"] in {
        "UNLOADING",
        "UNAVAILABLE",
    }
    assert states["copy"]["engine"] is None  # not served: nothing answers it
