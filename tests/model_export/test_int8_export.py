"""`export_model --dtype int8`: a tiny random BERT's float32 graph quantised, landing as a new
version beside the float32 one, its agreement with float32 on the held-out texts recorded in
export.json (and true when re-measured here), and served by Triton. The refusals it shares with
float16 are test_variants.py's."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
from django.core.management import CommandError, call_command

from embeddings.services.inference.exports import file_sha256, model_export_versions
from embeddings.tooling.export_threads import cpu_session
from embeddings.tooling.model_export import model_export
from embeddings.tooling.model_int8 import float32_matmuls
from embeddings.tooling.model_variants import recall_at_k
from embeddings.triton.client import TritonClient
from tests.conftest import start_triton
from tests.model_export.held_out import held_out_vectors
from tests.tiny_models import build_tiny_bert

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# A random BERT's int8 agreement is lower than a trained one's; the threshold here only needs to
# pass it, the refusal test raises it to what no quantised graph reaches.
ACCEPTED = 0.9


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), seed=7)


@pytest.fixture(scope="module")
def repository(tiny_bert: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Version 1 float32, version 2 int8 of the same model."""
    repository = tmp_path_factory.mktemp("repository")
    model_export(source_dir=tiny_bert, repository_dir=repository, name="tiny")
    model_export(
        source_dir=tiny_bert,
        repository_dir=repository,
        name="tiny",
        dtype="int8",
        min_variant_cosine=ACCEPTED,
    )
    return repository


def operators(model_path: Path) -> set[str]:
    import onnx

    return {node.op_type for node in onnx.load(str(model_path), load_external_data=False).graph.node}


def test_the_int8_export_is_a_new_version_with_integer_weights_beside_its_tokenizer(repository):
    assert model_export_versions(repository_dir=repository, name="tiny") == [1, 2]
    float32, int8 = repository / "tiny" / "1", repository / "tiny" / "2"
    assert json.loads((float32 / "export.json").read_text())["dtype"] == "float32"
    info = json.loads((int8 / "export.json").read_text())
    assert info["dtype"] == "int8"
    assert info["sha256"] == file_sha256(int8 / "model.onnx")
    # Readable as the float32 model is (Triton may run as another user).
    assert (int8 / "model.onnx").stat().st_mode == (float32 / "model.onnx").stat().st_mode
    assert {"MatMulInteger", "DynamicQuantizeLinear"} <= operators(int8 / "model.onnx")
    assert "MatMulInteger" not in operators(float32 / "model.onnx")
    assert (int8 / "model.onnx").stat().st_size < 0.5 * (float32 / "model.onnx").stat().st_size
    for filename in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "calibration.npy"):
        assert (int8 / filename).is_file(), filename
    # The output calibration is the served (int8) graph's vectors, not float32's.
    assert not np.array_equal(np.load(int8 / "calibration.npy"), np.load(float32 / "calibration.npy"))


def test_export_json_records_the_agreement_with_float32_as_measured_again_here(repository):
    float32, int8 = repository / "tiny" / "1", repository / "tiny" / "2"
    record = json.loads((int8 / "export.json").read_text())["int8"]
    assert record["text_count"] == 500 and record["texts"] == "held_out.txt"
    assert record["min_cosine_required"] == ACCEPTED
    assert record["float32_matmuls"] == 2  # the two layers' feed-forward down-projections
    # The float32 graph it was measured against is version 1's: the export is deterministic.
    assert record["reference_sha256"] == json.loads((float32 / "export.json").read_text())["sha256"]

    expected, found = held_out_vectors(float32), held_out_vectors(int8)
    cosines = (
        (expected * found).sum(axis=1) / np.linalg.norm(expected, axis=1) / np.linalg.norm(found, axis=1)
    )
    assert record["min_cosine"] == pytest.approx(cosines.min(), abs=2e-3)
    assert record["mean_cosine"] == pytest.approx(cosines.mean(), abs=1e-3)
    assert ACCEPTED <= record["min_cosine"] < record["mean_cosine"] < 1.0
    assert record["recall_at_10"] == pytest.approx(recall_at_k(expected, found, 10), abs=0.02)
    assert 0.5 < record["recall_at_10"] < 1.0


@pytest.mark.integration  # starts its own Triton
def test_triton_serves_the_int8_version_with_the_cpu_config_as_written(repository, tmp_path):
    from tokenizers import Tokenizer

    int8 = repository / "tiny" / "2"
    encodings = Tokenizer.from_file(str(int8 / "tokenizer.json")).encode_batch(
        ["hello", "The quick brown fox jumps over the lazy dog.", "a longer text " * 40]
    )
    input_ids = np.array([encoding.ids for encoding in encodings], dtype=np.int64)
    attention_mask = np.array([encoding.attention_mask for encoding in encodings], dtype=np.int64)
    server = start_triton(tmp_path, [repository], model_control_mode="explicit", startup_models=["tiny"])
    try:
        with TritonClient(server.grpc_target) as client:
            assert client.model_ready("tiny", "2") and not client.model_ready("tiny", "1")
            served = client.embed_tokens("tiny", input_ids, attention_mask)
    finally:
        server.stop(timeout_s=0)

    session = cpu_session(int8 / "model.onnx")
    direct = session.run(["embedding"], {"input_ids": input_ids, "attention_mask": attention_mask})[0]
    np.testing.assert_allclose(served, direct, atol=1e-6)
    assert np.allclose(np.linalg.norm(served, axis=1), 1.0, atol=1e-5)


def test_the_command_reports_the_figures_and_if_missing_tells_dtypes_apart(tiny_bert, repository):
    stdout = io.StringIO()
    args = ["--source", str(tiny_bert), "--name", "tiny", "--repository", str(repository), "--if-missing"]
    call_command("export_model", *args, "--dtype", "int8", "--min-cosine", str(ACCEPTED), stdout=stdout)
    assert "already exported" in stdout.getvalue()  # version 2, the latest, is int8
    with pytest.raises(CommandError, match="--min-cosine is an int8 or float16 export's"):
        call_command("export_model", *args, "--min-cosine", "0.5", stdout=io.StringIO())

    stdout = io.StringIO()
    call_command("export_model", *args, "--version", "1", stdout=stdout)
    assert "already exported" in stdout.getvalue()  # version 1 is the float32 one


def test_float32_matmuls_are_the_down_projections(repository):
    kept = float32_matmuls(repository / "tiny" / "1" / "model.onnx")
    assert sorted(kept) == [f"/encoder/encoder/layer.{layer}/output/dense/MatMul" for layer in (0, 1)]
