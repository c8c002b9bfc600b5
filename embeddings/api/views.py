"""HTTP views. Thin: validate, call the embedding service, render."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiExample,
    OpenApiParameter,
    extend_schema,
    extend_schema_field,
)
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from embeddings.api.authentication import ModelCall, model_for_request
from embeddings.api.base import ApiView
from embeddings.api.docs import AUTH_ERRORS, ERRORS, EXAMPLE_VECTOR, EmbeddingVectorField
from embeddings.api.middleware import ARRIVED
from embeddings.api.schema import ListLengthAutoSchema
from embeddings.api.served import embedding_response, log_request
from embeddings.contracts.embeddings_request import (
    TEXT_SCHEMA,
    OpenAIEmbeddingsRequest,
    ParsedInput,
    TextsField,
    long_inputs_field,
    long_inputs_resolve,
    refuse_empty_texts,
)
from embeddings.contracts.fields import StrictBooleanField, StrictCharField, dimensions_field, validated
from embeddings.model_tasks import ACTIVATION_IDENTITY, ACTIVATION_SIGMOID
from embeddings.models import TASK_RERANK, EmbeddingModel
from embeddings.services.inference import catalog
from embeddings.services.inference.embedding import (
    EmbeddingOptions,
    EmbeddingResult,
    EmbeddingTarget,
    embeddings_create,
    model_output_types,
)
from embeddings.services.inference.exports import DTYPE_FLOAT32, DTYPES
from embeddings.services.inference.ranking import SIMILARITY_SCORE_RANGE
from embeddings.services.inference.serving import embedding_model_engine
from embeddings.services.openai_api.embeddings_body import embeddings_response_body
from embeddings.services.quotas.limits import RequestQuota

# --- Request and response shapes -------------------------------------------------------------------


@extend_schema_field(
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"query": TEXT_SCHEMA},
            "required": ["query"],
        },
        "minItems": 1,
        "example": [{"query": "hello"}, {"query": "world"}],
    }
)
class SeedQueriesField(serializers.Field):
    default_error_messages = {
        "invalid": 'must be an array of objects like {{"query": "text"}}',
        "empty": "must not be empty",
        "empty_item": "item {index}'s query is an empty string",
    }

    def to_internal_value(self, data: object) -> list[str]:
        if not isinstance(data, list):
            self.fail("invalid")
        if not data:
            self.fail("empty")
        try:
            texts = [item["query"] for item in data]
        except (TypeError, KeyError):
            self.fail("invalid")
        if not all(type(text) is str for text in texts):
            self.fail("invalid")
        refuse_empty_texts(texts, self)
        return texts

    def to_representation(self, value):
        return value


class TeiEmbedRequest(serializers.Serializer):
    inputs = TextsField()
    model = StrictCharField(lookup=True, required=False, help_text="Default: the server's default model.")
    truncate = StrictBooleanField(
        required=False,
        help_text="Default true: truncate inputs longer than the model's maximum; false: refuse them (413).",
    )
    truncation_direction = serializers.ChoiceField(choices=["Left", "Right"], default="Right")
    prompt_name = StrictCharField(
        lookup=True,
        required=False,
        allow_null=True,
        help_text="A prompt of the model, e.g. `query`, prepended to inputs (one it lacks: 422 "
        "unsupported_by_model).",
    )
    normalize = StrictBooleanField(default=True)
    dimensions = dimensions_field()
    long_inputs = long_inputs_field()

    def validate(self, attrs: dict) -> dict:
        long_inputs_resolve(attrs, switch="truncate")
        return attrs


class UsageSerializer(serializers.Serializer):
    prompt_tokens = serializers.IntegerField()
    total_tokens = serializers.IntegerField()


class EmbeddingObjectSerializer(serializers.Serializer):
    object = serializers.CharField(default="embedding")
    index = serializers.IntegerField()
    embedding = EmbeddingVectorField()


class OpenAIEmbeddingsResponse(serializers.Serializer):
    object = serializers.CharField(default="list")
    data = EmbeddingObjectSerializer(many=True)
    model = serializers.CharField()
    usage = UsageSerializer()


class SeedQuerySerializer(serializers.Serializer):
    """One item of the seed endpoint's request body (documentation; SeedQueriesField validates)."""

    query = serializers.CharField(min_length=1)


