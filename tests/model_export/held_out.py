"""An exported graph's vectors of the held-out texts, computed apart from the export's own code."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from embeddings.tooling.calibration_corpus import HELD_OUT_CORPUS, read_corpus
from embeddings.tooling.export_threads import cpu_session


def held_out_vectors(version_dir: Path) -> np.ndarray:
    """The exported graph on the held-out texts one at a time (no padding), as its tokenizer reads them."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(version_dir / "tokenizer.json"))
    session = cpu_session(version_dir / "model.onnx")
    rows = []
    for text in read_corpus(HELD_OUT_CORPUS):
        ids = np.array([tokenizer.encode(text).ids], dtype=np.int64)
        rows.append(session.run(["embedding"], {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0][0])
    return np.stack(rows).astype(np.float64)
