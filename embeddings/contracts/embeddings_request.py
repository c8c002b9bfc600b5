"""The body of an embeddings request (POST /v1/embeddings, and each line of a batch), read and
validated the same way wherever it arrives.

Inputs can be 2,048 items long, so the input fields check types in one pass each instead of
running a DRF field per item.
"""

from __future__ import annotations

from dataclasses import dataclass

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from embeddings.contracts.fields import (
    INT32_MAX,
    StrictBooleanField,
    StrictCharField,
    dimensions_field,
    validated,
)
from embeddings.model_tasks import INPUT_TYPE_ALIASES, INPUT_TYPES, OUTPUT_TYPES

INPUT_HELP = (
    "A string, an array of strings, an array of token ids, or an array of arrays of token ids "
    "(ids of the model's own tokenizer, used as given)."
)


@dataclass(frozen=True)
class ParsedInput:
    """Either texts or pre-tokenised ids, never both."""

    texts: list[str] | None = None
    token_ids: list[list[int]] | None = None

    def __len__(self) -> int:
        return len(self.texts if self.texts is not None else self.token_ids or ())


def is_token_list(value: object) -> bool:
    return isinstance(value, list) and all(type(item) is int for item in value)


# A text to embed has at least one character: OpenAI refuses "" too, and an empty text has no
# meaning to embed (it would be the model's special tokens alone).
TEXT_SCHEMA = {"type": "string", "minLength": 1}
# Ids of the model's tokenizer: below its vocabulary's size (422 unsupported_by_model above it),
# which no tokenizer has 2^31 of.
TOKEN_ID_SCHEMA = {"type": "integer", "minimum": 0, "maximum": INT32_MAX}
TEXT_ERRORS = {"empty_text": "must not be an empty string", "empty_item": "item {index} is an empty string"}


def refuse_empty_texts(texts: list[str], field: serializers.Field, *, single: bool = False) -> None:
    if "" in texts:
        if single:
            field.fail("empty_text")
        field.fail("empty_item", index=texts.index(""))


def _parse_texts(data: object, field: serializers.Field) -> list[str]:
    if isinstance(data, str):
        refuse_empty_texts([data], field, single=True)
        return [data]
    if not isinstance(data, list):
        field.fail("invalid")
    if not data:
        field.fail("empty")
    if not all(type(item) is str for item in data):
        field.fail("invalid")
    refuse_empty_texts(data, field)
    return data


@extend_schema_field(
    {
        "oneOf": [
            TEXT_SCHEMA,
            {"type": "array", "items": TEXT_SCHEMA, "minItems": 1},
            {"type": "array", "items": TOKEN_ID_SCHEMA, "minItems": 1},
            {
                "type": "array",
                "items": {"type": "array", "items": TOKEN_ID_SCHEMA, "minItems": 1},
                "minItems": 1,
            },
        ],
        "description": INPUT_HELP,
        "example": ["The food was delicious and the waiter was friendly."],
    }
)
class EmbeddingInputField(serializers.Field):
    default_error_messages = {
        "invalid": "must be a string, an array of strings, an array of token ids or an array of arrays "
        "of token ids",
        "empty": "must not be empty",
        "empty_tokens": "item {index} is an empty array of token ids",
        "token_range": f"item {{index}} has a token id outside 0 to {INT32_MAX}",
        **TEXT_ERRORS,
    }

    def to_internal_value(self, data: object) -> ParsedInput:
        if isinstance(data, list) and data and all(type(item) is int for item in data):
            self._check_range([data])
            return ParsedInput(token_ids=[data])
        if isinstance(data, list) and data and isinstance(data[0], list):
            if not all(is_token_list(item) for item in data):
                self.fail("invalid")
            for index, item in enumerate(data):
                if not item:
                    self.fail("empty_tokens", index=index)
            self._check_range(data)
            return ParsedInput(token_ids=data)
        return ParsedInput(texts=_parse_texts(data, self))

    def _check_range(self, rows: list[list[int]]) -> None:
        """The schema's bounds (an id no model has); the model's vocabulary is the tokenizer's check."""
        for index, row in enumerate(rows):
            if min(row) < 0 or max(row) > INT32_MAX:
                self.fail("token_range", index=index)

    def to_representation(self, value):
        return value


@extend_schema_field(
    {
        "oneOf": [TEXT_SCHEMA, {"type": "array", "items": TEXT_SCHEMA, "minItems": 1}],
        "example": "What is Deep Learning?",
    }
)
class TextsField(serializers.Field):
    default_error_messages = {
        "invalid": "must be a string or an array of strings",
        "empty": "must not be empty",
        **TEXT_ERRORS,
    }

    def to_internal_value(self, data: object) -> list[str]:
        return _parse_texts(data, self)

    def to_representation(self, value):
        return value


def input_type_field(help_text: str = "") -> serializers.ChoiceField:
    """What the inputs are for: picks the model's prompt for it (GET /v1/models `input_types`);
    a model that maps none embeds every input type alike."""
    return serializers.ChoiceField(
        choices=[*INPUT_TYPES, *INPUT_TYPE_ALIASES],
        required=False,
        allow_null=True,
        help_text=help_text
        or "What the inputs are for: picks the model's prompt for it where the model maps one (GET "
        "/v1/models `input_types`); otherwise it changes nothing.",
    )


