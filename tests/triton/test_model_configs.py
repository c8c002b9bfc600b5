"""The model configuration templates: MiniLM's committed configs are their rendering, and any other
model's rendering is a valid config naming that model and its width."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import text_format

from embeddings.tooling.model_configs import model_config_texts, model_configs_write
from embeddings.triton.protocol import model_config_pb2
from tests.processes import REPO_ROOT

pytestmark = pytest.mark.unit

MINILM_DIR = REPO_ROOT / "model_repository" / "minilm"
CONFIG_PATHS = (
    "config.pbtxt",
    "configs/cpu.pbtxt",
    "configs/gpu.pbtxt",
    "configs/gpu-tensorrt.pbtxt",
    "configs/bundled-gpu.pbtxt",
    "configs/bundled-gpu-onnx.pbtxt",
    "configs/bundled-gpu-tensorrt.pbtxt",
)
KIND_GPU = model_config_pb2.ModelInstanceGroup.KIND_GPU


def parsed(text: str) -> model_config_pb2.ModelConfig:
    # Our protocol subset reads the fields compared here; tests/deploy has a real Triton read them.
    return text_format.Parse(text, model_config_pb2.ModelConfig(), allow_unknown_field=True)


def test_minilms_committed_configs_are_the_templates_rendering():
    rendered = model_config_texts(name="minilm", dims=384)
    assert sorted(rendered) == sorted(CONFIG_PATHS)
    for path in CONFIG_PATHS:
        # On a difference: edit embeddings/in_triton/model_configs/*.pbtxt, then re-render minilm's
        # (model_configs_write(model_dir=MINILM_DIR, name="minilm", dims=384)).
        assert (MINILM_DIR / path).read_text(encoding="utf-8") == rendered[path], path


def test_another_models_configs_name_it_and_its_width():
    rendered = {path: parsed(text) for path, text in model_config_texts(name="tiny_bert", dims=128).items()}
    for path, config in rendered.items():
        assert config.name == "tiny_bert", path
        assert [list(output.dims) for output in config.output] == [[128]], path
        assert [(tensor.name, tensor.data_type) for tensor in config.input] == [
            ("input_ids", model_config_pb2.TYPE_INT64),
            ("attention_mask", model_config_pb2.TYPE_INT64),
        ]
    bundled, cpu, gpu = (
        rendered[path] for path in ("config.pbtxt", "configs/cpu.pbtxt", "configs/gpu.pbtxt")
    )
    assert bundled.backend == "embedsite_onnx" and not bundled.platform
    assert all(tensor.allow_ragged_batch for tensor in bundled.input)
    # The bundled Triton's three GPU engines: ragged, on the GPU, batched as the CPU model.
    engines = {
        "configs/bundled-gpu.pbtxt": ("embedsite_torch", None),
        "configs/bundled-gpu-onnx.pbtxt": ("embedsite_onnx", "cuda"),
        "configs/bundled-gpu-tensorrt.pbtxt": ("embedsite_onnx", "tensorrt"),
    }
    for path, (backend, provider) in engines.items():
        config = rendered[path]
        assert config.backend == backend and not config.platform, path
        assert all(tensor.allow_ragged_batch for tensor in config.input), path
        assert [group.kind for group in config.instance_group] == [KIND_GPU], path
        # Same priority levels as the CPU model: the client's priorities mean the same on all.
        assert config.dynamic_batching.priority_levels == bundled.dynamic_batching.priority_levels, path
        parameters = {key: value.string_value for key, value in config.parameters.items()}
        assert parameters.get("execution_provider") == provider, path
        # Every one pads to the same buckets and runs them at load.
        assert parameters["sequence_buckets"] == "16,32,64,96,128,160,192,224,256,320,384,448,512", path
    tensorrt = rendered["configs/bundled-gpu-tensorrt.pbtxt"].parameters
    assert tensorrt["precision"].string_value == "float16"
    assert tensorrt["engine_cache_dir"].string_value == ""  # <model>/engines
    official_tensorrt = rendered["configs/gpu-tensorrt.pbtxt"]
    assert cpu.platform == gpu.platform == official_tensorrt.platform == "onnxruntime_onnx"
    assert [group.kind for group in cpu.instance_group] == [model_config_pb2.ModelInstanceGroup.KIND_CPU]
    assert [group.kind for group in gpu.instance_group] == [KIND_GPU]
    (accelerator,) = official_tensorrt.optimization.execution_accelerators.gpu_execution_accelerator
    assert accelerator.name == "tensorrt" and accelerator.parameters["precision_mode"] == "FP16"
    assert accelerator.parameters["trt_engine_cache_path"] == "/engines/tiny_bert"
    assert not gpu.HasField("optimization")
    # The tuned settings are MiniLM's, whatever the model.
    minilm = parsed((MINILM_DIR / "config.pbtxt").read_text())
    assert bundled.max_batch_size == minilm.max_batch_size
    assert bundled.dynamic_batching == minilm.dynamic_batching
    assert bundled.instance_group == minilm.instance_group


@pytest.mark.parametrize("name", ["", ".hidden", "a/b", "..", 'x" platform: "y', "tab\there", "é", "a" * 129])
def test_a_name_that_is_not_a_plain_directory_name_is_refused(name):
    with pytest.raises(ValueError, match="invalid Triton model name"):
        model_config_texts(name=name, dims=128)


@pytest.mark.parametrize("dims", [0, -1, True, 1.5, "128"])
def test_dims_must_be_a_positive_integer(dims):
    with pytest.raises(ValueError, match="dims must be a positive integer"):
        model_config_texts(name="tiny", dims=dims)


def test_writing_creates_the_files_and_leaves_equal_ones_alone(tmp_path: Path):
    written = model_configs_write(model_dir=tmp_path / "tiny", name="tiny", dims=64)
    assert written == [tmp_path / "tiny" / path for path in CONFIG_PATHS]
    before = {path: (tmp_path / "tiny" / path).stat().st_mtime_ns for path in CONFIG_PATHS}

    (tmp_path / "tiny" / "configs" / "gpu.pbtxt").write_text("hand-edited")
    assert model_configs_write(model_dir=tmp_path / "tiny", name="tiny", dims=64) == [
        tmp_path / "tiny" / "configs" / "gpu.pbtxt"
    ]
    assert (tmp_path / "tiny" / "config.pbtxt").stat().st_mtime_ns == before["config.pbtxt"]
    assert parsed((tmp_path / "tiny" / "configs" / "gpu.pbtxt").read_text()).name == "tiny"
    assert not [path for path in (tmp_path / "tiny").rglob(".*")]