class SeedEmbeddingSerializer(serializers.Serializer):
    embedding = serializers.ListField(child=serializers.FloatField())


class TeiEmbeddingSerializer(serializers.Serializer):
    embedding = serializers.ListField(child=serializers.FloatField())
    index = serializers.IntegerField()


class TimingsSerializer(serializers.Serializer):
    tokenization = serializers.FloatField(help_text="milliseconds")
    queue = serializers.FloatField(help_text="milliseconds from arrival to the start of tokenisation")
    inference = serializers.FloatField(help_text="milliseconds in Triton")


class TeiEmbedResponse(serializers.Serializer):
    data = TeiEmbeddingSerializer(many=True)
    model = serializers.CharField()
    usage = UsageSerializer()
    timings = TimingsSerializer()


class EngineSerializer(serializers.Serializer):
    name = serializers.CharField(
        allow_null=True,
        help_text="What runs it: onnxruntime-cpu, onnxruntime-cuda, tensorrt or pytorch "
        "(TRITON_MODEL_CONFIG_NAME picks it)",
    )
    precision = serializers.CharField(
        allow_null=True, help_text="What it computes in: float32, float16, int8"
    )


class RerankCapabilitySerializer(serializers.Serializer):
    method = serializers.ChoiceField(choices=["cross_encoder", "cosine_similarity"])
    activation = serializers.ChoiceField(
        choices=["sigmoid", "identity"],
        allow_null=True,
        help_text="A cross-encoder's: what turns its logit into the score (TEI's raw_scores skips it); "
        "null for similarity",
    )
    score_range = serializers.ListField(
        child=serializers.FloatField(),
        allow_null=True,
        help_text="The lowest and highest score; null for a cross-encoder's unbounded logits (identity)",
    )


class AgreementSerializer(serializers.Serializer):
    reference = serializers.ChoiceField(
        choices=[DTYPE_FLOAT32], help_text="What the variant was measured against: its float32 graph"
    )
    min_cosine = serializers.FloatField(
        help_text="The lowest cosine of a text's vector from this graph to its float32 one"
    )
    mean_cosine = serializers.FloatField()
    recall_at_10 = serializers.FloatField(
        help_text="Each text a query against the others: the share of float32's ten nearest this graph's hold"
    )
    text_count = serializers.IntegerField(help_text="Held-out texts measured")


class ModelObjectSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField(default="model")
    created = serializers.IntegerField(help_text="Unix seconds")
    owned_by = serializers.CharField()
    task = serializers.ChoiceField(choices=["embed", "rerank"], help_text="What it answers")
    dimensions = serializers.IntegerField()
    max_tokens = serializers.IntegerField()
    aliases = serializers.ListField(child=serializers.CharField())
    rerank = RerankCapabilitySerializer(
        allow_null=True, help_text="How it answers rerank requests; null: it does not rank"
    )
    engine = EngineSerializer(
        allow_null=True, help_text="The engine answering it, as Triton serves it; null when Triton cannot say"
    )
    input_types = serializers.DictField(
        child=serializers.CharField(),
        allow_null=True,
        help_text="Input type (query, document, classification, clustering) -> the prompt a request's "
        "`input_type` picks; null: every input type embeds alike",
    )
    output_types = serializers.ListField(
        child=serializers.CharField(),
        help_text="What `output_dtype` / `embedding_types` may ask of it (int8 and uint8 need an export "
        "calibrated for them; binary types a width that is a multiple of 8)",
    )
    dtype = serializers.ChoiceField(
        choices=list(DTYPES),
        allow_null=True,
        help_text="The weights of the graph that serves it (its pinned export's): float32, int8 (for "
        "CPUs) or float16 (for GPUs); null when the export cannot be read. Not `output_dtype`: an int8 "
        "or float16 model answers float vectors like any other",
    )
    agreement = AgreementSerializer(
        allow_null=True,
        help_text="An int8 or float16 model's agreement with its float32 graph, measured at export on "
        "held-out texts; null for float32",
    )


