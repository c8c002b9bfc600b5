"""A batch line's body read and its errors rendered exactly as POST /v1/embeddings reads and answers.

The batch services take these as arguments (services never import the API): the validation reads
each line's body with the synchronous endpoint's own serializer, and a line the model refuses
gets the status and error body that endpoint would have answered.
"""

from __future__ import annotations

from embeddings.api import serializers as s
from embeddings.api.errors import as_api_error
from embeddings.api.views import validated


def line_body_parse(body: dict) -> dict:
    """The embeddings request of a line's body; raises what the endpoint would refuse it with."""
    params = validated(s.OpenAIEmbeddingsRequest, body)
    parsed: s.ParsedInput = params["input"]
    return {
        "model": params["model"],
        "texts": parsed.texts,
        "token_ids": parsed.token_ids,
        "dimensions": params.get("dimensions"),
        "encoding_format": params["encoding_format"],
    }


def line_error_render(error: Exception) -> tuple[int, dict]:
    """The status and OpenAI error body the API answers `error` with; the line's own request id is
    beside it, in its response (not that of the request that created the batch)."""
    answer = as_api_error(error)
    return answer.status, answer.body(with_request_id=False)
