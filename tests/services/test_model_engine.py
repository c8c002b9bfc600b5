"""Which engine answers a model (/v1/models and /ready's `engine`), read from each shipped
configuration as Triton hands it to the client: ModelConfig, through the client's own parsing."""

from __future__ import annotations

import pytest
from google.protobuf import text_format

from embeddings.services.inference.serving import model_engine
from embeddings.tooling.model_configs import model_config_texts
from embeddings.triton.client import _model_spec
from embeddings.triton.protocol import grpc_service_pb2 as pb
from embeddings.triton.protocol import model_config_pb2

pytestmark = pytest.mark.unit

CONFIGS = model_config_texts(name="minilm", dims=384)


def spec_of(path: str, edit=lambda config: None):
    config = text_format.Parse(CONFIGS[path], model_config_pb2.ModelConfig())
    edit(config)
    metadata = pb.ModelMetadataResponse(name="minilm", versions=["1"], platform=config.platform)
    return _model_spec(metadata, config, "1")


@pytest.mark.parametrize(
    ("path", "export_dtype", "engine"),
    [
        ("config.pbtxt", "float32", {"name": "onnxruntime-cpu", "precision": "float32"}),
        ("config.pbtxt", "int8", {"name": "onnxruntime-cpu", "precision": "int8"}),
        ("configs/bundled-gpu.pbtxt", "float32", {"name": "pytorch", "precision": "float16"}),
        ("configs/bundled-gpu-onnx.pbtxt", "float16", {"name": "onnxruntime-cuda", "precision": "float16"}),
        ("configs/bundled-gpu-onnx.pbtxt", "float32", {"name": "onnxruntime-cuda", "precision": "float32"}),
        ("configs/bundled-gpu-tensorrt.pbtxt", "float32", {"name": "tensorrt", "precision": "float16"}),
        ("configs/cpu.pbtxt", "float32", {"name": "onnxruntime-cpu", "precision": "float32"}),
        ("configs/gpu.pbtxt", "float16", {"name": "onnxruntime-cuda", "precision": "float16"}),
        ("configs/gpu-tensorrt.pbtxt", "float32", {"name": "tensorrt", "precision": "float16"}),
    ],
)
def test_each_shipped_configuration_names_its_engine(path, export_dtype, engine):
    assert model_engine(spec_of(path), export_dtype=export_dtype) == engine


def test_the_backends_own_precision_parameter_wins_over_the_exports():
    def float32(config):
        config.parameters["precision"].string_value = "float32"

    assert model_engine(spec_of("configs/bundled-gpu.pbtxt", float32), export_dtype="float32") == {
        "name": "pytorch",
        "precision": "float32",
    }
    assert model_engine(spec_of("configs/bundled-gpu-tensorrt.pbtxt", float32), export_dtype="float16") == {
        "name": "tensorrt",
        "precision": "float32",
    }


def test_tensorrt_named_for_a_cpu_instance_is_not_what_runs_it():
    def on_cpu(config):
        config.instance_group[0].kind = model_config_pb2.ModelInstanceGroup.KIND_CPU

    # ONNX Runtime's backend applies GPU accelerators to GPU instances only.
    assert model_engine(spec_of("configs/gpu-tensorrt.pbtxt", on_cpu), export_dtype="float32") == {
        "name": "onnxruntime-cpu",
        "precision": "float32",
    }


def test_another_backend_is_named_as_it_is():
    spec = _model_spec(
        pb.ModelMetadataResponse(name="echo", versions=["1"]),
        model_config_pb2.ModelConfig(name="echo", backend="python"),
        "1",
    )
    assert model_engine(spec, export_dtype=None) == {"name": "python", "precision": None}


def test_the_engine_never_makes_replicas_disagree():
    # Replicas are compared by their specs (/ready): an engine rolled out replica by replica must
    # not take the model out of service meanwhile.
    assert spec_of("configs/bundled-gpu.pbtxt") == spec_of("configs/bundled-gpu-onnx.pbtxt")
    assert spec_of("config.pbtxt") != spec_of("configs/bundled-gpu.pbtxt")  # max_batch_size differs
