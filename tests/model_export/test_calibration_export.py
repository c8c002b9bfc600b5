"""An embedding model's export calibrates int8/uint8: the shipped corpus embedded by the exported
graph (calibration.npy), export.json's record of it, what the service reads back, and an export
made before calibration redone by `export_model --if-missing` (what `make setup` runs)."""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
from django.core.management import call_command

from embeddings.services.inference.quantization import (
    CALIBRATION_METHOD,
    calibration_from_vectors,
    model_calibration,
    quantized,
)
from embeddings.tooling.calibration_corpus import CALIBRATION_CORPUS, HELD_OUT_CORPUS, read_corpus
from embeddings.tooling.export_threads import cpu_session
from embeddings.tooling.model_export import model_export
from tests.tiny_models import build_tiny_bert

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), seed=5)


@pytest.fixture(scope="module")
def exported(tiny_bert: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    repository = tmp_path_factory.mktemp("repository")
    model_export(source_dir=tiny_bert, repository_dir=repository, name="tiny", pooling="mean")
    return repository


@pytest.fixture(scope="module")
def re_embedded(exported: Path) -> np.ndarray:
    return embedded_one_by_one(exported / "tiny" / "1", read_corpus(CALIBRATION_CORPUS))


def embedded_one_by_one(version_dir: Path, texts: list[str]) -> np.ndarray:
    """The exported graph on each text alone (no padding), tokenised by the exported tokenizer."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(version_dir / "tokenizer.json"))
    session = cpu_session(version_dir / "model.onnx")
    rows = []
    for text in texts:
        ids = np.array([tokenizer.encode(text).ids], dtype=np.int64)
        rows.append(session.run(["embedding"], {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0][0])
    return np.stack(rows)


def export_command(*args: str) -> str:
    stdout = io.StringIO()
    call_command("export_model", *args, stdout=stdout)
    return stdout.getvalue()


def test_the_corpus_is_shipped_and_the_held_out_texts_are_apart():
    calibration, held_out = read_corpus(CALIBRATION_CORPUS), read_corpus(HELD_OUT_CORPUS)
    assert (len(calibration), len(held_out)) == (2000, 500)
    assert len(set(calibration)) == 2000 and not set(calibration) & set(held_out)
    assert all(40 <= len(text) <= 200 and text.endswith(".") for text in calibration + held_out)
    assert CALIBRATION_CORPUS.stat().st_size + HELD_OUT_CORPUS.stat().st_size < 500_000


def test_the_export_saves_the_corpus_vectors_and_records_them(exported):
    version_dir = exported / "tiny" / "1"
    vectors = np.load(version_dir / "calibration.npy")
    info = json.loads((version_dir / "export.json").read_text())

    assert (vectors.dtype, vectors.shape) == (np.float32, (2000, 128))
    assert info["quantization"] == {
        "corpus": "calibration.txt",
        "corpus_sha256": hashlib.sha256(CALIBRATION_CORPUS.read_bytes()).hexdigest(),
        "texts": 2000,
        "vectors": "calibration.npy",
        "vectors_sha256": hashlib.sha256((version_dir / "calibration.npy").read_bytes()).hexdigest(),
        "method": CALIBRATION_METHOD,
    }


def test_the_vectors_are_the_corpus_re_embedded_in_its_order(exported, re_embedded):
    """Every text embedded alone again gives the saved row (the export batched, sorted and padded
    them), so the ranges are those of the vectors the service computes."""
    saved = np.load(exported / "tiny" / "1" / "calibration.npy")
    np.testing.assert_allclose(saved, re_embedded, atol=2e-6)


def test_the_service_reads_the_ranges_of_re_embedded_vectors(exported, re_embedded):
    for dimensions in (None, 32):
        calibration = model_calibration(exported, "tiny", "", dimensions=dimensions, normalize=True)
        expected = calibration_from_vectors(re_embedded, dimensions=dimensions)
        np.testing.assert_allclose(calibration.minimum, expected.minimum, atol=2e-6)
        np.testing.assert_allclose(calibration.maximum, expected.maximum, atol=2e-6)
    # Held-out texts quantise inside the calibrated range almost everywhere: few codes at the ends.
    held_out = embedded_one_by_one(exported / "tiny" / "1", read_corpus(HELD_OUT_CORPUS)[:100])
    calibration = model_calibration(exported, "tiny", "1", dimensions=None, normalize=True)
    assert np.isin(quantized(held_out, "uint8", calibration), (0, 255)).mean() < 0.01


def test_a_version_replaced_gets_new_vectors_and_a_cross_encoder_none(tiny_bert, tmp_path):
    model_export(source_dir=tiny_bert, repository_dir=tmp_path, name="tiny", pooling="mean")
    version_dir = tmp_path / "tiny" / "1"
    mean = np.load(version_dir / "calibration.npy")

    model_export(source_dir=tiny_bert, repository_dir=tmp_path, name="tiny", pooling="cls", version=1)
    cls = np.load(version_dir / "calibration.npy")
    assert cls.shape == mean.shape and not np.allclose(cls, mean)
    record = json.loads((version_dir / "export.json").read_text())["quantization"]
    assert (
        record["vectors_sha256"] == hashlib.sha256((version_dir / "calibration.npy").read_bytes()).hexdigest()
    )

    reranker = build_tiny_bert(tmp_path / "reranker", seed=6, cross_encoder=True)
    model_export(source_dir=reranker, repository_dir=tmp_path, name="tiny", task="rerank", version=1)
    assert "quantization" not in json.loads((version_dir / "export.json").read_text())
    assert not (version_dir / "calibration.npy").exists()
    assert model_calibration(tmp_path, "tiny", "1", dimensions=None, normalize=True) is None


def test_an_export_from_before_calibration_is_redone_by_if_missing(tiny_bert, tmp_path):
    """What `make setup` does with a MiniLM exported before this: `export_model --if-missing
    --version 1` finds no calibration record, exports version 1 again, and it is calibrated."""
    common = ("--source", str(tiny_bert), "--repository", str(tmp_path), "--name", "tiny")
    export_command(*common)
    version_dir = tmp_path / "tiny" / "1"
    info = json.loads((version_dir / "export.json").read_text())
    del info["quantization"]
    (version_dir / "export.json").write_text(json.dumps(info))
    (version_dir / "calibration.npy").unlink()
    assert model_calibration(tmp_path, "tiny", "", dimensions=None, normalize=True) is None

    output = export_command(*common, "--if-missing", "--version", "1")

    assert "predates the int8/uint8 calibration (quantization)); exporting version 1 again" in output
    assert model_calibration(tmp_path, "tiny", "", dimensions=None, normalize=True).dims == 128
    assert "skipping" in export_command(*common, "--if-missing", "--version", "1")
