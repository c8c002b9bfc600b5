"""The GPU variant of the local model (embedsite_torch, configs/bundled-gpu.pbtxt), checked where no
GPU is: its PyTorch encoder against ONNX Runtime on the same model.onnx (float32 on the CPU, and
float16 within the issue's cosine 0.999), and the backend in a real Triton on KIND_CPU, rendered
from the shipped template with only the instance kind and precision changed.

A BERT cross-encoder's export (`--task rerank`) as well: its scores are compared as numbers, within
SCORE_TOLERANCE (1e-4 absolute on raw logits; float32 reorderings differ by under 1e-5), against ONNX
Runtime on the same padded batch and against PyTorch scoring each pair alone."""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from embeddings.in_triton.backends.embedsite_torch import encoder as encoder_module
from embeddings.in_triton.backends.embedsite_torch.encoder import EncoderLoadError, load_encoder
from embeddings.tokenization import TextTokenizer, TokenizedBatch
from embeddings.tooling.export_threads import cpu_session
from embeddings.tooling.model_configs import model_config_texts
from embeddings.tooling.model_export import model_export
from embeddings.triton.client import AsyncTritonClient
from embeddings.triton.errors import TritonInvalidInput, TritonModelLoadFailed
from tests.conftest import require_exported_model, start_triton
from tests.onnx_reference import (
    MIXED_TEXTS,
    padded_ids,
    reference_session,
    row_cosines,
    token_ids,
    vectors_for_ids,
)
from tests.processes import REPO_ROOT
from tests.tiny_models import build_tiny_bert, embed_with_torch, score_with_torch

MINILM_DIR = REPO_ROOT / "model_repository" / "minilm"
FLOAT32_MIN_COSINE = 0.99999
FLOAT16_MIN_COSINE = 0.999  # the bar for float16 against the CPU model


@pytest.fixture(scope="module")
def minilm_ids() -> list[list[int]]:
    require_exported_model(REPO_ROOT / "model_repository")
    return [token_ids(text)[:256] for text in MIXED_TEXTS]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("dtype", "min_cosine"), [(torch.float32, FLOAT32_MIN_COSINE), (torch.float16, FLOAT16_MIN_COSINE)]
)
def test_the_encoder_agrees_with_onnx_runtime_on_minilm(minilm_ids, dtype, min_cosine):
    encoder = load_encoder(MINILM_DIR / "1" / "model.onnx", device="cpu", dtype=dtype)
    reference = vectors_for_ids(minilm_ids)  # each text alone, no padding

    # Padded past every row and past the longest: padding must change nothing.
    vectors = encoder.embed(*padded_ids(minilm_ids, length=max(map(len, minilm_ids)) + 9))

    assert vectors.shape == (len(MIXED_TEXTS), 384) and vectors.dtype == np.float32
    assert row_cosines(vectors, reference).min() >= min_cosine
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


@pytest.mark.unit
def test_an_empty_batch_gives_no_rows():
    encoder = load_encoder(MINILM_DIR / "1" / "model.onnx", device="cpu", dtype=torch.float32)
    assert encoder.embed(*padded_ids([[101, 102]]))[:0].shape == (0, 384)


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

    assert row_cosines(encoder.embed(*padded_ids(rows)), reference).min() >= FLOAT32_MIN_COSINE


@pytest.mark.unit
@pytest.mark.parametrize(
    ("model_type", "task"),
    [("distilbert", "embed"), ("xlm-roberta", "rerank")],
    ids=["embedding", "cross-encoder"],
)
def test_an_export_of_another_architecture_is_refused_with_the_way_to_serve_it(tmp_path, model_type, task):
    source = build_tiny_bert(
        tmp_path / "source", model_type=model_type, seed=5, cross_encoder=task == "rerank"
    )
    result = model_export(
        source_dir=source,
        repository_dir=tmp_path / "repository",
        name="other",
        pooling="mean" if task == "embed" else None,
        task=task,
    )

    with pytest.raises(EncoderLoadError, match=rf"not '{model_type}'.*configs/gpu\.pbtxt"):
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


