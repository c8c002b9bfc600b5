"""embedsite_onnx's execution providers (configs/bundled-gpu-onnx.pbtxt, bundled-gpu-tensorrt.pbtxt)
in a real Triton: the shipped GPU templates with only the instance kind, count and provider changed.

Where no GPU is (here), the CPU provider runs the GPU configs' bucket path (groups padded to
sequence_buckets, every bucket run at load) and its vectors must equal the unbucketed ones; a
provider this onnxruntime lacks, and an int8 export on a GPU provider, are refused at load with
what to do. The GPU tests (CUDA provider; TensorRT built, cached, reused, rebuilt for a new export)
skip with their reason without a GPU, onnxruntime-gpu or TensorRT."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import re
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import onnxruntime
import pytest

from embeddings.in_triton import BACKENDS_DIR
from embeddings.in_triton.backends.embedsite_onnx.engines import EngineCacheError, gpu_identity
from embeddings.tooling.model_configs import model_config_texts
from embeddings.triton import TritonClient, TritonModelLoadFailed
from embeddings.triton.client import AsyncTritonClient
from tests.conftest import require_exported_model, start_triton
from tests.onnx_reference import MIXED_TEXTS, padded_ids, row_cosines, token_ids, vectors_for_ids
from tests.processes import REPO_ROOT

MINILM_DIR = REPO_ROOT / "model_repository" / "minilm"
CONFIG_NAME = "engine-test"
FLOAT32_MIN_COSINE = 0.99999
FLOAT16_MIN_COSINE = 0.999  # the bar for float16 against the float32 CPU model
SHIPPED_BUCKETS = [16, 32, 64, 96, 128, 160, 192, 224, 256]  # the template's, cut at MiniLM's 256


def shipped_config(template_path: str, name: str, changes: list[tuple[str, str]]) -> str:
    """The shipped GPU config for `name`, with each (shipped, changed) text replaced: every one must
    be in the template, so a template that drifts fails here rather than testing something else."""
    text = model_config_texts(name=name, dims=384)[template_path]
    for shipped, changed in changes:
        assert shipped in text, shipped
        text = text.replace(shipped, changed)
    return text


def add_model(repository: Path, name: str, config: str, *, export_changes: dict | None = None) -> Path:
    """Model `name`: minilm's version 1 (model.onnx linked, the small files copied; export.json with
    `export_changes`) and configs/engine-test.pbtxt."""
    version_dir = repository / name / "1"
    version_dir.mkdir(parents=True)
    for file in (MINILM_DIR / "1").iterdir():
        if file.name == "model.onnx":
            (version_dir / file.name).symlink_to(file)
        elif file.is_file():
            shutil.copyfile(file, version_dir / file.name)
    if export_changes:
        info = json.loads((version_dir / "export.json").read_text())
        (version_dir / "export.json").write_text(json.dumps(info | export_changes))
    (repository / name / "configs").mkdir()
    (repository / name / "configs" / f"{CONFIG_NAME}.pbtxt").write_text(config)
    return repository / name


ON_CPU = [("kind: KIND_GPU", "kind: KIND_CPU"), ("count: 4", "count: 1")]


@pytest.fixture(scope="module")
def minilm_ids() -> list[list[int]]:
    require_exported_model(REPO_ROOT / "model_repository")
    return [token_ids(text)[:256] for text in MIXED_TEXTS]


@pytest.fixture(scope="module")
def engines_triton(tmp_path_factory):
    """A Triton in explicit mode over models made of the shipped GPU templates: `bucketed` (the CUDA
    config with the CPU provider on KIND_CPU), `cuda_here` and `tensorrt_here` (their providers on
    KIND_CPU, which this onnxruntime lacks), `int8_on_cuda` (an export that says int8)."""
    require_exported_model(REPO_ROOT / "model_repository")
    repository = tmp_path_factory.mktemp("repository")
    onnx_gpu = "configs/bundled-gpu-onnx.pbtxt"
    bucketed = add_model(
        repository,
        "bucketed",
        shipped_config(onnx_gpu, "bucketed", [*ON_CPU, ('string_value: "cuda"', 'string_value: "cpu"')]),
    )
    # An engine cache in the model's folder, as TensorRT leaves it: not a version, Triton must skip it.
    (bucketed / "engines" / "1" / "nvidia-h200-sm90-trt10-float16-0").mkdir(parents=True)
    add_model(repository, "cuda_here", shipped_config(onnx_gpu, "cuda_here", ON_CPU))
    add_model(
        repository,
        "tensorrt_here",
        shipped_config("configs/bundled-gpu-tensorrt.pbtxt", "tensorrt_here", ON_CPU),
    )
    add_model(
        repository,
        "int8_on_cuda",
        shipped_config(onnx_gpu, "int8_on_cuda", ON_CPU),
        export_changes={"dtype": "int8"},
    )
    add_model(
        repository,
        "no_such_provider",
        shipped_config(
            onnx_gpu, "no_such_provider", [*ON_CPU, ('string_value: "cuda"', 'string_value: "rocm"')]
        ),
    )
    server = start_triton(
        tmp_path_factory.mktemp("triton"),
        [repository],
        model_config_name=CONFIG_NAME,
        model_control_mode="explicit",
        startup_models=["bucketed"],
    )
    yield server
    server.stop(timeout_s=0)


def test_the_cpu_provider_with_buckets_serves_what_it_serves_unbucketed(engines_triton, minilm_ids):
    async def run():
        async with AsyncTritonClient(engines_triton.grpc_target) as client:
            spec = await client.model_metadata("bucketed")
            # Concurrent requests of different lengths, merged by the batcher and padded to a bucket.
            alone = await asyncio.gather(
                *(client.embed_tokens("bucketed", *padded_ids([ids])) for ids in minilm_ids)
            )
            together = await client.embed_tokens("bucketed", *padded_ids(minilm_ids))
            return spec, np.concatenate(alone), together

    spec, alone, together = asyncio.run(run())

    reference = vectors_for_ids(minilm_ids)  # ONNX Runtime on each text alone, unpadded
    assert row_cosines(alone, reference).min() >= FLOAT32_MIN_COSINE
    assert row_cosines(together, reference).min() >= FLOAT32_MIN_COSINE
    np.testing.assert_allclose(together, reference, rtol=0, atol=1e-5)
    # engines/ beside 1/ is no version.
    assert spec.served_versions == ("1",) and spec.max_batch_size == 512
    log = engines_triton.log_path.read_text()
    assert f"bucketed/1/model.onnx on CPUExecutionProvider, sequence buckets {SHIPPED_BUCKETS}" in log


@pytest.mark.parametrize(
    ("model", "words"),
    [
        (
            "cuda_here",
            rf"execution_provider cuda needs ONNX Runtime's CUDAExecutionProvider, which this onnxruntime "
            rf"{re.escape(onnxruntime.__version__)} lacks .*pip install -r requirements-gpu\.txt",
        ),
        (
            "tensorrt_here",
            r"execution_provider tensorrt needs ONNX Runtime's TensorrtExecutionProvider.*"
            r"requirements-gpu\.txt.*TensorRT 10",
        ),
        ("int8_on_cuda", r"is an int8 export, which ONNX Runtime runs on CPU only.*config\.pbtxt"),
        ("no_such_provider", r"execution_provider must be one of \['cpu', 'cuda', 'tensorrt'\], not 'rocm'"),
    ],
)
def test_what_cannot_run_here_is_refused_at_load_saying_what_to_do(engines_triton, model, words):
    with TritonClient(engines_triton.grpc_target, model_load_timeout_s=120) as client:
        with pytest.raises(TritonModelLoadFailed) as raised:
            client.model_load(model)
        assert re.search(words, raised.value.reason), raised.value.reason
        # Never served from the CPU instead.
        assert not client.model_ready(model)


# --- the padding itself, in the backend's own code (Triton's pb_utils faked) ---------------------------


@pytest.fixture(scope="module")
def backend_module():
    """embedsite_onnx/model.py imported outside Triton: its pb_utils replaced by a stand-in."""
    stand_in = types.ModuleType("triton_python_backend_utils")
    stand_in.Logger = types.SimpleNamespace(log_info=lambda message: None, log_warn=lambda message: None)
    saved = sys.modules.get("triton_python_backend_utils")
    sys.modules["triton_python_backend_utils"] = stand_in
    try:
        spec = importlib.util.spec_from_file_location(
            "embedsite_onnx_model_under_test", BACKENDS_DIR / "embedsite_onnx" / "model.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        if saved is None:
            sys.modules.pop("triton_python_backend_utils", None)
        else:
            sys.modules["triton_python_backend_utils"] = saved


@pytest.mark.unit
def test_buckets_parse_to_the_models_maximum(backend_module):
    parse = backend_module.parse_buckets
    assert parse("64, 16,32,16", 256) == (16, 32, 64, 256)
    assert parse("16,32,512", 256) == (16, 32, 256)
    assert parse("16,32", None) == (16, 32)
    assert parse("", 256) == ()  # the CPU default: each group at its longest request's length
    with pytest.raises(ValueError, match="positive lengths"):
        parse("0,16", 256)


@pytest.mark.unit
def test_a_group_runs_at_the_first_bucket_that_holds_it(backend_module):
    model = backend_module.TritonPythonModel()
    model.input_names = ["input_ids", "attention_mask"]
    shapes = []
    model.run_padded = lambda inputs: (
        shapes.append(inputs["input_ids"].shape) or np.zeros((len(inputs["input_ids"]), 2))
    )
    short, long = padded_ids([[101, 7, 102]]), padded_ids([[101, *range(1000, 1015), 102]])  # 3 and 17 tokens

    model.buckets = (16, 32, 256)
    model._run([(0, short), (1, long)])
    model.buckets = ()
    model._run([(0, short), (1, long)])
    model.buckets = (16, 32, 256)
    model.warm_up()

    assert shapes == [(2, 32), (2, 17), (1, 16), (1, 32), (1, 256)]
    assert model.padded_length(300) == 300  # past the buckets: its own length (refused earlier)


# --- on a GPU -------------------------------------------------------------------------------------------


def gpu_missing_reason(provider: str) -> str | None:
    """Why the GPU tests of `provider` cannot run here, or None."""
    available = onnxruntime.get_available_providers()
    if provider not in available:
        return f"onnxruntime {onnxruntime.__version__} has no {provider} ({available}): needs onnxruntime-gpu"
    try:
        gpu_identity(0)
    except EngineCacheError as error:
        return f"no GPU: {error}"
    if provider == "TensorrtExecutionProvider" and importlib.util.find_spec("tensorrt") is None:
        return "TensorRT's Python package (tensorrt-cu13) is not installed"
    return None


def require_gpu(provider: str) -> None:
    reason = gpu_missing_reason(provider)
    if reason:
        pytest.skip(reason)


def served_vectors(target: str, model: str, ids: list[list[int]]) -> np.ndarray:
    with TritonClient(target, timeout_s=120) as client:
        return client.embed_tokens(model, *padded_ids(ids))


def engine_directories(version_cache: Path) -> list[Path]:
    """The engine directories of one version (each has its lock file beside it)."""
    return [path for path in version_cache.iterdir() if path.is_dir()]


def gpu_triton(run_dir: Path, repository: Path):
    return start_triton(run_dir, [repository], model_config_name=CONFIG_NAME, model_control_mode="explicit")


def test_the_cuda_provider_serves_the_export_on_the_gpu(tmp_path, minilm_ids):
    require_gpu("CUDAExecutionProvider")
    repository = tmp_path / "repository"
    add_model(repository, "on_cuda", shipped_config("configs/bundled-gpu-onnx.pbtxt", "on_cuda", []))
    server = gpu_triton(tmp_path / "triton", repository)
    try:
        with TritonClient(server.grpc_target, model_load_timeout_s=300) as client:
            client.model_load("on_cuda")
        vectors = served_vectors(server.grpc_target, "on_cuda", minilm_ids)
    finally:
        server.stop()
    assert row_cosines(vectors, vectors_for_ids(minilm_ids)).min() >= FLOAT32_MIN_COSINE
    assert "on CUDAExecutionProvider, GPU 0" in server.log_path.read_text()


def test_tensorrt_builds_an_engine_once_reuses_it_and_rebuilds_for_a_new_export(tmp_path, minilm_ids):
    require_gpu("TensorrtExecutionProvider")
    repository = tmp_path / "repository"
    cache = tmp_path / "engines"
    config = shipped_config(
        "configs/bundled-gpu-tensorrt.pbtxt",
        "on_tensorrt",
        [
            (
                'key: "engine_cache_dir" value: { string_value: "" }',
                f'key: "engine_cache_dir" value: {{ string_value: "{cache}" }}',
            )
        ],
    )
    model_dir = add_model(repository, "on_tensorrt", config)
    reference = vectors_for_ids(minilm_ids)
    server = gpu_triton(tmp_path / "triton", repository)
    try:
        with TritonClient(server.grpc_target, model_load_timeout_s=600) as client:
            client.model_load("on_tensorrt")
            first = served_vectors(server.grpc_target, "on_tensorrt", minilm_ids)
            (first_directory,) = engine_directories(cache / "1")
            client.model_unload("on_tensorrt")
            client.model_load("on_tensorrt")
            # Another export in the same version folder: the same graph with other bytes (a note in
            # its metadata), its checksum recorded as export_model records it.
            import onnx

            graph = onnx.load(str(MINILM_DIR / "1" / "model.onnx"))
            graph.doc_string = "re-exported"
            (model_dir / "1" / "model.onnx").unlink()
            onnx.save(graph, str(model_dir / "1" / "model.onnx"))
            info = json.loads((model_dir / "1" / "export.json").read_text())
            info["sha256"] = hashlib.sha256((model_dir / "1" / "model.onnx").read_bytes()).hexdigest()
            (model_dir / "1" / "export.json").write_text(json.dumps(info))
            client.model_unload("on_tensorrt")
            client.model_load("on_tensorrt")
            rebuilt = served_vectors(server.grpc_target, "on_tensorrt", minilm_ids)
    finally:
        server.stop()
    log = server.log_path.read_text()
    # Four instances: one builds, three wait and load what it built; then all four from the cache;
    # then one builds the new export's engine.
    assert log.count("float16 engine built in") == 2, log[-5000:]
    assert log.count("float16 engine loaded from the cache") == 3 + 4 + 3
    (directory,) = engine_directories(cache / "1")
    assert directory != first_directory and not first_directory.exists()
    assert json.loads((directory / "engine-key.json").read_text())["export_sha256"] == info["sha256"]
    for vectors in (first, rebuilt):
        assert row_cosines(vectors, reference).min() >= FLOAT16_MIN_COSINE
