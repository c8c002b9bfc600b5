"""The body of an OpenAI embeddings answer, built once for POST /v1/embeddings and batch output lines."""

from __future__ import annotations

import numpy as np

from embeddings.result_dtypes import base64_rows


def embeddings_response_body(
    *, model_name: str, vectors: np.ndarray, total_tokens: int, encoding_format: str
) -> dict:
    """`{"object": "list", "data", "model", "usage"}` as POST /v1/embeddings answers it: each
    embedding a row of `vectors` (float32, or quantised: integers), or with `base64` the base64 of
    its bytes (little-endian float32, or the quantised type's)."""
    embeddings = base64_rows(vectors) if encoding_format == "base64" else list(vectors)
    data = [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(embeddings)]
    usage = {"prompt_tokens": total_tokens, "total_tokens": total_tokens}
    return {"object": "list", "data": data, "model": model_name, "usage": usage}
