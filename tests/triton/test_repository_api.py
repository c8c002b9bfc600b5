"""Triton's model repository API through our clients, against a real Triton in explicit mode.

One Triton (--model-control-mode=explicit, `bytes_length` loaded at start) serves a repository
made for this module of links to tests/triton_models and model_repository, plus `two_versions`
(instant_1024's model as versions 1 and 2) and `no_backend` (a config whose backend does not
exist). Each test loads and unloads models of its own, so the order of the tests does not matter.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import json_format, text_format

from embeddings.tooling.triton_server import TritonServer
from embeddings.triton import (
    AsyncTritonClient,
    RepositoryModel,
    TritonClient,
    TritonModelLoadFailed,
    TritonModelNotLoaded,
)
from embeddings.triton import client as client_module
from embeddings.triton.protocol import model_config_pb2
from tests.conftest import TEST_MODEL_REPOSITORY, require_exported_model, start_triton
from tests.processes import REPO_ROOT

INSTANT = "instant_1024"
IDS = np.array([[101, 7, 102], [205, 9, 102]], dtype=np.int64)


def _link(repository: Path, source: Path, name: str | None = None) -> None:
    (repository / (name or source.name)).symlink_to(source)


@pytest.fixture(scope="module")
def explicit_triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    run_dir = tmp_path_factory.mktemp("triton-explicit")
    repository = run_dir / "repository"
    repository.mkdir()
    for name in (INSTANT, "bytes_length", "slow_echo"):
        _link(repository, TEST_MODEL_REPOSITORY / name)
    models = REPO_ROOT / "model_repository"
    require_exported_model(models)
    for name in ("minilm", "minilm_tokenizer", "minilm_text"):
        _link(repository, models / name)
    # Two versions of one model: folders 1/ and 2/ holding instant_1024's model.
    two_versions = repository / "two_versions"
    two_versions.mkdir()
    config = (TEST_MODEL_REPOSITORY / INSTANT / "config.pbtxt").read_text()
    (two_versions / "config.pbtxt").write_text(config.replace(f'name: "{INSTANT}"', 'name: "two_versions"'))
    for version in ("1", "2"):
        _link(two_versions, TEST_MODEL_REPOSITORY / INSTANT / "1", version)
    no_backend = repository / "no_backend"
    (no_backend / "1").mkdir(parents=True)
    (no_backend / "config.pbtxt").write_text(
        config.replace(f'name: "{INSTANT}"', 'name: "no_backend"').replace(
            'backend: "python"', 'backend: "no_such_backend"'
        )
    )
    server = start_triton(
        run_dir, [repository], name="explicit", model_control_mode="explicit", startup_models=["bytes_length"]
    )
    yield server
    server.stop(timeout_s=0)


@pytest.fixture
def client(explicit_triton: TritonServer) -> Iterator[TritonClient]:
    with TritonClient(explicit_triton.grpc_target, retries=5, model_load_timeout_s=120) as client:
        yield client


def states(client: TritonClient, name: str) -> dict[str, str]:
    """Version -> state of `name` in Triton's index ("" -> "" for a model never loaded)."""
    return {entry.version: entry.state for entry in client.repository_index() if entry.name == name}


def ready_versions(client: TritonClient, name: str) -> set[str]:
    return {entry.version for entry in client.repository_index(ready_only=True) if entry.name == name}


def override(name: str, versions: list[int]) -> str:
    """The model folder's config.pbtxt as JSON, serving only `versions` (what the catalog pins)."""
    text = (TEST_MODEL_REPOSITORY / INSTANT / "config.pbtxt").read_text().replace(INSTANT, name)
    config = text_format.Parse(text, model_config_pb2.ModelConfig())
    config.version_policy.specific.versions[:] = versions
    return json_format.MessageToJson(config)


def test_explicit_mode_loads_only_the_startup_models(client):
    index = client.repository_index()
    assert RepositoryModel("bytes_length", "1", "READY", "") in index
    assert RepositoryModel("slow_echo", "", "", "") in index  # in the repository, never loaded
    # Every test unloads what it loaded: only the startup model is ready between tests.
    assert {entry.name for entry in client.repository_index(ready_only=True)} == {"bytes_length"}


def test_load_serves_the_model_and_unload_stops_it(client):
    assert states(client, INSTANT) in ({"": ""}, {"1": "UNAVAILABLE"})
    client.model_load(INSTANT)
    try:
        assert states(client, INSTANT) == {"1": "READY"}
        assert ready_versions(client, INSTANT) == {"1"}
        served = client.embed_tokens(INSTANT, IDS, np.ones_like(IDS))
        assert served[:, 0].tolist() == [101, 205]  # row i holds input_ids[i, 0]
    finally:
        client.model_unload(INSTANT)
    # Triton answers the unload once the model stops taking requests; its instances may still be
    # finishing theirs (UNLOADING) for a while.
    assert states(client, INSTANT)["1"] in ("UNLOADING", "UNAVAILABLE")
    assert ready_versions(client, INSTANT) == set()
    # The spec cached while it was loaded is not used to send a request to a model that is gone.
    with pytest.raises(TritonModelNotLoaded) as raised:
        client.embed_tokens(INSTANT, IDS, np.ones_like(IDS))
    assert raised.value.model == INSTANT and "has no available versions" in raised.value.details


