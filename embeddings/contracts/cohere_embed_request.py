"""The body of POST /v2/embed in Cohere's v2 shape, read as the official `cohere` SDK sends it.

Texts come as `texts` (strings) or `inputs` (objects whose `content` is a list of text parts); images,
in either, are refused: this server embeds text. `input_type` is Cohere's required word for what the
texts are for; `embedding_types` asks for several output types at once.
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema_field, extend_schema_serializer
from rest_framework import serializers

from embeddings.contracts.embeddings_request import (
    TEXT_ERRORS,
    TEXT_SCHEMA,
    StringListField,
    refuse_empty_texts,
)
from embeddings.contracts.fields import StrictCharField, StrictIntegerField, dimensions_field
from embeddings.model_tasks import INPUT_TYPE_ALIASES, INPUT_TYPES, OUTPUT_TYPES

# Cohere's input types: its search_* words, the catalog's others, and image (refused here).
COHERE_INPUT_TYPES = [
    *INPUT_TYPE_ALIASES,
    *(kind for kind in INPUT_TYPES if kind not in ("query", "document")),
]
# base64: the float vector's little-endian float32 bytes, base64-encoded, as Cohere answers it.
EMBEDDING_TYPES = [*OUTPUT_TYPES, "base64"]
TRUNCATE_CHOICES = ["NONE", "START", "END"]


@extend_schema_field(
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "content": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"type": {"type": "string", "enum": ["text"]}, "text": TEXT_SCHEMA},
                        "required": ["type", "text"],
                    },
                    "minItems": 1,
                }
            },
            "required": ["content"],
        },
        "minItems": 1,
        "description": "Cohere's mixed inputs, text parts only (joined with a space into one text each).",
    }
)
class CohereInputsField(serializers.Field):
    default_error_messages = {
        "invalid": 'must be an array of objects like {{"content": [{{"type": "text", "text": "..."}}]}}',
        "empty": "must not be empty",
        "image": "item {index} has an image: this server embeds text only",
        **TEXT_ERRORS,
    }

    def to_internal_value(self, data: object) -> list[str]:
        if not isinstance(data, list):
            self.fail("invalid")
        if not data:
            self.fail("empty")
        texts = []
        for index, item in enumerate(data):
            content = item.get("content") if isinstance(item, dict) else None
            if (
                not isinstance(content, list)
                or not content
                or not all(isinstance(part, dict) for part in content)
            ):
                self.fail("invalid")
            if any(part.get("type") == "image_url" or "image_url" in part for part in content):
                self.fail("image", index=index)
            parts = [part.get("text") for part in content]
            if any(part.get("type") != "text" for part in content) or not all(
                type(text) is str for text in parts
            ):
                self.fail("invalid")
            texts.append(" ".join(parts))
        refuse_empty_texts(texts, self)
        return texts

    def to_representation(self, value):
        return value


@extend_schema_field({"type": "array", "items": TEXT_SCHEMA, "minItems": 1, "example": ["hello", "goodbye"]})
class CohereTextsField(StringListField):
    pass


# `images` is read only to refuse it, so the schema leaves it out.
@extend_schema_serializer(exclude_fields=["images"])
class CohereEmbedRequest(serializers.Serializer):
    model = StrictCharField(lookup=True, help_text="A model id from GET /v1/models (or one of its aliases).")
    input_type = serializers.ChoiceField(
        choices=COHERE_INPUT_TYPES,
        error_messages={
            "invalid_choice": '"{input}" is not an input type here (this server embeds text only)'
        },
        help_text="What the texts are for (search_query, search_document, classification, clustering): "
        "picks the model's prompt for it where it maps one (GET /v1/models `input_types`). Cohere's "
        "`image` is refused: this server embeds text.",
    )
    texts = CohereTextsField(required=False, help_text="The texts to embed (or give `inputs`).")
    images = serializers.JSONField(required=False)
    inputs = CohereInputsField(required=False)
    embedding_types = serializers.ListField(
        child=serializers.ChoiceField(choices=EMBEDDING_TYPES),
        min_length=1,
        required=False,
        help_text="The types to answer, each under its name in `embeddings` (default: float). int8/uint8 "
        "share one scale calibrated at export; binary/ubinary pack signs eight to a byte; "
        "base64 is the float vector's bytes.",
    )
    truncate = serializers.ChoiceField(
        choices=TRUNCATE_CHOICES,
        default="END",
        help_text="A text longer than the model takes: END cuts its end, START its start, NONE refuses it "
        "(413).",
    )
    output_dimension = dimensions_field()
    max_tokens = StrictIntegerField(
        min_value=2,
        required=False,
        allow_null=True,
        help_text="Each text keeps at most this many tokens (special tokens included), cut as `truncate` "
        "says.",
    )
    priority = StrictIntegerField(required=False, allow_null=True, help_text="Accepted and ignored.")

    def validate(self, attrs: dict) -> dict:
        if "images" in attrs:
            raise serializers.ValidationError({"images": "this server embeds text only, not images"})
        if ("texts" in attrs) == ("inputs" in attrs):
            raise serializers.ValidationError({"texts": "give either texts or inputs"})
        attrs["embedding_types"] = list(dict.fromkeys(attrs.get("embedding_types") or ["float"]))
        return attrs
