"""Exports of tiny random-weight encoders (tests/tiny_models.py): each pooling and architecture
against PyTorch, the Triton configs written beside them, and numbered versions."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
from django.core.management import CommandError, call_command
from google.protobuf import text_format

from embeddings.services.inference.exports import (
    POOLINGS,
    ModelExportError,
    model_export_exists,
    model_export_info,
    model_export_path,
    model_export_versions,
)
from embeddings.tooling.export_threads import cpu_session
from embeddings.tooling.model_export import SUPPORTED_MODEL_TYPES, model_export
from embeddings.triton.protocol import model_config_pb2
from tests.onnx_reference import row_cosines
from tests.tiny_models import build_tiny_bert, embed_with_torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MIN_COSINE = 0.9999
TEXTS = [
    "hello",
    "",
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé àccents, 日本語のテキスト and emoji 🚀 in one input.",
    "How do I reset my password?",
    # Past the tiny models' 128 tokens: the export must truncate where the model's positions end.
    " ".join(f"word{i} of a long document" for i in range(60)),
]


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), seed=1)


@pytest.fixture(scope="module")
def other_tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same shape, other weights: what a retrained model looks like."""
    return build_tiny_bert(tmp_path_factory.mktemp("other-tiny-bert"), seed=2)


def served_vectors(version_dir: Path, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The exported graph on one right-padded batch, tokenised by the exported tokenizer.json."""
    from tokenizers import Tokenizer

    encodings = Tokenizer.from_file(str(version_dir / "tokenizer.json")).encode_batch(texts)
    input_ids = np.array([encoding.ids for encoding in encodings], dtype=np.int64)
    attention_mask = np.array([encoding.attention_mask for encoding in encodings], dtype=np.int64)
    session = cpu_session(version_dir / "model.onnx")
    (vectors,) = session.run(["embedding"], {"input_ids": input_ids, "attention_mask": attention_mask})
    return vectors, attention_mask


def parsed_config(path: Path) -> model_config_pb2.ModelConfig:
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig(), allow_unknown_field=True)


def export_command(*args: str) -> str:
    stdout = io.StringIO()
    call_command("export_model", *args, stdout=stdout)
    return stdout.getvalue()


@pytest.mark.parametrize("pooling", POOLINGS)
def test_each_pooling_matches_pytorch_on_a_padded_batch(tiny_bert, tmp_path, pooling):
    result = model_export(source_dir=tiny_bert, repository_dir=tmp_path, name="tiny", pooling=pooling)

    assert (result.version, result.model_type, result.dims, result.max_tokens) == (1, "bert", 128, 128)
    vectors, attention_mask = served_vectors(tmp_path / "tiny" / "1", TEXTS)
    lengths = attention_mask.sum(axis=1)
    assert lengths.max() == 128 and lengths.min() == 2, "padded, and truncated at the model's 128"
    assert vectors.shape == (len(TEXTS), 128)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    cosines = row_cosines(vectors, embed_with_torch(tiny_bert, TEXTS, pooling=pooling))
    assert cosines.min() >= MIN_COSINE, cosines
    assert result.min_cosine >= MIN_COSINE
    # The option really changes the graph: each other pooling is far from these vectors.
    for other in set(POOLINGS) - {pooling}:
        assert row_cosines(vectors, embed_with_torch(tiny_bert, TEXTS, pooling=other)).min() < 0.99, other


def test_the_export_is_a_servable_model_folder(tiny_bert, tmp_path):
    result = model_export(source_dir=tiny_bert, repository_dir=tmp_path, name="tiny_cls", pooling="cls")

    model_dir = tmp_path / "tiny_cls"
    info = json.loads((model_dir / "1" / "export.json").read_text())
    assert {key: info[key] for key in ("name", "version", "model_type", "pooling", "dims", "max_tokens")} == {
        "name": "tiny_cls",
        "version": 1,
        "model_type": "bert",
        "pooling": "cls",
        "dims": 128,
        "max_tokens": 128,
    }
    assert info["pad_token_id"] == 0  # MiniLM's [PAD], the id the service pads with
    assert info["sha256"] == result.sha256
    assert json.loads((model_dir / "1" / "tokenizer.json").read_text())["padding"]["direction"] == "Right"
    configs = {
        path: parsed_config(model_dir / path)
        for path in ("config.pbtxt", "configs/cpu.pbtxt", "configs/gpu.pbtxt", "configs/bundled-gpu.pbtxt")
    }
    for path, config in configs.items():
        assert config.name == "tiny_cls", path
        assert [list(output.dims) for output in config.output] == [[128]], path
    assert configs["config.pbtxt"].backend == "embedsite_onnx"
    assert configs["configs/gpu.pbtxt"].platform == "onnxruntime_onnx"
    assert configs["configs/bundled-gpu.pbtxt"].backend == "embedsite_torch"
    assert info["attention_heads"] == 2  # what the GPU backend reads besides model.onnx
    # Nothing else: no scratch directory left where Triton looks for versions.
    assert sorted(path.name for path in model_dir.iterdir()) == ["1", "config.pbtxt", "configs"]


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_each_supported_architecture_matches_pytorch(tmp_path, model_type):
    source = build_tiny_bert(tmp_path / "source", model_type=model_type, seed=3)
    result = model_export(source_dir=source, repository_dir=tmp_path / "repository", name="m", pooling="cls")

    assert (result.model_type, result.dims, result.max_tokens) == (model_type, 128, 128)
    vectors, _ = served_vectors(tmp_path / "repository" / "m" / "1", TEXTS)
    assert row_cosines(vectors, embed_with_torch(source, TEXTS, pooling="cls")).min() >= MIN_COSINE


def test_an_unsupported_architecture_is_refused_before_anything_is_written(tmp_path, tiny_bert):
    from transformers import AutoConfig

    source = tmp_path / "gpt2"
    AutoConfig.for_model("gpt2", n_embd=64, n_layer=1, n_head=2).save_pretrained(str(source))
    (source / "tokenizer.json").write_bytes((tiny_bert / "tokenizer.json").read_bytes())
    (source / "model.safetensors").write_bytes(b"never read")

    with pytest.raises(
        CommandError, match=r"is a 'gpt2' model; export_model exports encoders of type bert, "
    ):
        export_command("--source", str(source), "--repository", str(tmp_path / "repository"), "--name", "g")
    assert not (tmp_path / "repository").exists()


@pytest.mark.parametrize("name", ["../escape", "a/b", ".hidden", 'x"y', ""])
def test_a_name_that_is_not_a_plain_folder_name_is_refused(tmp_path, tiny_bert, name):
    with pytest.raises(CommandError, match="invalid model name"):
        export_command(
            "--source", str(tiny_bert), "--repository", str(tmp_path / "repository"), "--name", name
        )
    assert not (tmp_path / "repository").exists() and not (tmp_path / "escape").exists()


@pytest.mark.parametrize("version", ["0", "-1", "two", "1.5"])
def test_a_version_that_is_not_a_whole_number_from_1_is_refused(tmp_path, tiny_bert, version):
    with pytest.raises(CommandError, match="a version is a whole number from 1"):
        export_command("--source", str(tiny_bert), "--repository", str(tmp_path), "--version", version)


def test_versions(tmp_path, tiny_bert, other_tiny_bert):
    repository = tmp_path / "repository"
    common = ("--repository", str(repository), "--name", "tiny")

    def sha256(version: int) -> str:
        return model_export_info(repository_dir=repository, name="tiny", version=version)["sha256"]

    # A new name starts at 1; exporting it again makes version 2 and leaves 1 as it was.
    assert "(version 1, bert, 128 dims" in export_command("--source", str(tiny_bert), *common)
    first = sha256(1)
    assert "(version 2, bert, 128 dims" in export_command("--source", str(tiny_bert), *common)
    assert model_export_versions(repository_dir=repository, name="tiny") == [1, 2]
    assert sha256(1) == first
    assert (
        model_export_path(repository_dir=repository, name="tiny") == repository / "tiny" / "2" / "model.onnx"
    )
    assert model_export_info(repository_dir=repository, name="tiny")["version"] == 2

    # Another width under the same name is refused: versions share a config, and vectors their width.
    narrow = build_tiny_bert(tmp_path / "narrow", hidden_size=64)
    with pytest.raises(
        CommandError,
        match=r"model tiny has 128-dimensional embeddings \(versions 1, 2\); this "
        r"model's are 64-dimensional: export it under another name \(--name\)",
    ):
        export_command("--source", str(narrow), *common)
    assert model_export_versions(repository_dir=repository, name="tiny") == [1, 2]
    assert sorted(path.name for path in (repository / "tiny").iterdir()) == [
        "1",
        "2",
        "config.pbtxt",
        "configs",
    ]
    assert list(parsed_config(repository / "tiny" / "config.pbtxt").output[0].dims) == [128]

    # --version N writes exactly N, replacing it: other weights, same version.
    assert "(version 1, bert" in export_command("--source", str(other_tiny_bert), "--version", "1", *common)
    assert sha256(1) != first
    assert model_export_versions(repository_dir=repository, name="tiny") == [1, 2]

    # --if-missing checks the latest version (or the one given) and keeps it while it is current...
    latest = sha256(2)
    assert "is already exported; skipping" in export_command(
        "--source", str(tiny_bert), "--if-missing", *common
    )
    assert "skipping" in export_command(
        "--source", str(other_tiny_bert), "--if-missing", "--version", "1", *common
    )
    assert model_export_versions(repository_dir=repository, name="tiny") == [1, 2]
    # ...redoes the version given when it is outdated...
    output = export_command(
        "--source", str(tiny_bert), "--if-missing", "--version", "2", "--pooling", "cls", *common
    )
    assert "mean pooling, not cls); exporting version 2 again" in output
    assert model_export_info(repository_dir=repository, name="tiny", version=2)["pooling"] == "cls"
    assert sha256(2) != latest
    # ...and exports a new version when the latest is outdated (here: another source directory).
    output = export_command("--source", str(other_tiny_bert), "--if-missing", "--pooling", "cls", *common)
    assert f"it was exported from {tiny_bert.resolve()}, not {other_tiny_bert.resolve()}" in output
    assert "exporting a new version" in output and "(version 3, bert" in output
    # A version that is not there is exported as that version.
    assert "(version 5, bert" in export_command(
        "--source", str(tiny_bert), "--if-missing", "--version", "5", *common
    )
    assert model_export_versions(repository_dir=repository, name="tiny") == [1, 2, 3, 5]
    assert not model_export_exists(repository_dir=repository, name="tiny", version=4)


def test_an_unfinished_version_is_not_a_version(tmp_path, tiny_bert):
    model_export(source_dir=tiny_bert, repository_dir=tmp_path, name="tiny", pooling="mean")
    (tmp_path / "tiny" / "2").mkdir()  # e.g. a replacement cut short: no export.json
    (tmp_path / "tiny" / "2" / "model.onnx").write_bytes(b"half")
    (tmp_path / "tiny" / "notes").mkdir()

    assert model_export_versions(repository_dir=tmp_path, name="tiny") == [1]
    assert model_export_exists(repository_dir=tmp_path, name="tiny")
    assert not model_export_exists(repository_dir=tmp_path, name="tiny", version=2)
    # The next export takes the unfinished number over and finishes it.
    result = model_export(source_dir=tiny_bert, repository_dir=tmp_path, name="tiny", pooling="mean")
    assert result.version == 2
    assert model_export_info(repository_dir=tmp_path, name="tiny", version="2")["sha256"] == result.sha256


def test_the_only_version_may_be_replaced_by_another_width(tmp_path, tiny_bert):
    model_export(source_dir=tiny_bert, repository_dir=tmp_path, name="tiny", pooling="mean")
    narrow = build_tiny_bert(tmp_path / "narrow", hidden_size=64)

    result = model_export(source_dir=narrow, repository_dir=tmp_path, name="tiny", pooling="mean", version=1)

    assert (result.version, result.dims) == (1, 64)
    for path in ("config.pbtxt", "configs/cpu.pbtxt", "configs/gpu.pbtxt", "configs/bundled-gpu.pbtxt"):
        assert list(parsed_config(tmp_path / "tiny" / path).output[0].dims) == [64], path
    with pytest.raises(ModelExportError, match="64-dimensional embeddings"):
        model_export(source_dir=tiny_bert, repository_dir=tmp_path, name="tiny", pooling="mean")