@pytest.fixture(scope="module")
def int8_export(tmp_path_factory) -> Path:
    """A tiny BERT's int8 export (MatMulInteger on int8 weights), version 1 of Triton model
    `tiny_int8` with the configs export_model writes beside it: its model folder."""
    root = tmp_path_factory.mktemp("int8")
    source = build_tiny_bert(root / "source", seed=6)
    # A random BERT agrees less with its int8 graph than a trained one: the threshold only needs to pass.
    repository = root / "repository"
    result = model_export(
        source_dir=source, repository_dir=repository, name="tiny_int8", dtype="int8", min_variant_cosine=0.5
    )
    return result.model_path.parent.parent


@pytest.mark.unit
def test_an_int8_export_is_refused_by_its_dtype_with_the_ways_to_serve_it(int8_export):
    with pytest.raises(EncoderLoadError) as refused:
        load_encoder(int8_export / "1" / "model.onnx", device="cpu", dtype=torch.float32)
    message = str(refused.value)
    assert "export.json records dtype 'int8'" in message
    assert "Serve version 1 of tiny_int8 with the CPU config" in message
    assert "manage.py register_model --triton-model tiny_int8 --dtype float32" in message


@pytest.mark.unit
@pytest.mark.parametrize(
    ("dtype", "loads"), [(None, True), ("float32", True), ("float16", True), ("int4", False)]
)
def test_the_dtype_export_json_records_decides_before_any_weight_is_read(tmp_path, monkeypatch, dtype, loads):
    """MiniLM's float32 graph under each recorded dtype (absent: an export from before dtypes were
    recorded, float32): a float export loads, any other is refused without reading the graph."""
    version_dir = tmp_path / "minilm" / "1"
    version_dir.mkdir(parents=True)
    (version_dir / "model.onnx").symlink_to(MINILM_DIR / "1" / "model.onnx")
    info = json.loads((MINILM_DIR / "1" / "export.json").read_text())
    info.pop("dtype", None)
    (version_dir / "export.json").write_text(json.dumps(info if dtype is None else {**info, "dtype": dtype}))
    if loads:
        assert load_encoder(version_dir / "model.onnx", device="cpu", dtype=torch.float32).dims == 384
        return
    monkeypatch.setattr(encoder_module, "read_onnx_weights", lambda path: pytest.fail("the graph was read"))
    with pytest.raises(EncoderLoadError, match=r"export\.json records dtype 'int4'"):
        load_encoder(version_dir / "model.onnx", device="cpu", dtype=torch.float32)


# A BERT cross-encoder (a rerank model) ----------------------------------------------------------

SCORE_TOLERANCE = 1e-4  # absolute, on raw logits (within +-5 here)
QUERY = "what does triton batch?"
DOCUMENTS = [
    "yes",
    "Triton batches requests of different lengths together, padded to one length.",
    "Ünïcödé àccents, 日本語のテキスト and emoji 🚀 in one document.",
    # Past the tiny model's 128 tokens: the pair is cut at the model's maximum (the document only).
    " ".join(f"word{i} of a long document" for i in range(60)),
]


@dataclass(frozen=True)
class CrossEncoderExport:
    source: Path  # the Hugging Face checkpoint: PyTorch's reference
    model_dir: Path  # <repository>/reranker, with the configs model_export wrote
    version_dir: Path


def export_cross_encoder(directory: Path, *, trained: bool) -> CrossEncoderExport:
    """A tiny random BERT cross-encoder and its export. `trained`: its biases and LayerNorm scales
    random too, as a trained model's are; a fresh model's are all 0 and 1, which the exporter stores
    once and aliases by Identity nodes, and which would hide a bias read from the wrong parameter."""
    source = build_tiny_bert(directory / "source", seed=11, cross_encoder=True)
    if trained:
        from transformers import AutoModelForSequenceClassification

        model = AutoModelForSequenceClassification.from_pretrained(str(source), local_files_only=True)
        generator = torch.Generator().manual_seed(12)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith(".bias"):
                    parameter.copy_(0.2 * torch.randn(parameter.shape, generator=generator))
                elif name.endswith("LayerNorm.weight"):
                    parameter.copy_(1 + 0.2 * torch.randn(parameter.shape, generator=generator))
        model.save_pretrained(str(source), safe_serialization=True)
    result = model_export(
        source_dir=source, repository_dir=directory / "repository", name="reranker", task="rerank"
    )
    version_dir = result.model_path.parent
    return CrossEncoderExport(source=source, model_dir=version_dir.parent, version_dir=version_dir)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory) -> CrossEncoderExport:
    return export_cross_encoder(tmp_path_factory.mktemp("cross_encoder"), trained=True)


