"""TEI's POST /tokenize and POST /decode: a model's tokenizer, no model run.

Thin: validate, pick the model (TEI's /embed's: the one named, else the default embedding model),
call the tokenizing service (services/inference/tokenizing.py), render. Metered as requests (the
service's docstring says how), logged and counted like the other TEI routes.
"""

from __future__ import annotations

from drf_spectacular.utils import OpenApiExample, OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from embeddings.api.authentication import model_for_request
from embeddings.api.base import ApiView
from embeddings.api.docs import ERRORS, error_response
from embeddings.api.served import embedding_response, log_request
from embeddings.contracts.fields import validated
from embeddings.contracts.tokenize_request import TeiDecodeRequest, TeiTokenizeRequest
from embeddings.errors.service import ModelNotLoaded, QuotaUnavailable
from embeddings.services.inference.tokenizing import texts_tokenize, token_ids_decode

# "What is Deep Learning?" as MiniLM's tokenizer reads it.
EXAMPLE_TEXT = "What is Deep Learning?"
EXAMPLE_TOKENS = [
    {"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None},
    {"id": 2054, "text": "What", "special": False, "start": 0, "stop": 4},
    {"id": 2003, "text": "is", "special": False, "start": 5, "stop": 7},
    {"id": 2784, "text": "Deep", "special": False, "start": 8, "stop": 12},
    {"id": 4083, "text": "Learning", "special": False, "start": 13, "stop": 21},
    {"id": 1029, "text": "?", "special": False, "start": 21, "stop": 22},
    {"id": 102, "text": "[SEP]", "special": True, "start": None, "stop": None},
]
EXAMPLE_IDS = [token["id"] for token in EXAMPLE_TOKENS]

# No model runs, so no model server's deadline (504); what a 503 can be here.
TOKENIZER_ERRORS = {
    **{status: answer for status, answer in ERRORS.items() if status != 504},
    503: error_response(
        "The model is registered but its export, with its tokenizer, is not in the model repository "
        "(`model_not_loaded`), or quotas cannot be checked (Redis down, QUOTA_REDIS_FAILURE=closed)",
        ModelNotLoaded(model="bge-small", triton_model="bge_small", version="2"),
        QuotaUnavailable("Rate limiting is unavailable, so the request was not served; retry shortly."),
    ),
}


class TeiTokenSerializer(serializers.Serializer):
    """Documentation: one token as TEI's /tokenize answers it."""

    id = serializers.IntegerField(help_text="Its id in the model's vocabulary")
    text = serializers.CharField(
        help_text="The text it stands for: the input's bytes from `start` to `stop`, or the special "
        "token itself (e.g. `[CLS]`)"
    )
    special = serializers.BooleanField(help_text="A special token the tokenizer added (add_special_tokens)")
    start = serializers.IntegerField(
        allow_null=True,
        help_text="Where its text starts in the input (with the prompt, if one applies), as a UTF-8 byte "
        "offset, as TEI counts; null for an added special token",
    )
    stop = serializers.IntegerField(
        allow_null=True, help_text="Where its text ends (a UTF-8 byte offset); or null"
    )


TOKENIZE_RESPONSE = OpenApiResponse(
    serializers.ListSerializer(child=TeiTokenSerializer(many=True)),
    description="Each input's tokens, in input order (one list for a single string)",
)

DECODE_RESPONSE = OpenApiResponse(
    {"type": "array", "items": {"type": "string"}},
    description="Each sequence's text, in input order (one for a single sequence)",
)


class TeiTokenizeView(ApiView):
    endpoint = "tei_tokenize"

    @extend_schema(
        operation_id="tokenize",
        summary="Tokenize inputs (TEI)",
        description="TEI's shape: each input's tokens, untruncated, with UTF-8 byte offsets. The model is "
        "the one named, else the default embedding model. Metered as requests (request rates and "
        "concurrency; usage counts the inputs and no tokens).",
        request=TeiTokenizeRequest,
        responses={200: TOKENIZE_RESPONSE, **TOKENIZER_ERRORS},
        examples=[
            OpenApiExample(
                "A text", value={"inputs": EXAMPLE_TEXT, "add_special_tokens": True}, request_only=True
            ),
            OpenApiExample("Its tokens", value=EXAMPLE_TOKENS, response_only=True, status_codes=["200"]),
        ],
        tags=["tokenizer"],
    )
    async def post(self, request: Request) -> Response:
        params = validated(TeiTokenizeRequest, request.data)
        model = await model_for_request(self, params.get("model"), embeds=False)
        result = await texts_tokenize(
            model=model,
            texts=params["inputs"],
            add_special_tokens=params["add_special_tokens"],
            prompt_name=params.get("prompt_name"),
            quota=self.request_quota(model),
        )
        log_request(self.caller, self.endpoint, model, result, action="tokenize")
        return embedding_response([[token._asdict() for token in row] for row in result.answers], result)


class TeiDecodeView(ApiView):
    endpoint = "tei_decode"

    @extend_schema(
        operation_id="decode",
        summary="Decode token ids (TEI)",
        description="TEI's shape: each sequence's text. The model is the one named, else the default "
        "embedding model. Metered as requests, as /tokenize is.",
        request=TeiDecodeRequest,
        responses={200: DECODE_RESPONSE, **TOKENIZER_ERRORS},
        examples=[
            OpenApiExample("One sequence", value={"ids": EXAMPLE_IDS}, request_only=True),
            OpenApiExample(
                "Two sequences, special tokens kept",
                value={"ids": [EXAMPLE_IDS, [7592, 2088]], "skip_special_tokens": False},
                request_only=True,
            ),
            OpenApiExample(
                "Its text", value=["what is deep learning?"], response_only=True, status_codes=["200"]
            ),
        ],
        tags=["tokenizer"],
    )
    async def post(self, request: Request) -> Response:
        params = validated(TeiDecodeRequest, request.data)
        model = await model_for_request(self, params.get("model"), embeds=False)
        result = await token_ids_decode(
            model=model,
            ids=params["ids"],
            skip_special_tokens=params["skip_special_tokens"],
            quota=self.request_quota(model),
        )
        log_request(self.caller, self.endpoint, model, result, action="decode")
        return embedding_response(result.answers, result)
