"""`export_model --dtype float16`: a tiny random BERT's float32 graph converted to float16 as a new
version beside the float32 one, its pooling and normalisation still float32 (unit vectors), its
agreement with float32 on the held-out texts recorded in export.json (and true when re-measured
here), and a graph the conversion would change refused. The refusals it shares with int8 are
test_variants.py's; Triton serving it is tests/model_serving/test_second_model.py's."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
from django.core.management import call_command

from embeddings.services.inference.exports import ModelExportError, file_sha256, model_export_versions
from embeddings.tooling.model_export import model_export
from embeddings.tooling.model_float16 import float16_graph_write, float32_tail
from embeddings.tooling.model_variants import DEFAULT_MIN_COSINES, recall_at_k, row_cosines
from tests.model_export.held_out import held_out_vectors
from tests.tiny_models import build_tiny_bert

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), seed=7)


@pytest.fixture(scope="module")
def repository(tiny_bert: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Version 1 float32, version 2 float16 of the same model, at the default threshold."""
    repository = tmp_path_factory.mktemp("repository")
    model_export(source_dir=tiny_bert, repository_dir=repository, name="tiny")
    model_export(source_dir=tiny_bert, repository_dir=repository, name="tiny", dtype="float16")
    return repository


def value_types(model_path: Path) -> dict[str, int]:
    """Every named value of the graph (inputs, initializers, node outputs) -> its ONNX element type."""
    import onnx

    model = onnx.shape_inference.infer_shapes(onnx.load(str(model_path)))
    graph = model.graph
    return {
        **{
            value.name: value.type.tensor_type.elem_type
            for value in [*graph.value_info, *graph.input, *graph.output]
        },
        **{tensor.name: tensor.data_type for tensor in graph.initializer},
    }


def graph_of(model_path: Path):
    import onnx

    return onnx.load(str(model_path), load_external_data=False).graph


def test_the_float16_export_is_a_new_version_with_half_weights_beside_its_tokenizer(repository):
    import onnx

    assert model_export_versions(repository_dir=repository, name="tiny") == [1, 2]
    float32, float16 = repository / "tiny" / "1", repository / "tiny" / "2"
    info = json.loads((float16 / "export.json").read_text())
    assert info["dtype"] == "float16"
    assert info["sha256"] == file_sha256(float16 / "model.onnx")
    # Readable as the float32 model is (Triton may run as another user).
    assert (float16 / "model.onnx").stat().st_mode == (float32 / "model.onnx").stat().st_mode
    graph = onnx.load(str(float16 / "model.onnx")).graph
    weights = {tensor.data_type for tensor in graph.initializer if len(tensor.dims) == 2}
    assert weights == {onnx.TensorProto.FLOAT16}
    # The served interface is float32's: int64 ids in, a float32 embedding out.
    assert [(value.name, value.type.tensor_type.elem_type) for value in [*graph.input, *graph.output]] == [
        ("input_ids", onnx.TensorProto.INT64),
        ("attention_mask", onnx.TensorProto.INT64),
        ("embedding", onnx.TensorProto.FLOAT),
    ]
    assert 0.45 < (float16 / "model.onnx").stat().st_size / (float32 / "model.onnx").stat().st_size < 0.55
    for filename in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "calibration.npy"):
        assert (float16 / filename).is_file(), filename


def test_the_encoder_runs_float16_and_its_pooling_and_normalisation_float32(repository):
    import onnx

    float16 = repository / "tiny" / "2" / "model.onnx"
    types = value_types(float16)
    graph = onnx.load(str(float16)).graph
    matmuls = [node for node in graph.node if node.op_type == "MatMul"]
    assert matmuls and all(types[node.input[0]] == onnx.TensorProto.FLOAT16 for node in matmuls)
    for op_type in ("LayerNormalization", "Softmax"):
        nodes = [node for node in graph.node if node.op_type == op_type]
        assert nodes and all(types[node.output[0]] == onnx.TensorProto.FLOAT16 for node in nodes), op_type
    # Mean pooling's sums and the L2 norm (only the pooling has them), and the division by the norm.
    for op_type in ("ReduceSum", "ReduceL2"):
        nodes = [node for node in graph.node if node.op_type == op_type]
        assert nodes and all(types[node.output[0]] == onnx.TensorProto.FLOAT for node in nodes), op_type
    [normalisation] = [node for node in graph.node if "embedding" in node.output]
    assert normalisation.op_type == "Div"
    assert [types[name] for name in normalisation.input] == [onnx.TensorProto.FLOAT] * 2
    # One value crosses from float16 to float32 (the last LayerNormalization's output), none back.
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
    crossings = [
        (types[node.input[0]], types[node.output[0]])
        for node in graph.node
        if node.op_type == "Cast" and {types[node.input[0]], types[node.output[0]]} <= set(floats)
    ]
    assert crossings == [(onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT)]

    vectors = held_out_vectors(repository / "tiny" / "2")
    # Unit vectors as float32 normalises them (a float16 division leaves them off by ~5e-4).
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=2e-6)


