"""What int8 and float16 exports share (embeddings/tooling/model_variants.py): below the threshold
the export is refused naming the figures and leaves nothing behind; a cross-encoder, or a threshold
that makes no sense, is refused before anything is exported; and the neighbour recall they are
measured by."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest
from django.core.management import CommandError, call_command

from embeddings.services.inference.exports import ModelExportError, model_export_versions
from embeddings.tooling.model_export import model_export
from embeddings.tooling.model_variants import VARIANT_DTYPES, recall_at_k
from tests.tiny_models import build_tiny_bert

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), seed=7)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bert(tmp_path_factory.mktemp("cross-encoder"), seed=3, cross_encoder=True)


@pytest.mark.parametrize("dtype", VARIANT_DTYPES)
def test_below_the_threshold_the_export_is_refused_naming_the_figure(tiny_bert, tmp_path, dtype):
    # No variant agrees exactly: rounding its weights moves every vector a little.
    refusal = rf"{dtype} graph disagrees with float32 on held_out\.txt: min cosine 0\.\d{{8}} < 1\.0 required"
    with pytest.raises(CommandError, match=refusal) as refused:
        call_command(
            "export_model",
            *("--source", str(tiny_bert), "--name", "tiny", "--repository", str(tmp_path)),
            *("--dtype", dtype, "--min-cosine", "1.0"),
            stdout=io.StringIO(),
        )
    assert "--min-cosine" in str(refused.value)
    assert model_export_versions(repository_dir=tmp_path, name="tiny") == []
    assert [path.name for path in (tmp_path / "tiny").iterdir()] == []  # no scratch left behind


@pytest.mark.parametrize("dtype", VARIANT_DTYPES)
def test_thresholds_that_make_no_sense_are_refused_before_exporting(tiny_bert, tmp_path, dtype):
    for bad in (0.0, -0.5, 1.5, float("nan"), True):
        with pytest.raises(ModelExportError, match=f"the {dtype} export's min cosine must be in"):
            model_export(
                source_dir=tiny_bert, repository_dir=tmp_path, name="t", dtype=dtype, min_variant_cosine=bad
            )
    args = ["export_model", "--source", str(tiny_bert), "--repository", str(tmp_path)]
    with pytest.raises(CommandError, match="a min cosine is a number in"):
        call_command(*args, "--dtype", dtype, "--min-cosine", "1.01", stdout=io.StringIO())
    assert not (tmp_path / "t").exists() and not (tmp_path / "minilm").exists()


def test_a_threshold_without_a_variant_is_refused(tiny_bert, tmp_path):
    with pytest.raises(ModelExportError, match="not float32's"):
        model_export(source_dir=tiny_bert, repository_dir=tmp_path, name="t", min_variant_cosine=0.99)
    with pytest.raises(CommandError, match="--min-cosine is an int8 or float16 export's"):
        call_command(
            "export_model",
            *("--source", str(tiny_bert), "--repository", str(tmp_path), "--min-cosine", "0.999"),
            stdout=io.StringIO(),
        )
    assert not (tmp_path / "t").exists() and not (tmp_path / "minilm").exists()


@pytest.mark.parametrize("dtype", VARIANT_DTYPES)
def test_a_cross_encoder_is_float32_only(cross_encoder, tmp_path, dtype):
    with pytest.raises(ModelExportError, match=f"only an embedding model exports as {dtype}"):
        model_export(source_dir=cross_encoder, repository_dir=tmp_path, name="ce", task="rerank", dtype=dtype)
    with pytest.raises(
        CommandError, match=f"--dtype {dtype} is an embedding model's; a cross-encoder exports as float32"
    ):
        call_command(
            "export_model",
            *("--source", str(cross_encoder), "--repository", str(tmp_path), "--task", "rerank"),
            *("--dtype", dtype),
            stdout=io.StringIO(),
        )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.unit
def test_recall_at_k_counts_shared_neighbours():
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(50, 8))
    assert recall_at_k(vectors, vectors, 10) == 1.0
    assert recall_at_k(vectors, rng.normal(size=(50, 8)), 10) < 0.5  # unrelated neighbours
    swapped = vectors.copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # two texts' vectors exchanged: their neighbours change
    assert 0.8 < recall_at_k(vectors, swapped, 10) < 1.0