class CountingStub:
    """The client's stub, counting the RPCs it is asked for."""

    def __init__(self, stub):
        self.stub = stub
        self.methods: list[str] = []

    def __getattr__(self, method: str):
        self.methods.append(method)
        return getattr(self.stub, method)


@pytest.fixture
def no_sleeping(monkeypatch):
    """A backoff before a retry (time.sleep or asyncio.sleep in the client) fails the test."""

    def refuse(seconds):
        raise AssertionError(f"the client backed off {seconds} s")

    monkeypatch.setattr(client_module.time, "sleep", refuse)
    monkeypatch.setattr(client_module.asyncio, "sleep", refuse)


@pytest.mark.parametrize(
    ("model", "version", "words"),
    [
        ("slow_echo", "", "is not found"),  # in the repository, never loaded
        ("no_such_model", "", "is not found"),
        ("bytes_length", "7", "version 7 is not found"),  # loaded, but not that version
    ],
)
def test_a_model_that_is_not_loaded_fails_at_once(explicit_triton, model, version, words, no_sleeping):
    client = TritonClient(explicit_triton.grpc_target, retries=5)
    stub = client._stub
    counted: list[CountingStub] = []

    def counting_stub():
        counted.append(CountingStub(stub()))
        return counted[-1]

    client._stub = counting_stub
    with client, pytest.raises(TritonModelNotLoaded) as raised:
        client.embed_texts(model, ["hello"], version=version)
    assert (raised.value.model, raised.value.version) == (model, version)
    assert words in raised.value.details and raised.value.status == "NOT_FOUND"
    # ModelMetadata and ModelConfig, asked together once each; nothing retried.
    methods = [method for each in counted for method in each.methods]
    assert sorted(methods) in (["ModelConfig", "ModelMetadata"], ["ModelMetadata"], ["ModelConfig"])


def test_the_async_client_fails_at_once_too(explicit_triton, no_sleeping):
    async def embed():
        async with AsyncTritonClient(explicit_triton.grpc_target, retries=5) as client:
            await client.embed_texts("slow_echo", ["hello"])

    with pytest.raises(TritonModelNotLoaded, match="for model 'slow_echo' failed with NOT_FOUND"):
        asyncio.run(embed())


def test_a_config_override_pins_the_versions_served(client):
    client.model_load("two_versions")
    try:
        assert ready_versions(client, "two_versions") == {"2"}  # Triton's default: the latest
        client.model_load("two_versions", config=override("two_versions", [1]))
        assert ready_versions(client, "two_versions") == {"1"}
        assert client.embed_tokens("two_versions", IDS, np.ones_like(IDS), version="1").shape == (2, 1024)
        with pytest.raises(TritonModelNotLoaded) as raised:
            client.embed_tokens("two_versions", IDS, np.ones_like(IDS), version="2")
        assert raised.value.version == "2"

        client.model_load("two_versions", config=override("two_versions", [1, 2]))
        assert ready_versions(client, "two_versions") == {"1", "2"}
        assert client.model_metadata("two_versions", "2").version == "2"
    finally:
        client.model_unload("two_versions")
    assert ready_versions(client, "two_versions") == set()


def test_a_failing_load_says_why(client):
    with pytest.raises(TritonModelLoadFailed) as raised:
        client.model_load("no_backend")
    assert "no_such_backend" in raised.value.reason
    assert raised.value.model == "no_backend" and raised.value.status == "INVALID_ARGUMENT"
    (entry,) = [entry for entry in client.repository_index() if entry.name == "no_backend"]
    assert entry.state == "UNAVAILABLE" and "no_such_backend" in entry.reason
    with pytest.raises(TritonModelNotLoaded, match="has no available versions"):
        client.model_metadata("no_backend")


@pytest.mark.parametrize(
    ("model", "config"),
    [("no_such_model", None), (INSTANT, "{not json"), (INSTANT, json.dumps({"name": "other"}))],
)
def test_loads_triton_cannot_even_start_fail_with_its_words(client, model, config):
    with pytest.raises(TritonModelLoadFailed, match=f"'{model}'") as raised:
        client.model_load(model, config=config)
    assert raised.value.reason  # Triton's own words, whatever they are for this case
    assert ready_versions(client, model) == set()


def test_unloading_a_model_that_is_not_loaded_is_not_an_error(client):
    client.model_unload("slow_echo")
    client.model_unload("no_such_model")


def test_loading_the_ensemble_loads_the_models_it_is_made_of(client):
    """Explicit mode: loading minilm_text alone loads minilm_tokenizer and minilm; unloading it
    leaves them loaded unless unload_dependents is asked for."""
    parts = ("minilm", "minilm_tokenizer")
    client.model_load("minilm_text")
    try:
        assert all(ready_versions(client, name) == {"1"} for name in ("minilm_text", *parts))
        assert client.embed_texts("minilm_text", ["a served sentence"]).shape == (1, 384)
        client.model_unload("minilm_text")
        assert ready_versions(client, "minilm_text") == set()
        assert all(ready_versions(client, name) == {"1"} for name in parts)
        client.model_load("minilm_text")
    finally:
        client.model_unload("minilm_text", unload_dependents=True)
    assert not any(ready_versions(client, name) for name in ("minilm_text", *parts))