@pytest.fixture(scope="module")
def fresh_cross_encoder(tmp_path_factory) -> CrossEncoderExport:
    return export_cross_encoder(tmp_path_factory.mktemp("fresh_cross_encoder"), trained=False)


def tokenized_pairs(export: CrossEncoderExport) -> TokenizedBatch:
    """QUERY with each document as the service pairs them: one right-padded batch, with token types."""
    return TextTokenizer.from_file(export.version_dir / "tokenizer.json").encode_pairs(QUERY, DOCUMENTS)


def onnx_runtime_scores(export: CrossEncoderExport, batch: TokenizedBatch, token_type_ids=None) -> np.ndarray:
    session = cpu_session(export.version_dir / "model.onnx")
    inputs = {
        "input_ids": batch.input_ids,
        "attention_mask": batch.attention_mask,
        "token_type_ids": batch.token_type_ids if token_type_ids is None else token_type_ids,
    }
    (scores,) = session.run(["score"], inputs)
    return scores


@pytest.mark.unit
@pytest.mark.parametrize("weights", ["cross_encoder", "fresh_cross_encoder"])
def test_a_bert_cross_encoder_scores_pairs_as_onnx_runtime_and_pytorch_do(request, weights):
    export = request.getfixturevalue(weights)
    batch = tokenized_pairs(export)
    lengths = batch.attention_mask.sum(axis=1)
    assert batch.truncated.tolist() == [False, False, False, True] and lengths.max() == 128
    assert len(set(lengths.tolist())) == len(DOCUMENTS), "padded: every pair has its own length"

    encoder = load_encoder(export.version_dir / "model.onnx", device="cpu", dtype=torch.float32)
    scores = encoder.embed(batch.input_ids, batch.attention_mask, batch.token_type_ids)

    assert scores.shape == (len(DOCUMENTS), 1) and scores.dtype == np.float32 and encoder.dims == 1
    on_onnx_runtime = onnx_runtime_scores(export, batch)  # the same padded batch
    reference = score_with_torch(export.source, QUERY, DOCUMENTS)  # each pair alone, no padding
    np.testing.assert_allclose(scores, on_onnx_runtime, rtol=0, atol=SCORE_TOLERANCE)
    np.testing.assert_allclose(scores[:, 0], reference, rtol=0, atol=SCORE_TOLERANCE)
    # The pairs score apart by far more than the tolerance: the comparison is not of constants.
    assert np.ptp(reference) > 100 * SCORE_TOLERANCE, reference


@pytest.mark.unit
def test_a_bert_cross_encoder_reads_the_pairs_token_types(cross_encoder):
    batch = tokenized_pairs(cross_encoder)
    encoder = load_encoder(cross_encoder.version_dir / "model.onnx", device="cpu", dtype=torch.float32)
    all_type_0 = np.zeros_like(batch.token_type_ids)

    scores = encoder.embed(batch.input_ids, batch.attention_mask, batch.token_type_ids)
    as_one_segment = encoder.embed(batch.input_ids, batch.attention_mask, all_type_0)

    assert batch.token_type_ids.any()
    # Every pair's score moves (by 0.14 and more here): the documents' type-1 tokens are read.
    assert np.abs(scores - as_one_segment).min() > SCORE_TOLERANCE
    # And as ONNX Runtime's does: the token types, not some other input, made the difference.
    np.testing.assert_allclose(
        as_one_segment, onnx_runtime_scores(cross_encoder, batch, all_type_0), rtol=0, atol=SCORE_TOLERANCE
    )
    with pytest.raises(ValueError, match="takes token_type_ids"):
        encoder.embed(batch.input_ids, batch.attention_mask)


