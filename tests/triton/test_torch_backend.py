"""The GPU variant of the local model (embedsite_torch, configs/bundled-gpu.pbtxt), checked where no
GPU is: its PyTorch encoder against ONNX Runtime on the same model.onnx (float32 on the CPU, and
float16 within the issue's cosine 0.999), and the backend in a real Triton on KIND_CPU, rendered
from the shipped template with only the instance kind and precision changed."""

from __future__ import annotations

import asyncio
import json
import shutil

import numpy as np
import pytest
import torch

from embeddings.in_triton.backends.embedsite_torch.encoder import EncoderLoadError, load_encoder
from embeddings.tooling.model_configs import model_config_texts
from embeddings.tooling.model_export import model_export
from embeddings.triton.client import AsyncTritonClient
from embeddings.triton.errors import TritonInvalidInput
from tests.conftest import require_exported_model, start_triton
from tests.onnx_reference import reference_session, row_cosines, token_ids, vectors_for_ids
from tests.processes import REPO_ROOT
from tests.tiny_models import build_tiny_bert, embed_with_torch

MINILM_DIR = REPO_ROOT / "model_repository" / "minilm"
TEXTS = [
    "hello",
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé, 日本語のテキスト, and emoji 🚀 all tokenise.",
    "a much longer text about embeddings, tenants and quotas " * 12,
]
FLOAT32_MIN_COSINE = 0.99999
FLOAT16_MIN_COSINE = 0.999  # the bar for float16 against the CPU model


def padded(rows: list[list[int]], length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    length = length or max(len(ids) for ids in rows)
    input_ids = np.zeros((len(rows), length), dtype=np.int64)
    attention_mask = np.zeros_like(input_ids)
    for index, ids in enumerate(rows):
        input_ids[index, : len(ids)] = ids
        attention_mask[index, : len(ids)] = 1
    return input_ids, attention_mask


@pytest.fixture(scope="module")
def minilm_ids() -> list[list[int]]:
    require_exported_model(REPO_ROOT / "model_repository")
    return [token_ids(text)[:256] for text in TEXTS]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("dtype", "min_cosine"), [(torch.float32, FLOAT32_MIN_COSINE), (torch.float16, FLOAT16_MIN_COSINE)]
)
def test_the_encoder_agrees_with_onnx_runtime_on_minilm(minilm_ids, dtype, min_cosine):
    encoder = load_encoder(MINILM_DIR / "1" / "model.onnx", device="cpu", dtype=dtype)
    reference = vectors_for_ids(minilm_ids)  # each text alone, no padding

    # Padded past every row and past the longest: padding must change nothing.
    vectors = encoder.embed(*padded(minilm_ids, length=max(map(len, minilm_ids)) + 9))

    assert vectors.shape == (len(TEXTS), 384) and vectors.dtype == np.float32
    assert row_cosines(vectors, reference).min() >= min_cosine
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


@pytest.mark.unit
def test_an_empty_batch_gives_no_rows():
    encoder = load_encoder(MINILM_DIR / "1" / "model.onnx", device="cpu", dtype=torch.float32)
    assert encoder.embed(*padded([[101, 102]]))[:0].shape == (0, 384)


@pytest.mark.unit
@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_each_pooling_of_an_exported_bert_matches_pytorch(tmp_path, pooling):
    source = build_tiny_bert(tmp_path / "source", seed=4)
    result = model_export(
        source_dir=source, repository_dir=tmp_path / "repository", name="tiny", pooling=pooling
    )
    tokenizer_texts = ["hello", "a somewhat longer text to pad the other one", "x"]
    reference = embed_with_torch(source, tokenizer_texts, pooling=pooling)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(result.model_path.parent / "tokenizer.json"))
    rows = [encoding.ids for encoding in tokenizer.encode_batch(tokenizer_texts)]
    lengths = [sum(encoding.attention_mask) for encoding in tokenizer.encode_batch(tokenizer_texts)]
    rows = [ids[:length] for ids, length in zip(rows, lengths, strict=True)]

    encoder = load_encoder(result.model_path, device="cpu", dtype=torch.float32)

    assert row_cosines(encoder.embed(*padded(rows)), reference).min() >= FLOAT32_MIN_COSINE


@pytest.mark.unit
def test_an_export_of_another_architecture_is_refused_with_the_way_to_serve_it(tmp_path):
    source = build_tiny_bert(tmp_path / "source", model_type="distilbert", seed=5)
    result = model_export(source_dir=source, repository_dir=tmp_path / "repository", name="d", pooling="mean")

    with pytest.raises(EncoderLoadError, match=r"not 'distilbert'.*configs/gpu\.pbtxt"):
        load_encoder(result.model_path, device="cpu", dtype=torch.float32)


