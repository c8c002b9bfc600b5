"""The official-container configs (configs/gpu.pbtxt, configs/cpu.pbtxt, configs/gpu-tensorrt.pbtxt):
read by a real Triton, and fitting the exported model.onnx."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import text_format

from embeddings.tooling.export_threads import cpu_session
from embeddings.tooling.triton_server import TritonServer, free_port
from embeddings.triton.protocol import model_config_pb2
from tests.conftest import require_exported_model
from tests.processes import REPO_ROOT

MODEL_DIR = REPO_ROOT / "model_repository" / "minilm"
# Triton's own words once a config parsed and it looks for the backend, which this Triton (the
# pytriton wheel's) does not have: the official image does.
REACHED_THE_BACKEND = "unable to find backend library for backend 'onnxruntime'"
PARSE_FAILED = "Error parsing text-format inference.ModelConfig"


def triton_reading(config_text: str, config_name: str, tmp_path: Path) -> str:
    """Triton's log after it read `config_text` as configs/<config_name>.pbtxt and tried to load it."""
    model = tmp_path / "repository" / "minilm"
    (model / "configs").mkdir(parents=True)
    (model / "1").mkdir()
    (model / "configs" / f"{config_name}.pbtxt").write_text(config_text)
    (model / "1" / "model.onnx").symlink_to(require_exported_model(REPO_ROOT / "model_repository"))
    server = TritonServer(
        model_repositories=[tmp_path / "repository"],
        run_dir=tmp_path / "run",
        grpc_port=free_port(),
        http_port=free_port(),
        metrics_port=free_port(),
        log_path=tmp_path / "triton.log",
        model_config_name=config_name,
        model_control_mode="explicit",
        startup_models=["minilm"],
        extra_args=["--exit-on-error=true"],
    )
    server.start()
    try:
        # It exits by itself once the model fails to load (--exit-on-error).
        server.process.wait(timeout=120)
    finally:
        server.stop(timeout_s=0)
    return (tmp_path / "triton.log").read_text(errors="replace")


@pytest.mark.parametrize("config_name", ["gpu", "cpu", "gpu-tensorrt"])
def test_triton_reads_the_official_container_config(config_name: str, tmp_path: Path) -> None:
    log = triton_reading((MODEL_DIR / "configs" / f"{config_name}.pbtxt").read_text(), config_name, tmp_path)
    assert PARSE_FAILED not in log
    assert REACHED_THE_BACKEND in log


def test_triton_refuses_a_config_with_a_misspelt_field(tmp_path: Path) -> None:
    text = (MODEL_DIR / "configs" / "cpu.pbtxt").read_text().replace("priority_levels", "priority_level")
    log = triton_reading(text, "cpu", tmp_path)
    assert PARSE_FAILED in log
    assert REACHED_THE_BACKEND not in log


def parsed(name: str) -> model_config_pb2.ModelConfig:
    # Our protocol subset reads the fields compared here; Triton itself checks the rest (above).
    text = (MODEL_DIR / "configs" / f"{name}.pbtxt").read_text()
    return text_format.Parse(text, model_config_pb2.ModelConfig(), allow_unknown_field=True)


@pytest.mark.unit
def test_the_cpu_config_runs_the_exported_graph_on_cpu() -> None:
    cpu, gpu = parsed("cpu"), parsed("gpu")
    assert cpu.platform == gpu.platform == "onnxruntime_onnx"
    assert [group.kind for group in cpu.instance_group] == [model_config_pb2.ModelInstanceGroup.KIND_CPU]
    assert [group.kind for group in gpu.instance_group] == [model_config_pb2.ModelInstanceGroup.KIND_GPU]
    # Native batching merges equal shapes only: the service pads to SEQUENCE_LENGTH_BUCKETS instead.
    assert not any(tensor.allow_ragged_batch for tensor in cpu.input)
    assert cpu.max_batch_size > 0


def test_both_configs_match_the_exported_model() -> None:
    session = cpu_session(require_exported_model(REPO_ROOT / "model_repository"))
    onnx_types = {"tensor(int64)": model_config_pb2.TYPE_INT64, "tensor(float)": model_config_pb2.TYPE_FP32}
    graph_inputs = {tensor.name: onnx_types[tensor.type] for tensor in session.get_inputs()}
    graph_outputs = {
        tensor.name: (onnx_types[tensor.type], tensor.shape[-1]) for tensor in session.get_outputs()
    }
    for name in ("cpu", "gpu", "gpu-tensorrt"):
        config = parsed(name)
        assert {tensor.name: tensor.data_type for tensor in config.input} == graph_inputs
        assert {tensor.name: (tensor.data_type, tensor.dims[-1]) for tensor in config.output} == graph_outputs