class ModelListSerializer(serializers.Serializer):
    object = serializers.CharField(default="list")
    data = ModelObjectSerializer(many=True)


# --- Views -----------------------------------------------------------------------------------------


def usage(result: EmbeddingResult) -> dict:
    return {"prompt_tokens": result.total_tokens, "total_tokens": result.total_tokens}


class OpenAIEmbeddingsView(ApiView):
    endpoint = "openai"

    @extend_schema(
        operation_id="create_embeddings",
        summary="Create embeddings (OpenAI-compatible)",
        description="Works with the official `openai` SDKs: point `base_url` at `/v1`.",
        request=OpenAIEmbeddingsRequest,
        responses={200: OpenAIEmbeddingsResponse, **ERRORS},
        examples=[
            OpenApiExample(
                "Two texts",
                value={"model": "all-MiniLM-L6-v2", "input": ["hello", "world"], "encoding_format": "float"},
                request_only=True,
            ),
            OpenApiExample(
                "Token ids, base64, 64 dimensions",
                value={
                    "model": "all-MiniLM-L6-v2",
                    "input": [[7592, 2088]],
                    "encoding_format": "base64",
                    "dimensions": 64,
                },
                request_only=True,
            ),
            OpenApiExample(
                "Floats",
                value={
                    "object": "list",
                    "data": [
                        {"object": "embedding", "index": 0, "embedding": EXAMPLE_VECTOR},
                        {"object": "embedding", "index": 1, "embedding": EXAMPLE_VECTOR},
                    ],
                    "model": "all-MiniLM-L6-v2",
                    "usage": {"prompt_tokens": 2, "total_tokens": 2},
                },
                response_only=True,
                status_codes=["200"],
            ),
        ],
        tags=["embeddings"],
    )
    async def post(self, request: Request) -> Response:
        params = validated(OpenAIEmbeddingsRequest, request.data)
        return embedding_response(*await openai_embeddings(self, params))


class EmbeddingsCall(ModelCall, Protocol):
    """What openai_embeddings needs of a request's handler: OpenAIEmbeddingsView, or the express
    lane's call (embeddings/api/express.py), which answer alike."""

    endpoint: str

    def request_quota(self, model: EmbeddingModel) -> RequestQuota: ...


async def openai_embeddings(call: EmbeddingsCall, params: dict) -> tuple[dict, EmbeddingResult]:
    """POST /v1/embeddings once its body is valid (`params`, OpenAIEmbeddingsRequest's): the
    answer's body, and the result its headers tell of."""
    model = await model_for_request(call, params["model"])
    parsed: ParsedInput = params["input"]
    result = await embeddings_create(
        target=EmbeddingTarget.for_model(model),
        texts=parsed.texts,
        token_ids=parsed.token_ids,
        options=EmbeddingOptions(
            dimensions=params.get("dimensions") or params.get("output_dimension"),
            input_type=params.get("input_type"),
            output_type=params["output_dtype"],
            truncate=params["long_inputs"] == "truncate",
            chunk=params["long_inputs"] == "chunk",
        ),
        quota=call.request_quota(model),
        cache_scope=None if call.caller is None else call.caller.cache_scope_for(model),
    )
    log_request(call.caller, call.endpoint, model, result, params.get("user", ""))
    body = embeddings_response_body(
        model_name=model.name,
        vectors=result.vectors,
        total_tokens=result.total_tokens,
        encoding_format=params["encoding_format"],
    )
    return body, result