@pytest.mark.unit
def test_an_export_without_its_head_count_asks_for_a_new_export(tmp_path):
    version_dir = tmp_path / "minilm" / "1"
    version_dir.mkdir(parents=True)
    (version_dir / "model.onnx").symlink_to(MINILM_DIR / "1" / "model.onnx")
    info = json.loads((MINILM_DIR / "1" / "export.json").read_text())
    del info["attention_heads"]
    (version_dir / "export.json").write_text(json.dumps(info))

    with pytest.raises(EncoderLoadError, match="re-export"):
        load_encoder(version_dir / "model.onnx", device="cpu", dtype=torch.float32)


# The backend in a real Triton -------------------------------------------------------------------

CPU_CONFIG_NAME = "torch-cpu"


@pytest.fixture(scope="module")
def torch_cpu_triton(tmp_path_factory):
    """A Triton serving minilm through embedsite_torch on the CPU: the shipped bundled-gpu config with
    KIND_CPU and float32, chosen by --model-config-name like bundled-gpu is; minilm_tokenizer has no
    such config and keeps its config.pbtxt."""
    require_exported_model(REPO_ROOT / "model_repository")
    repository = tmp_path_factory.mktemp("repository")
    model_dir = repository / "minilm"
    (model_dir / "1").mkdir(parents=True)
    for file in (MINILM_DIR / "1").iterdir():
        if file.is_file():
            (model_dir / "1" / file.name).symlink_to(file)
    shutil.copyfile(MINILM_DIR / "config.pbtxt", model_dir / "config.pbtxt")
    template = model_config_texts(name="minilm", dims=384)["configs/bundled-gpu.pbtxt"]
    changes = [
        ("kind: KIND_GPU", "kind: KIND_CPU"),
        ('string_value: "float16"', 'string_value: "float32"'),
        ("count: 4", "count: 1"),
    ]
    for shipped, changed in changes:
        assert shipped in template
        template = template.replace(shipped, changed)
    (model_dir / "configs").mkdir()
    (model_dir / "configs" / f"{CPU_CONFIG_NAME}.pbtxt").write_text(template)
    (repository / "minilm_tokenizer").symlink_to(REPO_ROOT / "model_repository" / "minilm_tokenizer")
    # Its stop need not wait out a slow unload of the torch model (14 s once in a full run, 2 s
    # alone): after 5 s the launcher SIGKILLs the group and removes its shared memory.
    server = start_triton(
        tmp_path_factory.mktemp("triton"), [repository], model_config_name=CPU_CONFIG_NAME, stop_timeout_s=5
    )
    yield server
    server.stop()


def test_triton_serves_the_torch_backend_from_the_named_config(torch_cpu_triton, minilm_ids):
    async def run() -> tuple[list[np.ndarray], object, np.ndarray]:
        async with AsyncTritonClient(torch_cpu_triton.grpc_target) as client:
            spec = await client.model_metadata("minilm")
            # Concurrent requests of different lengths: the batcher hands them over together (ragged).
            alone = await asyncio.gather(
                *(client.embed_tokens("minilm", *padded([ids])) for ids in minilm_ids)
            )
            together = await client.embed_tokens("minilm", *padded(minilm_ids))
            return [row[0] for row in alone], spec, together

    alone, spec, together = asyncio.run(run())

    assert spec.max_batch_size == 512  # the bundled-gpu config, not config.pbtxt's 64
    reference = vectors_for_ids(minilm_ids)
    assert row_cosines(np.stack(alone), reference).min() >= FLOAT32_MIN_COSINE
    assert row_cosines(together, reference).min() >= FLOAT32_MIN_COSINE
    log = torch_cpu_triton.log_path.read_text()
    assert "embedsite_torch:" in log and "on cpu in float32" in log
    assert "sequence buckets [16, 32, 64, 96, 128, 160, 192, 224, 256]" in log


def test_a_bad_request_is_refused_alone_and_the_model_keeps_serving(torch_cpu_triton, minilm_ids):
    async def run():
        async with AsyncTritonClient(torch_cpu_triton.grpc_target, retries=0) as client:
            bad = np.array([[101, 10**6, 102]], dtype=np.int64)
            results = await asyncio.gather(
                client.embed_tokens("minilm", bad, np.ones_like(bad)),
                client.embed_tokens("minilm", *padded(minilm_ids[:2])),
                return_exceptions=True,
            )
            return results

    refused, served = asyncio.run(run())

    assert isinstance(refused, TritonInvalidInput) and "token ids" in str(refused)
    assert row_cosines(served, vectors_for_ids(minilm_ids[:2])).min() >= FLOAT32_MIN_COSINE


def test_the_tokenizer_model_beside_it_keeps_its_own_config(torch_cpu_triton):
    async def run():
        async with AsyncTritonClient(torch_cpu_triton.grpc_target) as client:
            return await client.model_ready("minilm_tokenizer")

    assert asyncio.run(run())
    assert reference_session() is not None