@pytest.mark.unit
def test_a_rerank_export_without_a_classification_head_is_refused(tmp_path):
    version_dir = tmp_path / "reranker" / "1"
    version_dir.mkdir(parents=True)
    (version_dir / "model.onnx").symlink_to(MINILM_DIR / "1" / "model.onnx")
    info = json.loads((MINILM_DIR / "1" / "export.json").read_text())
    (version_dir / "export.json").write_text(json.dumps({**info, "task": "rerank", "pooling": None}))

    with pytest.raises(EncoderLoadError, match="not a BERT sequence classifier graph: missing pooler"):
        load_encoder(version_dir / "model.onnx", device="cpu", dtype=torch.float32)


# The backend in a real Triton -------------------------------------------------------------------

CPU_CONFIG_NAME = "torch-cpu"


def add_torch_cpu_model(repository: Path, name: str, model_dir: Path, bundled_gpu_config: str) -> None:
    """Model `name` in `repository`: version 1's files linked from `model_dir`, its config.pbtxt, and
    configs/torch-cpu.pbtxt, the shipped bundled-gpu config with KIND_CPU, float32, one instance."""
    (repository / name / "1").mkdir(parents=True)
    for file in (model_dir / "1").iterdir():
        if file.is_file():
            (repository / name / "1" / file.name).symlink_to(file)
    shutil.copyfile(model_dir / "config.pbtxt", repository / name / "config.pbtxt")
    changes = [
        ("kind: KIND_GPU", "kind: KIND_CPU"),
        ('string_value: "float16"', 'string_value: "float32"'),
        ("count: 4", "count: 1"),
    ]
    for shipped, changed in changes:
        assert shipped in bundled_gpu_config
        bundled_gpu_config = bundled_gpu_config.replace(shipped, changed)
    (repository / name / "configs").mkdir()
    (repository / name / "configs" / f"{CPU_CONFIG_NAME}.pbtxt").write_text(bundled_gpu_config)


@pytest.fixture(scope="module")
def torch_cpu_triton(tmp_path_factory, cross_encoder, int8_export):
    """A Triton serving minilm and a tiny BERT cross-encoder (`reranker`) through embedsite_torch on
    the CPU: the shipped bundled-gpu config with KIND_CPU and float32, chosen by --model-config-name
    like bundled-gpu is; minilm_tokenizer has no such config and keeps its config.pbtxt. Beside
    them, not loaded at start (explicit model control, as `make run`), a tiny int8 export
    (`tiny_int8`) with the same config."""
    require_exported_model(REPO_ROOT / "model_repository")
    repository = tmp_path_factory.mktemp("repository")
    add_torch_cpu_model(
        repository,
        "minilm",
        MINILM_DIR,
        model_config_texts(name="minilm", dims=384)["configs/bundled-gpu.pbtxt"],
    )
    # The cross-encoder's as its export wrote it (score output, token_type_ids input).
    add_torch_cpu_model(
        repository,
        "reranker",
        cross_encoder.model_dir,
        (cross_encoder.model_dir / "configs" / "bundled-gpu.pbtxt").read_text(),
    )
    add_torch_cpu_model(
        repository,
        "tiny_int8",
        int8_export,
        (int8_export / "configs" / "bundled-gpu.pbtxt").read_text(),
    )
    (repository / "minilm_tokenizer").symlink_to(REPO_ROOT / "model_repository" / "minilm_tokenizer")
    # Its stop need not wait out a slow unload of the torch model (14 s once in a full run, 2 s
    # alone): after 5 s the launcher SIGKILLs the group and removes its shared memory.
    server = start_triton(
        tmp_path_factory.mktemp("triton"),
        [repository],
        model_config_name=CPU_CONFIG_NAME,
        model_control_mode="explicit",
        startup_models=["minilm", "reranker", "minilm_tokenizer"],
        stop_timeout_s=5,
    )
    yield server
    server.stop(timeout_s=0)