class SeedEmbeddingView(ApiView):
    endpoint = "seed"
    # Its body is an array: `[]` is documented as refused (minItems 1).
    schema = ListLengthAutoSchema()

    @extend_schema(
        operation_id="create_embedding_seed",
        summary="Embed queries (the seed proxy's shape)",
        description='`[{"query": "..."}, ...]` → `[{"embedding": [...]}, ...]`, with the default model.',
        request=SeedQuerySerializer(many=True, min_length=1),
        responses={200: SeedEmbeddingSerializer(many=True), **ERRORS},
        # drf-spectacular lists a many=True example itself: each value is one item of the array.
        examples=[
            OpenApiExample("One query", value={"query": "hello"}, request_only=True),
            OpenApiExample(
                "One embedding", value={"embedding": EXAMPLE_VECTOR}, response_only=True, status_codes=["200"]
            ),
        ],
        tags=["embeddings"],
    )
    async def post(self, request: Request) -> Response:
        texts = SeedQueriesField().run_validation(request.data)
        model = await model_for_request(self, None)
        result = await embeddings_create(
            target=EmbeddingTarget.for_model(model),
            texts=texts,
            quota=self.request_quota(model),
            cache_scope=None if self.caller is None else self.caller.cache_scope_for(model),
        )
        log_request(self.caller, self.endpoint, model, result)
        return embedding_response([{"embedding": vector} for vector in result.vectors], result)


TEI_EMBED_SCHEMA = dict(
    request=TeiEmbedRequest,
    responses={200: TeiEmbedResponse, **ERRORS},
    examples=[
        OpenApiExample(
            "A query with a prompt",
            value={"inputs": ["What is Deep Learning?"], "truncate": True, "normalize": True},
            request_only=True,
        ),
        OpenApiExample(
            "One embedding with timings",
            value={
                "data": [{"embedding": EXAMPLE_VECTOR, "index": 0}],
                "model": "all-MiniLM-L6-v2",
                "usage": {"prompt_tokens": 8, "total_tokens": 8},
                "timings": {"tokenization": 0.05, "queue": 0.12, "inference": 2.4},
            },
            response_only=True,
            status_codes=["200"],
        ),
    ],
    tags=["embeddings"],
)


class TeiEmbedView(ApiView):
    endpoint = "tei"

    @extend_schema(
        operation_id="embed", summary="Embed inputs (TEI-like shape, with timings)", **TEI_EMBED_SCHEMA
    )
    async def post(self, request: Request) -> Response:
        arrived = request._request.META.get(ARRIVED, time.perf_counter())
        params = validated(TeiEmbedRequest, request.data)
        model = await model_for_request(self, params.get("model"))
        queue_s = time.perf_counter() - arrived
        result = await embeddings_create(
            target=EmbeddingTarget.for_model(model),
            texts=params["inputs"],
            options=EmbeddingOptions(
                truncate=params["long_inputs"] == "truncate",
                chunk=params["long_inputs"] == "chunk",
                direction="left" if params["truncation_direction"] == "Left" else "right",
                dimensions=params.get("dimensions"),
                normalize=params["normalize"],
                prompt_name=params.get("prompt_name"),
            ),
            quota=self.request_quota(model),
            cache_scope=None if self.caller is None else self.caller.cache_scope_for(model),
        )
        log_request(self.caller, self.endpoint, model, result)
        return embedding_response(
            {
                "data": [{"embedding": vector, "index": i} for i, vector in enumerate(result.vectors)],
                "model": model.name,
                "usage": usage(result),
                "timings": {
                    "tokenization": result.tokenization_s * 1000,
                    "queue": queue_s * 1000,
                    "inference": result.inference_s * 1000,
                },
            },
            result,
        )


