"""Exports of tiny random-weight cross-encoders (rerank models, tests/tiny_models.py): each
architecture's ONNX scores against PyTorch's on padded pair batches, what export.json and the
Triton configs say, and what the export refuses.

Scores are compared as numbers (a cosine of score vectors means nothing): |ONNX - PyTorch| <= 1e-4,
relative for scores above 1 in size (model_export.MAX_SCORE_DIFFERENCE)."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
from django.core.management import CommandError, call_command
from google.protobuf import text_format

from embeddings.tooling.export_threads import cpu_session
from embeddings.tooling.model_export import MAX_SCORE_DIFFERENCE, SUPPORTED_MODEL_TYPES, model_export
from embeddings.triton.protocol import model_config_pb2
from tests.tiny_models import build_tiny_bert, score_with_torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

QUERY = "what do tenants pay for?"
DOCUMENTS = [
    "",
    "Tenants pay for the tokens their requests use.",
    "Ünïcödé àccents, 日本語のテキスト and emoji 🚀 in one document.",
    # Past the tiny models' 128 tokens: only the document is cut, the query kept whole.
    " ".join(f"word{i} of a long document" for i in range(60)),
]


def onnx_scores(version_dir: Path, query: str, documents: list[str]) -> tuple[np.ndarray, dict]:
    """The exported graph on one right-padded batch of pairs, as the exported tokenizer pairs them
    (the document truncated to fit), fed the inputs export.json lists."""
    from tokenizers import Tokenizer

    info = json.loads((version_dir / "export.json").read_text())
    tokenizer = Tokenizer.from_file(str(version_dir / "tokenizer.json"))
    tokenizer.enable_truncation(max_length=info["max_tokens"], strategy="only_second")
    encodings = tokenizer.encode_batch([(query, document) for document in documents])
    arrays = {
        "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
        "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
        "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
    }
    session = cpu_session(version_dir / "model.onnx")
    assert [tensor.name for tensor in session.get_inputs()] == info["inputs"]
    (scores,) = session.run(["score"], {name: arrays[name] for name in info["inputs"]})
    return scores, arrays


def parsed_config(path: Path) -> model_config_pb2.ModelConfig:
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig(), allow_unknown_field=True)


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_each_architecture_scores_pairs_as_pytorch_does(tmp_path, model_type):
    source = build_tiny_bert(tmp_path / "source", model_type=model_type, seed=4, cross_encoder=True)
    result = model_export(source_dir=source, repository_dir=tmp_path / "repository", name="ce", task="rerank")

    assert (result.task, result.model_type, result.dims, result.max_tokens) == ("rerank", model_type, 1, 128)
    scores, arrays = onnx_scores(tmp_path / "repository" / "ce" / "1", QUERY, DOCUMENTS)
    assert scores.shape == (len(DOCUMENTS), 1) and scores.dtype == np.float32
    lengths = arrays["attention_mask"].sum(axis=1)
    assert lengths.max() == 128 and lengths.min() < 20, "padded, and truncated at the model's 128"
    reference = score_with_torch(source, QUERY, DOCUMENTS)
    np.testing.assert_allclose(scores[:, 0], reference, rtol=0, atol=MAX_SCORE_DIFFERENCE)
    assert result.max_score_difference <= MAX_SCORE_DIFFERENCE
    # Random weights still tell documents apart: the comparison above is not of constants.
    assert np.ptp(reference) > 1e-3, reference


def test_a_bert_cross_encoder_reads_the_pairs_token_types(tmp_path):
    source = build_tiny_bert(tmp_path / "source", seed=5, cross_encoder=True)
    result = model_export(source_dir=source, repository_dir=tmp_path / "repository", name="ce", task="rerank")

    assert result.inputs == ("input_ids", "attention_mask", "token_type_ids")
    version_dir = tmp_path / "repository" / "ce" / "1"
    scores, arrays = onnx_scores(version_dir, QUERY, DOCUMENTS[1:3])
    assert set(arrays["token_type_ids"][0].tolist()) == {0, 1}
    # The same ids read as one segment score otherwise: the graph uses the types it is given.
    session = cpu_session(version_dir / "model.onnx")
    flat = dict(arrays, token_type_ids=np.zeros_like(arrays["token_type_ids"]))
    (untyped,) = session.run(["score"], flat)
    assert np.abs(untyped - scores).max() > 1e-4


def test_export_json_and_configs_describe_a_rerank_model(tmp_path):
    source = build_tiny_bert(tmp_path / "source", model_type="xlm-roberta", seed=6, cross_encoder=True)
    stdout = io.StringIO()
    call_command(
        "export_model",
        "--source", str(source),
        "--repository", str(tmp_path / "repository"),
        "--name", "tiny_reranker",
        "--task", "rerank",
        stdout=stdout,
    )  # fmt: skip
    assert "cross-encoder, sigmoid scores, inputs input_ids, attention_mask" in stdout.getvalue()
    assert "max score difference vs PyTorch" in stdout.getvalue()

    model_dir = tmp_path / "repository" / "tiny_reranker"
    info = json.loads((model_dir / "1" / "export.json").read_text())
    assert {key: info[key] for key in ("task", "pooling", "dims", "output", "inputs", "activation")} == {
        "task": "rerank",
        "pooling": None,
        "dims": 1,
        "output": "score",
        # XLM-R has one token type: its graph takes none (its tokenizer's types are all 0).
        "inputs": ["input_ids", "attention_mask"],
        "activation": "sigmoid",
    }
    # Scores are not embeddings: nothing to quantise, so no calibration.
    assert "quantization" not in info and not (model_dir / "1" / "calibration.npy").exists()
    for path in ("config.pbtxt", "configs/cpu.pbtxt", "configs/gpu.pbtxt", "configs/bundled-gpu.pbtxt"):
        config = parsed_config(model_dir / path)
        assert [(output.name, list(output.dims)) for output in config.output] == [("score", [1])], path
        assert [tensor.name for tensor in config.input] == ["input_ids", "attention_mask"], path


def test_a_bert_cross_encoders_configs_take_token_types_as_the_others(tmp_path):
    source = build_tiny_bert(tmp_path / "source", seed=7, cross_encoder=True)
    model_export(source_dir=source, repository_dir=tmp_path, name="ce", task="rerank", activation="identity")

    assert json.loads((tmp_path / "ce" / "1" / "export.json").read_text())["activation"] == "identity"
    bundled = parsed_config(tmp_path / "ce" / "config.pbtxt")
    assert [tensor.name for tensor in bundled.input] == ["input_ids", "attention_mask", "token_type_ids"]
    assert all(tensor.allow_ragged_batch for tensor in bundled.input)
    official = parsed_config(tmp_path / "ce" / "configs" / "cpu.pbtxt")
    assert [tensor.name for tensor in official.input][-1] == "token_type_ids"
    assert not any(tensor.allow_ragged_batch for tensor in official.input)


def test_the_checkpoints_own_activation_is_recorded(tmp_path):
    source = build_tiny_bert(tmp_path / "source", seed=8, cross_encoder=True)
    config = json.loads((source / "config.json").read_text())
    # How sentence-transformers (v4+) saves a CrossEncoder trained without a sigmoid.
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (source / "config.json").write_text(json.dumps(config))
    result = model_export(source_dir=source, repository_dir=tmp_path / "repository", name="ce", task="rerank")
    assert result.activation == "identity"


def test_what_a_cross_encoder_export_refuses(tmp_path):
    embedder = build_tiny_bert(tmp_path / "embedder", seed=9)
    two_labels = build_tiny_bert(tmp_path / "classifier", seed=9, cross_encoder=True)
    config = json.loads((two_labels / "config.json").read_text())
    config["id2label"] = {"0": "no", "1": "yes"}
    config["label2id"] = {"no": 0, "yes": 1}
    (two_labels / "config.json").write_text(json.dumps(config))
    repository = tmp_path / "repository"

    def export(*args: str) -> None:
        call_command("export_model", "--repository", str(repository), *args, stdout=io.StringIO())

    with pytest.raises(CommandError, match="classifies into 2 labels; a cross-encoder for reranking has one"):
        export("--source", str(two_labels), "--name", "two", "--task", "rerank")
    with pytest.raises(CommandError, match="--pooling is an embedding model's"):
        export("--source", str(two_labels), "--name", "x", "--task", "rerank", "--pooling", "cls")
    with pytest.raises(CommandError, match="--activation is a rerank model's"):
        export("--source", str(embedder), "--name", "x", "--activation", "sigmoid")
    # A rerank export is never a new version of an embedding model, nor the other way round.
    export("--source", str(embedder), "--name", "shared", "--pooling", "cls")
    reranker = build_tiny_bert(tmp_path / "reranker", seed=9, cross_encoder=True)
    with pytest.raises(
        CommandError,
        match=r"version 1 is an embedding model; this export is a rerank model \(a cross-encoder\)",
    ):
        export("--source", str(reranker), "--name", "shared", "--task", "rerank")
    assert not (repository / "two").exists() and sorted(
        p.name for p in (repository / "shared").iterdir()
    ) == [
        "1",
        "config.pbtxt",
        "configs",
    ]