def test_triton_serves_the_torch_backend_from_the_named_config(torch_cpu_triton, minilm_ids):
    async def run() -> tuple[list[np.ndarray], object, np.ndarray]:
        async with AsyncTritonClient(torch_cpu_triton.grpc_target) as client:
            spec = await client.model_metadata("minilm")
            # Concurrent requests of different lengths: the batcher hands them over together (ragged).
            alone = await asyncio.gather(
                *(client.embed_tokens("minilm", *padded_ids([ids])) for ids in minilm_ids)
            )
            together = await client.embed_tokens("minilm", *padded_ids(minilm_ids))
            return [row[0] for row in alone], spec, together

    alone, spec, together = asyncio.run(run())

    assert spec.max_batch_size == 512  # the bundled-gpu config, not config.pbtxt's 64
    reference = vectors_for_ids(minilm_ids)
    assert row_cosines(np.stack(alone), reference).min() >= FLOAT32_MIN_COSINE
    assert row_cosines(together, reference).min() >= FLOAT32_MIN_COSINE
    log = torch_cpu_triton.log_path.read_text()
    assert "minilm/1/model.onnx (embed) on cpu in float32" in log
    assert "sequence buckets [16, 32, 64, 96, 128, 160, 192, 224, 256]" in log


def test_a_bad_request_is_refused_alone_and_the_model_keeps_serving(torch_cpu_triton, minilm_ids):
    async def run():
        async with AsyncTritonClient(torch_cpu_triton.grpc_target, retries=0) as client:
            bad = np.array([[101, 10**6, 102]], dtype=np.int64)
            results = await asyncio.gather(
                client.embed_tokens("minilm", bad, np.ones_like(bad)),
                client.embed_tokens("minilm", *padded_ids(minilm_ids[:2])),
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


def test_triton_serves_a_bert_cross_encoder_through_the_torch_backend(torch_cpu_triton, cross_encoder):
    batch = tokenized_pairs(cross_encoder)

    async def run():
        async with AsyncTritonClient(torch_cpu_triton.grpc_target) as client:
            spec = await client.model_metadata("reranker")
            # Each pair unpadded and concurrently: ragged requests with token types, merged and
            # padded to a bucket by the backend.
            alone = await asyncio.gather(
                *(
                    client.embed_tokens(
                        "reranker",
                        batch.input_ids[row : row + 1, :count],
                        batch.attention_mask[row : row + 1, :count],
                        token_type_ids=batch.token_type_ids[row : row + 1, :count],
                    )
                    for row, count in enumerate(batch.token_counts)
                )
            )
            together = await client.embed_tokens(
                "reranker", batch.input_ids, batch.attention_mask, token_type_ids=batch.token_type_ids
            )
            return spec, np.concatenate(alone), together

    spec, alone, together = asyncio.run(run())

    assert spec.input("token_type_ids") is not None and spec.embedding_output().name == "score"
    reference = onnx_runtime_scores(cross_encoder, batch)
    assert together.shape == (len(DOCUMENTS), 1)
    np.testing.assert_allclose(together, reference, rtol=0, atol=SCORE_TOLERANCE)
    np.testing.assert_allclose(alone, reference, rtol=0, atol=SCORE_TOLERANCE)
    log = torch_cpu_triton.log_path.read_text()
    assert "reranker/1/model.onnx (rerank) on cpu in float32, sequence buckets [16, 32, 64, 96, 128]" in log


def test_triton_refuses_to_load_an_int8_export_through_the_torch_backend_saying_why(torch_cpu_triton):
    async def load():
        async with AsyncTritonClient(torch_cpu_triton.grpc_target) as client:
            await client.model_load("tiny_int8")

    with pytest.raises(TritonModelLoadFailed) as failed:
        asyncio.run(load())

    # Triton's own load error carries the backend's reason: no log reading needed to learn why.
    reason = failed.value.reason
    assert "export.json records dtype 'int8'" in reason, reason
    assert "register_model --triton-model tiny_int8 --dtype float32" in reason, reason
