"""Request validation and the documented response shapes of the embedding endpoints.

Inputs can be 2,048 items long, so the input fields check types in one pass each instead of
running a DRF field per item.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from django.core.validators import ProhibitNullCharactersValidator, RegexValidator
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from embeddings.services.callback_targets import CallbackTargetError
from embeddings.services.job_callbacks import callback_target_check
from embeddings.services.jobs import JOB_ID_PATTERN
from embeddings.services.keys import KEY_PREFIX, KEY_PUBLIC_ID_PATTERN
from embeddings.services.result_dtypes import RESULT_DTYPES

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


# --- JSON types taken as they are ------------------------------------------------------------------
# DRF's fields coerce: "user": 0 becomes "0", "normalize": 0 becomes false, "dimensions": "64"
# becomes 64. A JSON body must send the type the schema names; multipart form fields are text by
# nature and keep DRF's reading (the serializer's context says `form`).


def _is_form(field: serializers.Field) -> bool:
    return bool(field.context.get("form"))


class StrictCharField(serializers.CharField):
    """A JSON string, taken as sent; a number or a boolean is refused.

    DRF would strip surrounding whitespace first: a model named " minilm" was found, and a "\v"
    refused as blank although the schema's minLength counts it.

    lookup: the value is only looked up or recorded (a model's name, a prompt's), never stored in
    the database, so a NUL (which PostgreSQL cannot store) is a character like any other: it names
    no model, where DRF would refuse it against the schema's word.
    """

    def __init__(self, *, lookup: bool = False, **options) -> None:
        super().__init__(trim_whitespace=False, **options)
        if lookup:
            self.validators = [
                validator
                for validator in self.validators
                if not isinstance(validator, ProhibitNullCharactersValidator)
            ]

    def to_internal_value(self, data):
        if not isinstance(data, str) and not _is_form(self):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictBooleanField(serializers.BooleanField):
    """JSON true or false; 0, 1 and strings are refused. As a form field, `true` or `false` (DRF
    would also read 0, 1, yes, no, on, off...)."""

    default_error_messages = {"invalid": "Must be true or false."}
    FORM_VALUES = {"true": True, "false": False}

    def to_internal_value(self, data):
        if _is_form(self):
            if data not in self.FORM_VALUES:
                self.fail("invalid")
            return self.FORM_VALUES[data]
        if not isinstance(data, bool):
            self.fail("invalid")
        return data


# The bound of every integer that counts a model's or a job's things (dimensions, token ids, inputs):
# the database keeps them in 32-bit columns, and no model or job comes near it.
INT32_MAX = 2**31 - 1

# An integer written as text (a query parameter, a form field): ASCII digits, a minus sign at most.
# Python's int() would also read " 1", "+1", "1_000" and other scripts' digits, and DRF's field
# "1.0": none of them is an integer as the schema writes one.
DECIMAL_INTEGER = re.compile(r"-?[0-9]+")
INTEGER_TEXT_ERROR = "A valid integer is required: decimal digits only, e.g. 20."


def _integer_text(field: serializers.IntegerField, data: object) -> None:
    if not isinstance(data, str) or not DECIMAL_INTEGER.fullmatch(data):
        field.fail("invalid")


class StrictIntegerField(serializers.IntegerField):
    """A JSON integer (5.0 is one, as JSON Schema reads it); strings and booleans are refused. As a
    form field, decimal digits only."""

    default_error_messages = {"invalid": INTEGER_TEXT_ERROR}

    def to_internal_value(self, data):
        if _is_form(self):
            _integer_text(self, data)
        elif isinstance(data, bool) or not isinstance(data, int | float):
            self.fail("invalid")
        elif isinstance(data, float):
            # JSON integers past 64 bits arrive as floats (orjson): still integers, held to the bounds.
            if not data.is_integer():
                self.fail("invalid")
            data = int(data)
        return super().to_internal_value(data)


class QueryIntegerField(serializers.IntegerField):
    """An integer query parameter: decimal digits only, and bounded (the schema's `maximum`), so
    that no value outgrows what the response can echo (orjson renders at most 64-bit integers)."""

    default_error_messages = {"invalid": INTEGER_TEXT_ERROR}

    def __init__(self, *, min_value: int, max_value: int, **options) -> None:
        super().__init__(min_value=min_value, max_value=max_value, **options)

    def to_internal_value(self, data):
        _integer_text(self, data)
        return super().to_internal_value(data)


def id_schema(pattern: str) -> dict:
    """The schema of a path parameter that is an object's id (`pattern`, as its service draws it)."""
    return {"type": "string", "pattern": f"^{pattern}$"}


def cursor_field(*, pattern: str, what: str) -> serializers.CharField:
    """A list's `after`: an id from the previous page (its last_id), or empty for the first page. A
    string that cannot be an id is 422; an id of no object of yours, 404 (as in a path)."""
    # \A and \Z: the whole value (a "$" would also match before a trailing newline); the schema
    # shows them as ^ and $, beside the empty string allow_blank adds.
    return serializers.CharField(
        required=False,
        allow_blank=True,
        trim_whitespace=False,
        validators=[RegexValidator(rf"\A{pattern}\Z", message=f"must be {what} from a previous page")],
        help_text=f"{what[0].upper()}{what[1:]} from the previous page (its `last_id`): the page "
        "after it. Empty: the first page.",
    )


def dimensions_field() -> StrictIntegerField:
    """The optional `dimensions` of requests and jobs: an integer from 1. Whether the model has that
    many is the services' rule (embeddings.services.embedding.dimensions_check: 422
    unsupported_by_model)."""
    return StrictIntegerField(
        min_value=1,
        max_value=INT32_MAX,
        required=False,
        allow_null=True,
        help_text="Keep the first N dimensions, re-normalised: at most the model's `dimensions` "
        "(GET /v1/models; more is 422 unsupported_by_model).",
    )


def _is_token_list(value: object) -> bool:
    return isinstance(value, list) and all(type(item) is int for item in value)


# A text to embed has at least one character: OpenAI refuses "" too, and an empty text has no
# meaning to embed (it would be the model's special tokens alone).
TEXT_SCHEMA = {"type": "string", "minLength": 1}
# Ids of the model's tokenizer: below its vocabulary's size (422 unsupported_by_model above it),
# which no tokenizer has 2^31 of.
TOKEN_ID_SCHEMA = {"type": "integer", "minimum": 0, "maximum": INT32_MAX}
TEXT_ERRORS = {"empty_text": "must not be an empty string", "empty_item": "item {index} is an empty string"}


def _refuse_empty_texts(texts: list[str], field: serializers.Field, *, single: bool = False) -> None:
    if "" in texts:
        if single:
            field.fail("empty_text")
        field.fail("empty_item", index=texts.index(""))


def _parse_texts(data: object, field: serializers.Field) -> list[str]:
    if isinstance(data, str):
        _refuse_empty_texts([data], field, single=True)
        return [data]
    if not isinstance(data, list):
        field.fail("invalid")
    if not data:
        field.fail("empty")
    if not all(type(item) is str for item in data):
        field.fail("invalid")
    _refuse_empty_texts(data, field)
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
            if not all(_is_token_list(item) for item in data):
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
        _refuse_empty_texts(texts, self)
        return texts

    def to_representation(self, value):
        return value


class TeiEmbedRequest(serializers.Serializer):
    inputs = TextsField()
    model = StrictCharField(lookup=True, required=False, help_text="Default: the server's default model.")
    truncate = StrictBooleanField(
        default=True, help_text="Truncate inputs longer than the model's maximum; false: refuse them (413)."
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


# --- Documented responses ---------------------------------------------------------------------


class UsageSerializer(serializers.Serializer):
    prompt_tokens = serializers.IntegerField()
    total_tokens = serializers.IntegerField()


@extend_schema_field(
    {
        "oneOf": [
            {"type": "array", "items": {"type": "number", "format": "float"}},
            {"type": "string", "format": "byte"},
        ],
        "description": "A float array, or with encoding_format=base64 the base64 of the vector's "
        "little-endian float32 bytes.",
    }
)
class EmbeddingVectorField(serializers.JSONField):
    """Documentation only: responses are rendered straight from numpy arrays."""


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


class ModelObjectSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField(default="model")
    created = serializers.IntegerField(help_text="Unix seconds")
    owned_by = serializers.CharField()
    dimensions = serializers.IntegerField()
    max_tokens = serializers.IntegerField()
    aliases = serializers.ListField(child=serializers.CharField())


class ModelListSerializer(serializers.Serializer):
    object = serializers.CharField(default="list")
    data = ModelObjectSerializer(many=True)


class ErrorDetailSerializer(serializers.Serializer):
    message = serializers.CharField()
    type = serializers.CharField()
    param = serializers.CharField(allow_null=True)
    code = serializers.CharField(allow_null=True)
    request_id = serializers.CharField(required=False, help_text="The response's X-Request-Id")


class ErrorSerializer(serializers.Serializer):
    error = ErrorDetailSerializer()


# --- GET /v1/usage ------------------------------------------------------------------------------


@extend_schema_field(
    {
        "anyOf": [
            {"type": "string", "format": "date"},
            {"type": "string", "format": "date-time"},
            {"type": "string", "maxLength": 0},
        ]
    }
)
class UsageBoundField(serializers.CharField):
    """A bound of GET /v1/usage's range, read by the view (embeddings/api/usage.py parse_bound)."""

    def __init__(self, **options) -> None:
        super().__init__(required=False, allow_blank=True, trim_whitespace=False, **options)


class UsageQuery(serializers.Serializer):
    """The query string of GET /v1/usage (the view turns the bounds into datetimes). An empty
    value means the parameter's default, as if it were not sent."""

    start = UsageBoundField(
        help_text="UTC date `YYYY-MM-DD` (from its midnight) or ISO 8601 datetime (from the start of "
        "its hour; without an offset, UTC), from 1970-01-01 to 9999-01-01. Default: the first day of "
        "end's UTC month."
    )
    end = UsageBoundField(
        help_text="UTC date `YYYY-MM-DD` (that day included) or ISO 8601 datetime (exclusive; without "
        "an offset, UTC), from 1970-01-01 to 9999-01-01, after start and at most 366 days from it. "
        "Default: now."
    )
    group_by = serializers.ChoiceField(choices=["day", "model", "key"], default="day")
    key = serializers.CharField(
        required=False,
        allow_blank=True,
        trim_whitespace=False,
        # The public id alone, or the key's first part or whole (its secret is not read).
        validators=[
            RegexValidator(
                rf"\A(?:{KEY_PREFIX})?{KEY_PUBLIC_ID_PATTERN}(?:_[A-Za-z0-9_-]{{0,100}})?\Z",
                message="must be an API key's public id",
            )
        ],
        help_text="Only this key of yours: its public id (`emb_<public id>_…`'s middle).",
    )


class UsageCountersSerializer(serializers.Serializer):
    requests = serializers.IntegerField()
    succeeded = serializers.IntegerField()
    rejected = serializers.IntegerField(help_text="Refused by a quota or rate limit")
    failed = serializers.IntegerField(help_text="Accepted, then failed")
    inputs = serializers.IntegerField()
    tokens = serializers.IntegerField()
    mean_latency_ms = serializers.FloatField(allow_null=True, help_text="Null without requests")


class UsageKeySerializer(serializers.Serializer):
    id = serializers.CharField(help_text="The key's public id")
    name = serializers.CharField()


class UsageRowSerializer(UsageCountersSerializer):
    day = serializers.DateField(required=False, help_text="group_by=day")
    model = serializers.CharField(required=False, help_text="group_by=model")
    key = UsageKeySerializer(
        required=False, allow_null=True, help_text="group_by=key; null: no key, or a deleted one"
    )


class JobStorageSerializer(serializers.Serializer):
    used_bytes = serializers.IntegerField(help_text="Bytes your jobs hold in the job store now")
    budget_bytes = serializers.IntegerField(help_text="Bytes your jobs may hold at once")
    available_bytes = serializers.IntegerField(help_text="budget_bytes - used_bytes (at least 0)")


class UsageResponse(serializers.Serializer):
    object = serializers.CharField(default="usage")
    start = serializers.DateTimeField()
    end = serializers.DateTimeField()
    group_by = serializers.CharField()
    includes_unfolded = serializers.BooleanField(
        help_text="True: counters not yet folded into the database are included (up to the second)"
    )
    totals = UsageCountersSerializer()
    data = UsageRowSerializer(many=True)
    quota = serializers.JSONField(
        allow_null=True,
        help_text="Limits and current windows of your tenant and this key; null if unreadable",
    )
    job_storage = JobStorageSerializer(
        help_text="Your jobs' inputs and results held in the job store, against your budget: a job "
        "that would not fit is refused (429 or 413 job_storage_budget_exceeded)"
    )


# --- /v1/jobs -----------------------------------------------------------------------------------

# As OpenAI's metadata: at most 16 pairs, keys up to 64 characters, values up to 512.
METADATA_MAX_PAIRS = 16
METADATA_MAX_KEY_CHARS = 64
METADATA_MAX_VALUE_CHARS = 512


@extend_schema_field(
    {
        "type": "object",
        # Keys' bounds cannot be written in OpenAPI 3.0 (propertyNames is 3.1's): the description says them.
        "additionalProperties": {
            "type": "string",
            "maxLength": METADATA_MAX_VALUE_CHARS,
            "pattern": "^[^\\u0000]*$",
        },
        "maxProperties": METADATA_MAX_PAIRS,
        "description": f"Up to {METADATA_MAX_PAIRS} string pairs of your own, returned with the job "
        f"(keys up to {METADATA_MAX_KEY_CHARS} characters, values up to {METADATA_MAX_VALUE_CHARS}; "
        "no NUL character).",
        "example": {"corpus": "wiki-2026-11"},
    }
)
class MetadataField(serializers.Field):
    default_error_messages = {
        "invalid": "must be an object of string keys and string values",
        "too_many": f"may have at most {METADATA_MAX_PAIRS} pairs",
        "key_too_long": f"keys may have at most {METADATA_MAX_KEY_CHARS} characters",
        "value_too_long": f"values may have at most {METADATA_MAX_VALUE_CHARS} characters",
        # PostgreSQL's jsonb cannot hold U+0000 (it would fail the insert, a 500).
        "key_null_character": "keys may not contain the NUL character (U+0000)",
        "value_null_character": "values may not contain the NUL character (U+0000)",
    }

    def to_internal_value(self, data: object) -> dict[str, str]:
        if not isinstance(data, dict) or not all(
            isinstance(key, str) and isinstance(value, str) for key, value in data.items()
        ):
            self.fail("invalid")
        if len(data) > METADATA_MAX_PAIRS:
            self.fail("too_many")
        if any(len(key) > METADATA_MAX_KEY_CHARS for key in data):
            self.fail("key_too_long")
        if any(len(value) > METADATA_MAX_VALUE_CHARS for value in data.values()):
            self.fail("value_too_long")
        if any("\x00" in key for key in data):
            self.fail("key_null_character")
        if any("\x00" in value for value in data.values()):
            self.fail("value_null_character")
        return data

    def to_representation(self, value):
        return value


@extend_schema_field(
    {
        "type": "array",
        "items": TEXT_SCHEMA,
        "minItems": 1,
        "description": "The texts to embed, one vector each, in this order.",
        "example": ["The first document.", "The second document."],
    }
)
class JobTextsField(serializers.Field):
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
        _refuse_empty_texts(data, self)
        return data

    def to_representation(self, value):
        return value


def callback_url_deliverable(url: str) -> None:
    """Refuse a callback_url the address policy refuses now (its host is resolved here: call from
    a thread, not the event loop)."""
    try:
        callback_target_check(url=url)
    except CallbackTargetError as error:
        raise serializers.ValidationError(error.reason) from error


class JobOptions(serializers.Serializer):
    """What a job asks for besides its inputs (JSON body fields, or multipart form fields)."""

    model = StrictCharField(lookup=True, help_text="A model id from GET /v1/models (or one of its aliases).")
    encoding_format = serializers.ChoiceField(
        choices=["float", "base64"],
        default="float",
        help_text="How `json` and `jsonl` results encode vectors (a download may ask for the other).",
    )
    dimensions = dimensions_field()
    normalize = StrictBooleanField(default=True, help_text="Unit-length vectors.")
    result_dtype = serializers.ChoiceField(
        choices=list(RESULT_DTYPES),
        required=False,
        allow_null=True,
        help_text="How the results are stored while they wait for download: `float16` takes half the "
        "memory, each value within 2^-11 of float32 relative to it (cosine to float32 above 0.9999). "
        "Downloads are float32 either way. Default: the model's setting (float32 unless set).",
    )
    metadata = MetadataField(required=False)
    callback_url = serializers.URLField(
        required=False,
        allow_blank=True,
        trim_whitespace=False,
        max_length=2000,
        # The policy first, so its reason is the message; URLField's own check still follows.
        validators=[callback_url_deliverable],
        help_text="POSTed the job when it finishes, signed (HMAC-SHA256) in the Embedsite-Signature header. "
        "http or https, to a public address: a host that does not resolve, or resolves to a loopback, "
        "private, link-local or other non-public address, is refused.",
    )


class JobCreateRequest(JobOptions):
    input = JobTextsField()


class JobUploadRequest(JobOptions):
    """The multipart form: the file and the same options as form fields (metadata as a JSON object)."""

    file = serializers.FileField(
        help_text="UTF-8 text, one input per line (blank lines skipped), or JSONL: one "
        '`{"id": ..., "text": ...}` object a line, ids kept in the results. Content type text/plain, '
        "application/jsonl (or x-ndjson) or application/octet-stream."
    )


class JobListQuery(serializers.Serializer):
    limit = QueryIntegerField(min_value=1, max_value=100, default=20, help_text="1 to 100.")
    after = cursor_field(pattern=JOB_ID_PATTERN, what="a job id (`job_` and 24 lowercase letters or digits)")


# Past the last input of any job.
RESULTS_MAX_OFFSET = INT32_MAX


class JobResultsQuery(serializers.Serializer):
    format = serializers.ChoiceField(
        choices=["jsonl", "json", "npy"],
        default="jsonl",
        help_text="`jsonl`: one object a line, streamed; `npy`: one float32 array (rows of failed "
        "inputs are NaN), streamed; `json`: one page (`offset`, `limit`).",
    )
    encoding_format = serializers.ChoiceField(
        choices=["float", "base64"], required=False, help_text="Default: the job's encoding_format."
    )
    offset = QueryIntegerField(
        min_value=0,
        max_value=RESULTS_MAX_OFFSET,
        default=0,
        help_text="`json` only: the first input (past the last one: an empty page).",
    )
    limit = QueryIntegerField(
        min_value=1, max_value=1000, default=100, help_text="`json` only: inputs per page, 1 to 1000."
    )


class JobCountsSerializer(serializers.Serializer):
    total = serializers.IntegerField()
    completed = serializers.IntegerField()
    failed = serializers.IntegerField()


class JobUsageSerializer(serializers.Serializer):
    prompt_tokens = serializers.IntegerField()


class JobErrorSerializer(serializers.Serializer):
    code = serializers.CharField()
    message = serializers.CharField()


class JobObjectSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField(default="embedding.job")
    status = serializers.ChoiceField(
        choices=["queued", "running", "completed", "failed", "cancelling", "cancelled", "expired"]
    )
    model = serializers.CharField()
    counts = JobCountsSerializer()
    usage = JobUsageSerializer()
    created_at = serializers.IntegerField(help_text="Unix seconds")
    started_at = serializers.IntegerField(allow_null=True)
    finished_at = serializers.IntegerField(allow_null=True)
    expires_at = serializers.IntegerField(allow_null=True, help_text="When the results are removed")
    error = JobErrorSerializer(allow_null=True)
    metadata = serializers.DictField(child=serializers.CharField())
    encoding_format = serializers.CharField()
    dimensions = serializers.IntegerField(allow_null=True)
    result_dtype = serializers.ChoiceField(
        choices=list(RESULT_DTYPES), help_text="How the results are stored; downloads are float32"
    )


class ListPageSerializer(serializers.Serializer):
    """A page of a list as OpenAI answers one (api/base.py list_page); subclasses name `data`'s items."""

    object = serializers.CharField(default="list", help_text='Always "list".')
    first_id = serializers.CharField(allow_null=True)
    last_id = serializers.CharField(allow_null=True)
    has_more = serializers.BooleanField()


class JobListSerializer(ListPageSerializer):
    data = JobObjectSerializer(many=True)


class JobDeletedSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField(default="embedding.job.deleted")
    deleted = serializers.BooleanField()


class JobResultObjectSerializer(serializers.Serializer):
    object = serializers.CharField(default="embedding")
    index = serializers.IntegerField()
    id = serializers.CharField(required=False, help_text="The upload's id for this input (JSONL uploads)")
    embedding = EmbeddingVectorField(allow_null=True, help_text="Null when the input's chunk failed")
    error = JobErrorSerializer(required=False)


class JobResultsPageSerializer(serializers.Serializer):
    object = serializers.CharField(default="list")
    data = JobResultObjectSerializer(many=True)
    model = serializers.CharField()
    offset = serializers.IntegerField()
    total = serializers.IntegerField()
    has_more = serializers.BooleanField()