def output_type_field(name: str = "output_dtype", default: str = "float") -> serializers.ChoiceField:
    return serializers.ChoiceField(
        choices=list(OUTPUT_TYPES),
        default=default,
        help_text="`float`, or quantised: `int8`/`uint8` (one byte a dimension, one scale for every "
        "dimension calibrated at export), `binary`/`ubinary` (sign bits packed eight to a byte, as signed "
        "int8 or uint8; dimensions a multiple of 8). With `encoding_format: base64`, the bytes of that "
        "type.",
    )


LONG_INPUTS = ("truncate", "refuse", "chunk")


def long_inputs_field() -> serializers.ChoiceField:
    """What to do with an input longer than the model takes (ours, beside each API's own switch)."""
    return serializers.ChoiceField(
        choices=list(LONG_INPUTS),
        required=False,
        help_text="An input longer than the model takes: `truncate` it (as the truncation field says), "
        "`refuse` it (413 naming it and its tokens), or `chunk`: embed it in overlapping chunks of the "
        "model's maximum, sent with the other inputs, and answer the token-weighted mean of their "
        "vectors, normalised; every chunk's tokens are counted. Texts only. Default: as `truncation` "
        "(or TEI's `truncate`) says.",
    )


def long_inputs_resolve(attrs: dict, *, switch: str) -> None:
    """`attrs["long_inputs"]` from itself or, absent, from the API's own boolean `switch`
    (`truncation`, `truncate`: optional, true when absent, so that whether it was sent is known);
    the switch, when sent, must agree with it (`chunk` agrees with either: it neither truncates nor
    refuses)."""
    sent = switch in attrs
    truncates = attrs.setdefault(switch, True)
    mode = attrs.get("long_inputs")
    if mode is None:
        attrs["long_inputs"] = "truncate" if truncates else "refuse"
        return
    if sent and mode != "chunk" and (mode == "truncate") != truncates:
        raise serializers.ValidationError(
            {"long_inputs": f"long_inputs {mode!r} and {switch} {str(truncates).lower()} disagree; give one"}
        )


class OpenAIEmbeddingsRequest(serializers.Serializer):
    model = StrictCharField(lookup=True, help_text="A model id from GET /v1/models (or one of its aliases).")
    input = EmbeddingInputField(help_text=INPUT_HELP)
    encoding_format = serializers.ChoiceField(
        choices=["float", "base64"],
        default="float",
        help_text="`base64`: each embedding is the base64 of its little-endian float32 bytes.",
    )
    dimensions = dimensions_field()
    user = StrictCharField(
        lookup=True,
        required=False,
        allow_blank=True,
        max_length=256,
        help_text="Your end user's id, recorded (in the request's log line).",
    )
    # Voyage's fields, beside OpenAI's: none of them changes an answer OpenAI's SDK gets.
    input_type = input_type_field()
    output_dtype = output_type_field()
    output_dimension = dimensions_field(help_text="Voyage's name for `dimensions` (give one of them).")
    truncation = StrictBooleanField(
        required=False,
        help_text="Default true. false: an input longer than the model takes is refused (413) instead of "
        "truncated.",
    )
    # Ours: embedding long inputs in chunks, which neither OpenAI nor Voyage offers on this route.
    long_inputs = long_inputs_field()

    def validate(self, attrs: dict) -> dict:
        long_inputs_resolve(attrs, switch="truncation")
        both = attrs.get("dimensions"), attrs.get("output_dimension")
        if None not in both and both[0] != both[1]:
            raise serializers.ValidationError(
                {"output_dimension": "dimensions and output_dimension differ; give one of them"}
            )
        return attrs


def embeddings_request_parse(body: object) -> dict:
    """An embeddings request's fields: model, texts or token_ids, dimensions, encoding_format;
    raises what the endpoint refuses it with (a DRF ValidationError, or ValidationFailed)."""
    params = validated(OpenAIEmbeddingsRequest, body)
    parsed: ParsedInput = params["input"]
    return {
        "model": params["model"],
        "texts": parsed.texts,
        "token_ids": parsed.token_ids,
        "dimensions": params.get("dimensions") or params.get("output_dimension"),
        "encoding_format": params["encoding_format"],
        "input_type": params.get("input_type"),
        "output_type": params["output_dtype"],
        "truncate": params["truncation"],
        "long_inputs": params["long_inputs"],
    }


class StringListField(serializers.Field):
    """A non-empty array of non-empty strings, checked in one pass (jobs' and Cohere's texts)."""

    default_error_messages = {
        "invalid": "must be an array of strings",
        "empty": "must not be empty",
        **TEXT_ERRORS,
    }

    def to_internal_value(self, data: object) -> list[str]:
        if not isinstance(data, list) or not all(type(item) is str for item in data):
            self.fail("invalid")
        if not data:
            self.fail("empty")
        refuse_empty_texts(data, self)
        return data

    def to_representation(self, value):
        return value