class TeiEmbedShortView(TeiEmbedView):
    """The same endpoint at the seed's short path, documented as its own operation."""

    # Its own async method: drf-spectacular's extend_schema_view would wrap the inherited one in a
    # sync function, which adrf then refuses to await.
    @extend_schema(
        operation_id="embed_short",
        summary="Embed inputs (TEI-like shape; `/embed` alias)",
        **TEI_EMBED_SCHEMA,
    )
    async def post(self, request: Request) -> Response:
        return await super().post(request)


MODEL_EXAMPLE = {
    "id": "all-MiniLM-L6-v2",
    "object": "model",
    "created": 1767225600,
    "owned_by": "embedsite",
    "task": "embed",
    "dimensions": 384,
    "max_tokens": 256,
    "aliases": ["minilm", "sentence-transformers/all-MiniLM-L6-v2"],
    "rerank": {"method": "cosine_similarity", "activation": None, "score_range": [-1.0, 1.0]},
    "engine": {"name": "onnxruntime-cpu", "precision": "float32"},
    "input_types": None,
    "output_types": ["float", "int8", "uint8", "binary", "ubinary"],
    "dtype": "float32",
    "agreement": None,
}


def model_object(model: EmbeddingModel, engine: dict | None) -> dict:
    """The model as /v1/models lists it; `engine` is embedding_model_engine's."""
    return {
        "id": model.name,
        "object": "model",
        "created": int(model.created_at.timestamp()),
        "owned_by": model.owned_by,
        "task": model.task,
        "dimensions": model.dimensions,
        "max_tokens": model.max_tokens,
        "aliases": list(model.aliases or []),
        "rerank": rerank_capability(model),
        "engine": engine,
        "input_types": dict(model.input_types) if model.input_types else None,
        "output_types": model_output_types(model),
        **catalog.embedding_model_dtype(model=model),
    }


def rerank_capability(model: EmbeddingModel) -> dict | None:
    """How the model ranks documents, and the range of its scores; None when it does not."""
    if model.task == TASK_RERANK:
        activation = model.score_activation or ACTIVATION_IDENTITY
        bounds = [0.0, 1.0] if activation == ACTIVATION_SIGMOID else None
        return {"method": "cross_encoder", "activation": activation, "score_range": bounds}
    if model.rerank_by_similarity:
        return {
            "method": "cosine_similarity",
            "activation": None,
            "score_range": list(SIMILARITY_SCORE_RANGE),
        }
    return None


class ModelListView(ApiView):
    endpoint = "models"

    @extend_schema(
        operation_id="list_models",
        summary="Models this key may use",
        responses={200: ModelListSerializer, **AUTH_ERRORS},
        examples=[
            OpenApiExample(
                "The local model",
                value={"object": "list", "data": [MODEL_EXAMPLE]},
                response_only=True,
                status_codes=["200"],
            )
        ],
        tags=["models"],
    )
    async def get(self, request: Request) -> Response:
        models = await catalog.embedding_models_for_caller(caller=request.user)
        engines = await asyncio.gather(*(embedding_model_engine(model=model) for model in models))
        data = [model_object(model, engine) for model, engine in zip(models, engines, strict=True)]
        return Response({"object": "list", "data": data})


class ModelDetailView(ApiView):
    endpoint = "model"

    @extend_schema(
        operation_id="retrieve_model",
        summary="One model",
        parameters=[
            OpenApiParameter(
                "model_id",
                OpenApiTypes.STR,
                OpenApiParameter.PATH,
                description="A model id or alias; it may contain `/`.",
            )
        ],
        responses={200: ModelObjectSerializer, **AUTH_ERRORS, 404: ERRORS[404]},
        examples=[
            OpenApiExample("The local model", value=MODEL_EXAMPLE, response_only=True, status_codes=["200"])
        ],
        tags=["models"],
    )
    async def get(self, request: Request, model_id: str) -> Response:
        model = await model_for_request(self, model_id, embeds=False)
        return Response(model_object(model, await embedding_model_engine(model=model)))