def test_export_json_records_the_agreement_with_float32_as_measured_again_here(repository):
    float32, float16 = repository / "tiny" / "1", repository / "tiny" / "2"
    record = json.loads((float16 / "export.json").read_text())["float16"]
    assert record["text_count"] == 500 and record["texts"] == "held_out.txt"
    assert record["min_cosine_required"] == DEFAULT_MIN_COSINES["float16"] == 0.9999
    assert record["float32_nodes"] == len(float32_tail(graph_of(float32 / "model.onnx")))
    assert record["reference_sha256"] == json.loads((float32 / "export.json").read_text())["sha256"]

    expected, found = held_out_vectors(float32), held_out_vectors(float16)
    cosines = row_cosines(expected, found)
    assert record["min_cosine"] == pytest.approx(cosines.min(), abs=1e-6)
    assert record["mean_cosine"] == pytest.approx(cosines.mean(), abs=1e-7)
    assert 0.9999 <= record["min_cosine"] <= record["mean_cosine"] < 1.0
    assert record["recall_at_10"] == pytest.approx(recall_at_k(expected, found, 10), abs=0.01)
    assert 0.99 <= record["recall_at_10"] <= 1.0

    # The output calibration is the float16 graph's vectors, not float32's, and agrees with them.
    calibration16, calibration32 = np.load(float16 / "calibration.npy"), np.load(float32 / "calibration.npy")
    assert not np.array_equal(calibration16, calibration32)
    assert row_cosines(calibration16, calibration32).min() >= record["min_cosine_required"]


def test_the_command_reports_the_figures_and_if_missing_tells_dtypes_apart(tiny_bert, repository):
    args = ["--source", str(tiny_bert), "--name", "tiny", "--repository", str(repository)]
    stdout = io.StringIO()
    call_command("export_model", *args, "--if-missing", "--dtype", "float16", stdout=stdout)
    assert "already exported" in stdout.getvalue()  # version 2, the latest, is float16
    stdout = io.StringIO()
    call_command("export_model", *args, "--if-missing", "--version", "1", "--dtype", "float16", stdout=stdout)
    assert "is outdated (it is a float32 export, not float16); exporting version 1 again" in stdout.getvalue()
    assert "(version 1, bert, 128 dims, mean pooling, float16, " in stdout.getvalue()
    assert "float16 vs float32 on 500 held-out texts: min cosine 0.9999" in stdout.getvalue()
    assert json.loads((repository / "tiny" / "1" / "export.json").read_text())["dtype"] == "float16"


def _write_graph(path: Path, nodes, initializers=()) -> Path:
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        initializer=list(initializers),
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


@pytest.mark.unit
def test_a_graph_the_conversion_would_change_or_cannot_split_is_refused(tmp_path):
    from onnx import TensorProto, helper, numpy_helper

    # float -> int32 -> float truncates; joining the two Casts, as the cleanup does, would not.
    truncating = _write_graph(
        tmp_path / "truncating.onnx",
        [
            helper.make_node("Cast", ["x"], ["whole"], to=TensorProto.INT32, name="to_int"),
            helper.make_node("Cast", ["whole"], ["y"], to=TensorProto.FLOAT, name="to_float"),
        ],
    )
    with pytest.raises(ModelExportError, match=r"casts a cast's output again \(to_float\)"):
        float16_graph_write(truncating, tmp_path / "out.onnx")
    plain = _write_graph(
        tmp_path / "plain.onnx",
        [helper.make_node("Add", ["x", "one"], ["y"], name="add")],
        [numpy_helper.from_array(np.ones((2, 4), dtype=np.float32), "one")],
    )
    with pytest.raises(ModelExportError, match="has no LayerNormalization"):
        float16_graph_write(plain, tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()
